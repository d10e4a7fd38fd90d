"""Classification metrics (macro) and the confusion-matrix PNG — the one scorer of
`atd train`'s evaluation, `atd classify` and netsim.

`classification_metrics(y_true, y_pred, labels=...)` returns a JSON-ready dict:

- ``accuracy``: over all samples;
- ``balanced_accuracy``: the mean of the per-class recalls over the classes present in
  y_true (= macro ``recall``; what selection judges by, `atdnode.aggregation.keep`);
- ``precision``, ``recall`` (= ``sensitivity``, also under that name), ``f1``: macro
  averages over the classes **present in y_true** (a test set holding 3 of 10 classes is
  not scored on the 7 it never shows); a prediction of any other class counts as an error;
  per-class values with no positive predictions are 0 (sklearn's ``zero_division=0``);
- ``confusion``: rows = true, columns = predicted, over the explicit label space ``labels``
  (every index of y_true and y_pred must be in it), in that order;
- ``n``: the number of samples; ``n_per_class``: true samples per label (over ``labels``);
- ``recall_per_class``: each label's recall (None where it has no true samples);
- ``balanced_accuracy``: the mean of the per-class recalls over the classes present;
- ``ci``: a 95 % interval ``[lo, hi]`` for every number above: Wilson's score interval for
  accuracy (a proportion of ``n``) and for each per-class recall, a seeded percentile
  bootstrap (``BOOTSTRAP`` resamples of the samples, Efron & Tibshirani 1993 ch. 13) for
  the macro averages and balanced accuracy;
- ``binary`` (only when the label space has exactly 2 labels): the *positive* label is the
  second one (index 1); ``sensitivity`` (true-positive rate, n = positives),
  ``specificity`` (true-negative rate, n = negatives), both with Wilson intervals, and
  given ``probs``, ``auroc`` with a bootstrap interval (None when only one class is present);
- ``auroc_summary(y_true, probs)`` (a function of its own, the figure netsim reports beside
  accuracy): AUROC with a bootstrap interval for any number of classes -- two: the positive
  class's (index 1); more: the one-vs-rest macro average over the classes present in y_true
  (Hand & Till's "OvR macro", as sklearn's ``roc_auc_score(multi_class="ovr", average="macro")``);
- ``calibration`` (given ``probs``, the predicted probabilities over ``labels``):
  top-label expected calibration error over ``ECE_BINS`` equal-width confidence bins
  (Guo et al. 2017, eq. 3) with a bootstrap interval, and the bins (n, mean confidence,
  accuracy) that a reliability plot draws (`save_reliability_png`);
- ``paired_balanced_accuracy_se(y_true, pred_a, pred_b)``: the standard error of the difference
  in balanced accuracy of two predictors on the same samples, by a class-stratified paired
  bootstrap (what the keep decision's one-standard-error rule weighs, `atdnode.aggregation.keep`);
  ``jeffreys_paired_balanced_accuracy_se``: the same by a Bayesian bootstrap with Jeffreys
  pseudo-counts (a candidate the keep decision does not use).

Intervals are deterministic: the bootstrap draws from ``numpy.random.default_rng(seed)``.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy as np

MACRO = ("precision", "recall", "sensitivity", "f1")
Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
BOOTSTRAP = 1000  # resamples per bootstrap interval
ECE_BINS = 15


def wilson(k: int, n: int, z: float = Z95) -> list[float]:
    """Wilson's score interval [lo, hi] for k successes in n trials (Wilson 1927); [0, 1] for n = 0."""
    if n <= 0:
        return [0.0, 1.0]
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return [float(max(0.0, mid - half)), float(min(1.0, mid + half))]


def _percentile(values: np.ndarray) -> list[float]:
    values = values[np.isfinite(values)]
    if not len(values):
        return [0.0, 1.0]
    lo, hi = np.percentile(values, [2.5, 97.5])
    return [float(lo), float(hi)]


RESAMPLES_CACHED = 4_000_000  # the largest (b, n) bootstrap count table `_resamples` keeps (16 MB as int32)


def _resamples(n: int, seed: int, b: int = BOOTSTRAP) -> np.ndarray:
    """(b, n) bootstrap counts: how often each sample is drawn in each resample (read-only,
    int32, stored sample-major: `counts.T[idx]` gathers whole samples).

    A pure function of (n, seed, b): drawing 1000 multinomials is most of a small scoring's
    cost, and a run scores many predictors on one test set (the same n and seed), so the last
    few tables up to `RESAMPLES_CACHED` cells are kept and shared."""
    if n * b <= RESAMPLES_CACHED:
        return _drawn(n, seed, b)
    return _draw(n, seed, b)


def _draw(n: int, seed: int, b: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=b)  # (b, n); each row sums to n
    out = np.ascontiguousarray(counts.T, dtype=np.int32).T
    out.flags.writeable = False
    return out


_drawn = functools.lru_cache(maxsize=4)(_draw)


def _macro_from_confusions(cm: np.ndarray, present: np.ndarray) -> dict[str, np.ndarray]:
    """Macro precision / recall / F1 over `present` rows of a stack of confusions (b, K, K)."""
    tp = np.diagonal(cm, axis1=1, axis2=2)[:, present].astype(np.float64)
    support = cm.sum(2)[:, present].astype(np.float64)
    predicted = cm.sum(1)[:, present].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        prec = np.where(predicted > 0, tp / np.maximum(predicted, 1), 0.0)
        rec = np.where(support > 0, tp / np.maximum(support, 1), np.nan)
        f1 = np.where(prec + np.nan_to_num(rec) > 0, 2 * prec * np.nan_to_num(rec) / (prec + np.nan_to_num(rec)), 0.0)
    f1 = np.where(support > 0, f1, np.nan)
    prec = np.where(support > 0, prec, np.nan)
    return {"precision": np.nanmean(prec, 1), "recall": np.nanmean(rec, 1), "f1": np.nanmean(f1, 1)}


def _grouped(counts: np.ndarray, group: np.ndarray, size: int) -> np.ndarray:
    """(b, size): per resample, the summed counts of the samples in each group (0..size-1)."""
    order = np.argsort(group, kind="stable")
    g = group[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    out = np.zeros((counts.shape[0], size), dtype=np.float64)
    if len(g):
        out[:, g[starts]] = np.add.reduceat(counts[:, order], starts, axis=1)
    return out


def auroc(y: np.ndarray, score: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray | float | None:
    """Area under the ROC curve of `score` for `y` (1 positive, 0 negative), ties counted half
    (the Mann-Whitney statistic); None without both classes. With `counts` (b, n) bootstrap
    counts, the (b,) AUROCs of the resamples (NaN where a resample lacks a class).

    Computed exactly, in integers: with the samples sorted by score and C[k] the weight of the
    first k negatives, a positive in the tie group holding negatives a..b-1 beats C[a] of
    negative weight and ties C[b] - C[a], so twice the statistic is the sum over positives of
    w * (C[a] + C[b]), divided by 2 * P * N (positive and negative weight)."""
    y = np.asarray(y)
    n = len(y)
    order = np.argsort(score, kind="stable")
    s, neg, pos = score[order], y[order] == 0, y[order] == 1
    new_group = np.r_[True, s[1:] != s[:-1]] if n else np.zeros(0, dtype=bool)
    group = np.cumsum(new_group) - 1  # each sorted sample's tie group
    starts = np.flatnonzero(new_group)
    ends = np.r_[starts[1:], n] - 1
    negs_through = np.cumsum(neg)
    a, b = (negs_through[starts] - neg[starts])[group[pos]], negs_through[ends][group[pos]]  # per positive
    # (n, b') sample-major weights; each count is at most n, so int32 holds every product below
    kind = np.int32 if 2 * n * n < 2**31 else np.int64
    w = np.ones((n, 1), dtype=kind) if counts is None else counts.T[order].astype(kind, copy=False)
    c = np.zeros((int(neg.sum()) + 1, w.shape[1]), dtype=kind)
    np.cumsum(w[neg], 0, out=c[1:])  # C[k]: the weight of the first k negatives
    wp = w[pos]
    twice = (wp * (c[a] + c[b])).sum(0, dtype=np.int64)
    p_w, n_w = wp.sum(0, dtype=np.int64), c[-1].astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where((p_w > 0) & (n_w > 0), twice / (2.0 * p_w * n_w), np.nan)
    if counts is not None:
        return out
    return None if np.isnan(out[0]) else float(out[0])


def auroc_summary(y_true, probs, *, seed: int = 0) -> dict | None:
    """{"auroc", "ci"} of `probs` (N, K) for `y_true` (indices into the K columns): with K = 2
    the positive class's AUROC (column 1), else the one-vs-rest macro over the classes present
    in `y_true`; the interval is a seeded percentile bootstrap (each resample averages the
    classes it holds both ways). None when no class has positives and negatives."""
    y = np.asarray(y_true, dtype=np.int64)
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or probs.shape[0] != len(y):
        raise ValueError(f"probabilities of shape {probs.shape} for {len(y)} labels")
    cols = [1] if probs.shape[1] == 2 else [int(c) for c in np.unique(y) if (y != c).any()]
    values = [auroc((y == c).astype(np.int64), probs[:, c]) for c in cols]
    values = [v for v in values if v is not None]
    if not values:
        return None
    counts = _resamples(len(y), seed + 3)
    boot = np.vstack([auroc((y == c).astype(np.int64), probs[:, c], counts) for c in cols])  # (classes, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a resample that holds no class both ways: NaN
        per_resample = np.nanmean(boot, 0)
    return {"auroc": float(np.mean(values)), "ci": _percentile(per_resample)}


def _paired_cells(y_true, pred_a, pred_b) -> tuple[np.ndarray, np.ndarray]:
    """(the classes present in `y_true`, (K, 4) counts per class of its samples that both
    predictors get right, a only, b only, neither)."""
    y, pa, pb = (np.asarray(v, dtype=np.int64) for v in (y_true, pred_a, pred_b))
    if not (y.shape == pa.shape == pb.shape):
        raise ValueError(f"{len(y)} labels, {len(pa)} and {len(pb)} predictions")
    classes = np.unique(y)
    cells = np.zeros((len(classes), 4), dtype=np.float64)
    for i, c in enumerate(classes):
        ra, rb = pa[y == c] == c, pb[y == c] == c
        cells[i] = [(ra & rb).sum(), (ra & ~rb).sum(), (~ra & rb).sum(), (~ra & ~rb).sum()]
    return classes, cells


def paired_balanced_accuracy_se(y_true, pred_a, pred_b, *, seed: int = 0, b: int = BOOTSTRAP) -> float:
    """The standard error of balanced_accuracy(pred_a) - balanced_accuracy(pred_b) on the same
    samples: the standard deviation over `b` seeded bootstrap resamples that draw each class's
    samples from that class alone (its size, hence its weight in the balanced accuracy, stays
    fixed: stratified) and score both predictors on each resample (paired).

    A class of n_c samples falls into four cells (a right and b right, a only, b only, neither);
    a resample of it is a multinomial draw of n_c over the cells' shares, and its recall
    difference is (a only - b only) / n_c — the same distribution as resampling the samples
    themselves, drawn per class rather than per sample. 0.0 when the predictors agree on
    every sample."""
    classes, cells = _paired_cells(y_true, pred_a, pred_b)
    rng = np.random.default_rng(seed)
    diff = np.zeros(b, dtype=np.float64)
    for row in cells:
        draws = rng.multinomial(int(row.sum()), row / row.sum(), size=b)  # (b, 4)
        diff += (draws[:, 1] - draws[:, 2]) / row.sum()
    return float(np.std(diff / max(len(classes), 1), ddof=1)) if len(classes) and b > 1 else 0.0


def jeffreys_paired_balanced_accuracy_se(y_true, pred_a, pred_b, *, seed: int = 0, b: int = BOOTSTRAP) -> float:
    """`paired_balanced_accuracy_se` by a Bayesian bootstrap (Rubin 1981) under Jeffreys
    pseudo-counts: each class's shares of the four cells drawn from Dirichlet(cells + 0.5)
    rather than resampled from the empirical shares, so a class on which the two predictors
    agree on every sample, or on which one is right wherever the other is wrong, still
    contributes variance (the empirical bootstrap draws such a class identically every time).
    Positive whenever `y_true` is non-empty, even for identical predictors. A candidate rule
    weighed by `bench/medmnist_recipe_bench.py --keep-rules`; the keep decision uses
    `paired_balanced_accuracy_se`."""
    classes, cells = _paired_cells(y_true, pred_a, pred_b)
    rng = np.random.default_rng(seed)
    diff = np.zeros(b, dtype=np.float64)
    for row in cells:
        shares = rng.dirichlet(row + 0.5, size=b)  # (b, 4)
        diff += shares[:, 1] - shares[:, 2]
    return float(np.std(diff / max(len(classes), 1), ddof=1)) if len(classes) and b > 1 else 0.0


def calibration(y_true: np.ndarray, probs: np.ndarray, *, bins: int = ECE_BINS, seed: int = 0) -> dict:
    """Top-label expected calibration error (Guo et al. 2017, eq. 3) with a bootstrap 95 %
    interval, and the reliability bins {lo, hi, n, confidence, accuracy} (empty bins left out)."""
    conf = probs.max(1)
    correct = (probs.argmax(1) == y_true).astype(np.float64)
    which = np.minimum((conf * bins).astype(np.int64), bins - 1)

    def ece(w: np.ndarray) -> np.ndarray:  # (b, n) weights -> (b,) ECE
        gap = np.abs(_grouped(w * correct, which, bins) - _grouped(w * conf, which, bins))
        return gap.sum(1) / np.maximum(w.sum(1), 1e-12)

    n = len(y_true)
    counts = np.bincount(which, minlength=bins)
    out = {"n": int(n), "bins": bins, "ece": float(ece(np.ones((1, n)))[0]) if n else 0.0, "table": []}
    for b in np.flatnonzero(counts):
        m = which == b
        out["table"].append({"lo": b / bins, "hi": (b + 1) / bins, "n": int(counts[b]),
                             "confidence": float(conf[m].mean()), "accuracy": float(correct[m].mean())})
    out["ci"] = _percentile(ece(_resamples(n, seed + 1).astype(np.float64))) if n else [0.0, 1.0]
    return out


def classification_metrics(y_true, y_pred, *, labels: Iterable[int], probs=None, seed: int = 0) -> dict:
    """Accuracy, macro precision / recall (sensitivity) / F1 over the classes present in
    `y_true`, the confusion matrix over `labels`, n and a 95 % interval for each, the binary
    figures and, given `probs` (N, len(labels)), AUROC and calibration (see the module docstring)."""
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

    y_true = np.asarray(y_true, dtype=np.int64)
    y_pred = np.asarray(y_pred, dtype=np.int64)
    labels = [int(c) for c in labels]
    if y_true.shape != y_pred.shape:
        raise ValueError(f"{len(y_true)} true labels but {len(y_pred)} predictions")
    unknown = sorted((set(np.unique(y_true).tolist()) | set(np.unique(y_pred).tolist())) - set(labels))
    if unknown:
        raise ValueError(f"classes {unknown[:8]} are outside the label space of {len(labels)} classes")
    if len(y_true) == 0:
        return {"n": 0, "accuracy": 0.0, "balanced_accuracy": 0.0, **{k: 0.0 for k in MACRO}, "confusion": [[0] * len(labels) for _ in labels]}
    present = np.unique(y_true).tolist()
    p, r, f, _ = precision_recall_fscore_support(y_true, y_pred, labels=present, average="macro", zero_division=0)
    cm = confusion_matrix(y_true, y_pred, labels=labels).astype(np.int64)
    n = int(len(y_true))
    support = cm.sum(1)
    correct = int(np.trace(cm))
    out = {
        "n": n,
        "accuracy": correct / n,
        "precision": float(p),
        "recall": float(r),
        "sensitivity": float(r),
        "f1": float(f),
        "balanced_accuracy": float(r),
        "confusion": cm.tolist(),
        "n_per_class": support.astype(int).tolist(),
        "recall_per_class": [float(cm[i, i] / s) if s else None for i, s in enumerate(support)],
    }
    out["ci"] = {"accuracy": wilson(correct, n), **_bootstrap_macro(y_true, y_pred, len(labels), labels, seed),
                 "recall_per_class": [wilson(int(cm[i, i]), int(s)) if s else None for i, s in enumerate(support)]}
    if probs is not None:
        probs = np.asarray(probs, dtype=np.float64)
        if probs.shape != (n, len(labels)):
            raise ValueError(f"probabilities of shape {probs.shape}, expected {(n, len(labels))}")
    if len(labels) == 2:
        out["binary"] = _binary(y_true, cm, None if probs is None else probs[:, 1], seed)
    if probs is not None:
        out["calibration"] = calibration(y_true, probs, seed=seed)
    return out


def interval_text(value, interval, *, words: bool = False) -> str:
    """A figure with its 95 % interval as people read it: "0.865 [0.810, 0.906]", or with
    `words` "0.865 (95 % CI 0.810-0.906)"; the bare value without an interval; "-" without a value."""
    if not isinstance(value, (int, float)):
        return "-"
    if not (isinstance(interval, (list, tuple)) and len(interval) == 2):
        return f"{value:.3f}"
    lo, hi = interval
    return f"{value:.3f} (95 % CI {lo:.3f}-{hi:.3f})" if words else f"{value:.3f} [{lo:.3f}, {hi:.3f}]"


def per_class(metrics: dict, classes: list[str]) -> dict[str, dict]:
    """{class name: {n, recall, recall_ci}} for the classes with true samples (`classes`
    names the labels of `metrics`, in order)."""
    ns, rec, cis = metrics.get("n_per_class") or [], metrics.get("recall_per_class") or [], \
        (metrics.get("ci") or {}).get("recall_per_class") or []
    return {c: {"n": int(n), "recall": r, "recall_ci": ci}
            for c, n, r, ci in zip(classes, ns, rec, cis) if n}


def named_metrics(y_true, y_pred, *, classes: list[str], probs=None, seed: int = 0) -> dict:
    """`classification_metrics` over the label space `classes` (indices into it), plus
    `per_class` by name and, for two classes, the positive class's name."""
    m = classification_metrics(y_true, y_pred, labels=range(len(classes)), probs=probs, seed=seed)
    m["per_class"] = per_class(m, list(classes))
    if "binary" in m:
        m["binary"]["positive_class"] = classes[1]
    return m


STORED = ("n", "accuracy", "precision", "recall", "sensitivity", "f1", "balanced_accuracy", "ci", "binary",
          "calibration", "per_class", "robust_accuracy", "caution", "warning")  # what a scoring keeps


def _bootstrap_macro(y_true: np.ndarray, y_pred: np.ndarray, k: int, labels: list[int], seed: int) -> dict:
    """Percentile-bootstrap intervals of the macro averages (the classes present in each resample)."""
    pos = {c: i for i, c in enumerate(labels)}
    cell = np.array([pos[int(t)] * k + pos[int(q)] for t, q in zip(y_true, y_pred)], dtype=np.int64)
    cms = _grouped(_resamples(len(y_true), seed), cell, k * k).reshape(-1, k, k)  # (b, K, K) confusions
    macro = _macro_from_confusions(cms, np.arange(k))
    cis = {name: _percentile(v) for name, v in macro.items()}
    return {**cis, "sensitivity": cis["recall"], "balanced_accuracy": cis["recall"]}


def _binary(y_true: np.ndarray, cm: np.ndarray, score: np.ndarray | None, seed: int) -> dict:
    """Sensitivity / specificity (Wilson) with label 1 positive; AUROC (bootstrap) given scores."""
    tp, fn, tn, fp = int(cm[1, 1]), int(cm[1, 0]), int(cm[0, 0]), int(cm[0, 1])
    pos, neg = tp + fn, tn + fp
    out = {"positive": 1, "n_positive": pos, "n_negative": neg,
           "sensitivity": tp / pos if pos else None, "specificity": tn / neg if neg else None,
           "ci": {"sensitivity": wilson(tp, pos) if pos else None, "specificity": wilson(tn, neg) if neg else None}}
    if score is not None:
        y = (y_true == 1).astype(np.int64)
        out["auroc"] = auroc(y, score)
        if out["auroc"] is not None:
            out["ci"]["auroc"] = _percentile(auroc(y, score, _resamples(len(y), seed + 2)))
        else:
            out["ci"]["auroc"] = None
    return out


def save_confusion_png(confusion: list[list[int]], classes: list[str], path: str | Path, *, title: str = "") -> Path:
    """Render a confusion matrix to PNG (matplotlib Agg, no display needed); returns the path."""
    from atdnode.plots import png_figure

    cm = np.asarray(confusion)
    n = len(classes)
    size = max(4.0, 0.45 * n + 2)
    with png_figure(path, figsize=(size, size), dpi=100) as (fig, ax):
        ax.imshow(cm, cmap="Blues")
        ax.set_xticks(range(n), labels=classes, rotation=90 if n > 12 else 0)
        ax.set_yticks(range(n), labels=classes)
        ax.set_xlabel("predicted")
        ax.set_ylabel("true")
        if title:
            ax.set_title(title)
        if n <= 30:
            hi = cm.max() if cm.size else 0
            for i in range(n):
                for j in range(n):
                    ax.text(j, i, str(cm[i, j]), ha="center", va="center", fontsize=8,
                            color="white" if hi and cm[i, j] > hi / 2 else "black")
    return Path(path)


def save_reliability_png(calib: dict, path: str | Path, *, title: str = "") -> Path:
    """The reliability diagram of a `calibration` dict: accuracy against mean confidence per
    bin (marker area ~ n), the diagonal of perfect calibration, ECE in the legend; the path."""
    from atdnode.plots import png_figure

    rows = calib.get("table") or []
    with png_figure(path, figsize=(4.2, 4.2), dpi=100) as (fig, ax):
        ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfectly calibrated")
        if rows:
            total = max(1, sum(r["n"] for r in rows))
            ax.plot([r["confidence"] for r in rows], [r["accuracy"] for r in rows], color="tab:blue", linewidth=1)
            ax.scatter([r["confidence"] for r in rows], [r["accuracy"] for r in rows],
                       s=[20 + 400 * r["n"] / total for r in rows], color="tab:blue",
                       label=f"ECE {calib['ece']:.3f} [{calib['ci'][0]:.3f}, {calib['ci'][1]:.3f}], n={calib['n']}")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence (predicted probability)")
        ax.set_ylabel("accuracy")
        ax.legend(loc="upper left", fontsize=7)
        if title:
            ax.set_title(title, fontsize=9)
    return Path(path)
