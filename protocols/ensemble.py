"""The VGS-ATD downstream classifier (Eq. 7-8): features -> PCA -> MLP + RF + SVM, soft vote.

Pipeline (fit with scikit-learn, predict with plain numpy):

1. ``StandardScaler`` (on by default, ``standardize=False`` to skip): CLS
   features of a ViT have very different per-dimension scales, and PCA, the
   MLP and the linear SVM are all scale sensitive.
2. ``PCA`` to ``min(pca_components, n_samples, n_features)`` components
   (768 -> 500 in the paper), full SVD, so it is deterministic.
3. Members, each giving class probabilities over the same sorted class list:
   ``MLPClassifier`` (adam, lr 1e-3), ``RandomForestClassifier`` (gini,
   max_features='log2', min_samples_split=3) and ``LinearSVC`` (squared hinge,
   tol 0.01) with sigmoid-calibrated probabilities (``CalibratedClassifierCV``,
   folds = min(5, smallest class count); with a class of one sample the SVM is
   calibrated on its own training predictions instead).
4. Soft vote: the mean of the members' probabilities; ``predict`` is its argmax.
5. Class-prior correction (``prior``): the soft vote is multiplied by a per-class ratio
   target prior / training prior and renormalised (the prior-shift correction of Saerens
   et al., 2002). ``"balanced"``: the target is uniform over the classes (a classifier
   fitted on pooled data that is 90 % one class stops voting for it by default);
   ``"node"``: within the classes the node holds (``target_counts``), their share of the
   training prior is redistributed by the node's own proportions, other classes keep
   theirs; ``"none"``: no correction. The ratio is part of the exported arrays.

After ``fit`` the fitted models are exported to arrays (:meth:`to_arrays`) and
every prediction -- before or after a round trip through :meth:`from_arrays`,
:meth:`save` / :meth:`load` -- runs the same numpy code, so a restored
ensemble gives bit-identical probabilities. The random forest is stored as the
sklearn tree arrays (children, feature, threshold, value) and evaluated by a
small vectorised tree walker. No pickle anywhere; :meth:`from_arrays`
validates every shape and tree link, so arrays from a peer are safe to load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from threadpoolctl import threadpool_limits

from protocols.weightings import PRIORS

if TYPE_CHECKING:  # scikit-learn is imported where a model is fitted: predicting is numpy only,
    # so `atd classify` / `aggregate --mode horizontal` / `--verify` never pay ~1.5 s for it
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.neural_network import MLPClassifier

__all__ = ["EnsembleClassifier", "EnsembleError", "MEMBERS", "FORMAT", "PRIORS", "prior_ratio"]

MEMBERS = ("mlp", "rf", "svm")
FORMAT = "atd-ensemble-v1"
_META_KEY = "atd-ensemble"


class EnsembleError(ValueError):
    """Bad training data, bad input to predict, or malformed exported arrays."""


class EnsembleClassifier:
    """PCA -> MLP + random forest + calibrated linear SVM, soft-voted.

    Keyword-only hyper-parameters; ``seed`` fixes every random choice, so the
    same data gives the same model. Labels are integers (map class names to
    indices outside; see :func:`protocols.vgs.merge_labeled_features`).
    ``blas_threads`` caps BLAS threads while fitting (process-wide, restored
    after; ``None`` leaves them alone): the matrices are small, and on a busy
    host extra BLAS threads stall each other (10x slower MLP training seen).
    """

    def __init__(self, *, pca_components: int = 500, seed: int = 0, standardize: bool = True,
                 members: Sequence[str] = MEMBERS, mlp_hidden: Sequence[int] = (256,),
                 mlp_max_iter: int = 300, rf_trees: int = 100, svm_c: float = 1.0,
                 svm_max_iter: int = 5000, blas_threads: int | None = 1, prior: str = "none") -> None:
        if prior not in PRIORS:
            raise EnsembleError(f"prior must be one of {', '.join(PRIORS)}, got {prior!r}")
        if pca_components < 1:
            raise EnsembleError(f"pca_components must be >= 1, got {pca_components}")
        if not members or any(m not in MEMBERS for m in members) or len(set(members)) != len(members):
            raise EnsembleError(f"members must be distinct names from {MEMBERS}, got {members!r}")
        self.params = dict(pca_components=int(pca_components), seed=int(seed), standardize=bool(standardize),
                           members=list(members), mlp_hidden=[int(h) for h in mlp_hidden],
                           mlp_max_iter=int(mlp_max_iter), rf_trees=int(rf_trees), svm_c=float(svm_c),
                           svm_max_iter=int(svm_max_iter), blas_threads=blas_threads, prior=prior)
        self._arrays: dict[str, np.ndarray] | None = None
        self._meta: dict[str, Any] | None = None
        self.estimators_: dict[str, Any] = {}  # the sklearn members (fit only, not restored)

    # ------------------------------------------------------------ fitting

    def fit(self, X: np.ndarray, y: np.ndarray, *, target_counts: Mapping[int, int] | None = None
            ) -> EnsembleClassifier:
        """Fit on features ``X`` (N, D) and integer labels ``y`` (N,); needs >= 2 classes.
        ``target_counts`` (label -> count, the node's own data) is needed by ``prior="node"``."""
        if self.params["prior"] == "node" and not target_counts:
            raise EnsembleError('prior "node" needs the node\'s own class counts (target_counts)')
        with threadpool_limits(limits=self.params["blas_threads"], user_api="blas"):
            return self._fit(X, y, target_counts)

    def _fit(self, X: np.ndarray, y: np.ndarray, target_counts: Mapping[int, int] | None = None
             ) -> EnsembleClassifier:
        X = _check_X(X)
        y = np.asarray(y)
        if y.ndim != 1 or len(y) != len(X) or not np.issubdtype(y.dtype, np.integer):
            raise EnsembleError(f"y must be {len(X)} integer labels, got {y.dtype} {y.shape}")
        classes, counts = np.unique(y, return_counts=True)
        if len(classes) < 2:
            raise EnsembleError(f"need at least 2 classes to train, got {classes.tolist()}")
        p, seed = self.params, self.params["seed"]
        arrays: dict[str, np.ndarray] = {"classes": classes.astype(np.int64)}
        if p["prior"] != "none":
            arrays["prior.ratio"] = prior_ratio(p["prior"], counts, classes, target_counts)
        from sklearn.decomposition import PCA
        from sklearn.preprocessing import StandardScaler

        if p["standardize"]:
            scaler = StandardScaler().fit(X)
            X = scaler.transform(X)
            arrays["scaler.mean"], arrays["scaler.scale"] = scaler.mean_, scaler.scale_
        k = min(p["pca_components"], X.shape[0], X.shape[1])
        pca = PCA(n_components=k, svd_solver="full").fit(X)
        arrays["pca.mean"], arrays["pca.components"] = pca.mean_, pca.components_
        Z = pca.transform(X)
        meta: dict[str, Any] = {"format": FORMAT, "params": p, "n_features": int(X.shape[1]),
                                "pca_components": int(k)}
        for name in p["members"]:
            est = getattr(self, f"_fit_{name}")(Z, y, counts, seed)
            self.estimators_[name] = est
            arrays.update(getattr(self, f"_export_{name}")(est, meta))
        self._arrays, self._meta = _validate({k: np.ascontiguousarray(v) for k, v in arrays.items()}, meta)
        return self

    def _fit_mlp(self, Z: np.ndarray, y: np.ndarray, counts: np.ndarray, seed: int) -> MLPClassifier:
        from sklearn.neural_network import MLPClassifier

        return MLPClassifier(hidden_layer_sizes=tuple(self.params["mlp_hidden"]), solver="adam",
                             learning_rate_init=1e-3, max_iter=self.params["mlp_max_iter"],
                             random_state=seed).fit(Z, y)

    def _fit_rf(self, Z: np.ndarray, y: np.ndarray, counts: np.ndarray, seed: int) -> RandomForestClassifier:
        from sklearn.ensemble import RandomForestClassifier

        return RandomForestClassifier(n_estimators=self.params["rf_trees"], criterion="gini",
                                      max_features="log2", min_samples_split=3, random_state=seed,
                                      n_jobs=1).fit(Z, y)

    def _fit_svm(self, Z: np.ndarray, y: np.ndarray, counts: np.ndarray, seed: int) -> CalibratedClassifierCV:
        from sklearn.calibration import CalibratedClassifierCV
        from sklearn.frozen import FrozenEstimator
        from sklearn.model_selection import StratifiedKFold
        from sklearn.svm import LinearSVC

        svc = LinearSVC(loss="squared_hinge", tol=0.01, C=self.params["svm_c"],
                        max_iter=self.params["svm_max_iter"], random_state=seed)
        folds = min(5, int(counts.min()))
        if folds >= 2:  # held-out decision values from stratified folds, one SVM on all data
            cal = CalibratedClassifierCV(svc, method="sigmoid", ensemble=False,
                                         cv=StratifiedKFold(folds, shuffle=True, random_state=seed))
        else:  # a class with one sample cannot be held out: calibrate on training predictions
            svc.fit(Z, y)
            everything = np.arange(len(y))
            cal = CalibratedClassifierCV(FrozenEstimator(svc), method="sigmoid",
                                         cv=[(everything, everything)])
        return cal.fit(Z, y)

    @staticmethod
    def _export_mlp(mlp: MLPClassifier, meta: dict) -> dict[str, np.ndarray]:
        if mlp.activation != "relu" or mlp.out_activation_ not in ("softmax", "logistic"):
            raise EnsembleError(f"unsupported MLP activations {mlp.activation}/{mlp.out_activation_}")
        meta["mlp_layers"] = len(mlp.coefs_)
        out = {f"mlp.w{i}": w for i, w in enumerate(mlp.coefs_)}
        out.update({f"mlp.b{i}": b for i, b in enumerate(mlp.intercepts_)})
        return out

    @staticmethod
    def _export_rf(rf: RandomForestClassifier, meta: dict) -> dict[str, np.ndarray]:
        trees = [e.tree_ for e in rf.estimators_]
        meta["rf_trees"] = len(trees)
        return {"rf.offsets": np.cumsum([0] + [t.node_count for t in trees]).astype(np.int64),
                "rf.left": np.concatenate([t.children_left for t in trees]).astype(np.int64),
                "rf.right": np.concatenate([t.children_right for t in trees]).astype(np.int64),
                "rf.feature": np.concatenate([t.feature for t in trees]).astype(np.int64),
                "rf.threshold": np.concatenate([t.threshold for t in trees]).astype(np.float64),
                "rf.value": np.concatenate([t.value[:, 0, :] for t in trees]).astype(np.float64)}

    @staticmethod
    def _export_svm(cal: CalibratedClassifierCV, meta: dict) -> dict[str, np.ndarray]:
        (pair,) = cal.calibrated_classifiers_  # ensemble=False: one SVM, one calibrator per column
        svc = pair.estimator
        return {"svm.coef": np.asarray(svc.coef_, np.float64),
                "svm.intercept": np.asarray(svc.intercept_, np.float64),
                "svm.calib_a": np.array([c.a_ for c in pair.calibrators], np.float64),
                "svm.calib_b": np.array([c.b_ for c in pair.calibrators], np.float64)}

    # ------------------------------------------------------------ predicting

    @property
    def classes_(self) -> np.ndarray:
        return self._fitted()[0]["classes"]

    def _fitted(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if self._arrays is None or self._meta is None:
            raise EnsembleError("the ensemble is not fitted")
        return self._arrays, self._meta

    def transform(self, X: np.ndarray) -> np.ndarray:
        """Standardise and project onto the principal components: (N, D) -> (N, K)."""
        a, meta = self._fitted()
        X = _check_X(X)
        if X.shape[1] != meta["n_features"]:
            raise EnsembleError(f"X has {X.shape[1]} features, the ensemble was fitted on {meta['n_features']}")
        if "scaler.mean" in a:
            X = (X - a["scaler.mean"]) / a["scaler.scale"]
        return (X - a["pca.mean"]) @ a["pca.components"].T

    def member_proba(self, X: np.ndarray) -> dict[str, np.ndarray]:
        """Each member's probabilities, (N, C) over :attr:`classes_`."""
        a, meta = self._fitted()
        Z = self.transform(X)
        return {name: _PROBA[name](a, Z) for name in meta["params"]["members"]}

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """Soft vote: the mean of the members' probabilities, (N, C), prior-corrected when
        the ensemble was fitted with ``prior`` other than "none"."""
        probas = list(self.member_proba(X).values())
        p = sum(probas[1:], probas[0]) / len(probas)
        ratio = self._fitted()[0].get("prior.ratio")
        if ratio is None:
            return p
        p = p * ratio
        s = p.sum(axis=1, keepdims=True)
        return np.divide(p, s, out=np.full_like(p, 1.0 / p.shape[1]), where=s > 0)

    def predict(self, X: np.ndarray) -> np.ndarray:
        return self.classes_[np.argmax(self.predict_proba(X), axis=1)]

    def with_prior(self, prior: str, train_counts: np.ndarray,
                   target_counts: Mapping[int, int] | None = None) -> EnsembleClassifier:
        """The same fitted members under another prior correction (``train_counts``: the
        fitted class counts, in :attr:`classes_` order) -- refitting would give the same
        members, since the correction only rescales the soft vote."""
        if prior not in PRIORS:
            raise EnsembleError(f"prior must be one of {', '.join(PRIORS)}, got {prior!r}")
        a, meta = self.to_arrays()
        a.pop("prior.ratio", None)
        meta["params"]["prior"] = prior
        if prior != "none":
            a["prior.ratio"] = prior_ratio(prior, np.asarray(train_counts), a["classes"], target_counts)
        return EnsembleClassifier.from_arrays(a, meta)

    # ------------------------------------------------------------ export

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``(arrays, meta)``: numeric arrays (safetensors-compatible) and a JSON-able dict."""
        a, meta = self._fitted()
        return {k: v.copy() for k, v in a.items()}, json.loads(json.dumps(meta))

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> EnsembleClassifier:
        """Rebuild a fitted ensemble (predict only) from :meth:`to_arrays` output.
        Raises :class:`EnsembleError` if anything is missing or inconsistent."""
        if not isinstance(meta, Mapping) or meta.get("format") != FORMAT or not isinstance(meta.get("params"), dict):
            raise EnsembleError(f"not an {FORMAT} export")
        try:
            self = cls(**meta["params"])
        except TypeError as e:
            raise EnsembleError(f"bad ensemble params: {e}") from None
        self._arrays, self._meta = _validate({k: np.ascontiguousarray(v) for k, v in arrays.items()}, dict(meta))
        return self

    def save(self, path: str | os.PathLike) -> None:
        """Write a safetensors file (meta JSON in its metadata)."""
        arrays, meta = self.to_arrays()
        save_file(arrays, os.fspath(path), metadata={_META_KEY: json.dumps(meta, sort_keys=True)})

    @classmethod
    def load(cls, path: str | os.PathLike) -> EnsembleClassifier:
        try:
            with safe_open(os.fspath(path), framework="np") as f:
                meta = json.loads((f.metadata() or {})[_META_KEY])
                arrays = {k: f.get_tensor(k) for k in f.keys()}
        except (KeyError, ValueError, OSError, SafetensorError) as e:
            raise EnsembleError(f"{path}: not an ensemble file ({e})") from None
        return cls.from_arrays(arrays, meta)


# ---------------------------------------------------------------- prior correction

def prior_ratio(prior: str, counts: np.ndarray, classes: np.ndarray,
                target_counts: Mapping[int, int] | None = None) -> np.ndarray:
    """Per-class ratio target prior / training prior (see the module doc, step 5), (C,)."""
    fit = np.asarray(counts, np.float64) / float(np.sum(counts))
    if prior == "balanced":
        target = np.full(len(fit), 1.0 / len(fit))
    elif prior == "node":
        own = np.array([float((target_counts or {}).get(int(c), 0)) for c in classes])
        held = own > 0
        if not held.any():
            raise EnsembleError("target_counts name none of the fitted classes")
        target = fit.copy()
        target[held] = fit[held].sum() * own[held] / own[held].sum()
    else:
        raise EnsembleError(f"prior must be balanced or node here, got {prior!r}")
    return target / fit


# ---------------------------------------------------------------- numpy predictors

def _check_X(X: np.ndarray) -> np.ndarray:
    try:
        X = np.asarray(X, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise EnsembleError(f"X must be numeric: {e}") from None
    if X.ndim != 2 or X.shape[0] == 0 or X.shape[1] == 0:
        raise EnsembleError(f"X must be a non-empty 2-D array, got shape {X.shape}")
    if not np.all(np.isfinite(X)):
        raise EnsembleError("X contains NaN or infinity")
    return X


def _mlp_proba(a: dict[str, np.ndarray], Z: np.ndarray) -> np.ndarray:
    n = sum(1 for k in a if k.startswith("mlp.w"))
    h = Z
    for i in range(n):
        h = h @ a[f"mlp.w{i}"] + a[f"mlp.b{i}"]
        if i < n - 1:
            np.maximum(h, 0, out=h)  # relu
    if h.shape[1] == 1:  # binary: logistic output for the positive class
        p = 1.0 / (1.0 + np.exp(-np.clip(h[:, 0], -500, 500)))
        return np.stack([1 - p, p], axis=1)
    h = np.exp(h - h.max(axis=1, keepdims=True))
    return h / h.sum(axis=1, keepdims=True)


def _rf_proba(a: dict[str, np.ndarray], Z: np.ndarray) -> np.ndarray:
    offsets, left, right = a["rf.offsets"], a["rf.left"], a["rf.right"]
    feature, threshold, value = a["rf.feature"], a["rf.threshold"], a["rf.value"]
    X32 = Z.astype(np.float32)  # sklearn trees compare float32 inputs with float64 thresholds
    rows = np.arange(len(Z))
    node = np.repeat(offsets[:-1, None], len(Z), axis=1)  # (T, N) global node ids
    base = offsets[:-1, None]
    while True:
        lo = left[node]
        inner = lo >= 0
        if not inner.any():
            break
        go_left = X32[rows[None, :], np.where(inner, feature[node], 0)] <= threshold[node]
        node = np.where(inner, base + np.where(go_left, lo, right[node]), node)
    leaf = value[node]  # (T, N, C)
    norm = leaf.sum(axis=2, keepdims=True)
    norm[norm == 0] = 1.0
    return (leaf / norm).mean(axis=0)


def _svm_proba(a: dict[str, np.ndarray], Z: np.ndarray) -> np.ndarray:
    d = Z @ a["svm.coef"].T + a["svm.intercept"]  # (N, C) or (N, 1) when binary
    p = 1.0 / (1.0 + np.exp(np.clip(a["svm.calib_a"] * d + a["svm.calib_b"], -500, 500)))
    if p.shape[1] == 1:
        return np.concatenate([1 - p, p], axis=1)
    s = p.sum(axis=1, keepdims=True)
    return np.divide(p, s, out=np.full_like(p, 1.0 / p.shape[1]), where=s != 0)


_PROBA = {"mlp": _mlp_proba, "rf": _rf_proba, "svm": _svm_proba}


def _validate(a: dict[str, np.ndarray], meta: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Check every shape and link the predictors rely on."""
    def need(key: str, ndim: int, kind: str = "f") -> np.ndarray:
        if key not in a:
            raise EnsembleError(f"missing array {key!r}")
        v = a[key]
        if v.ndim != ndim or v.dtype.kind != kind or (kind == "f" and not np.all(np.isfinite(v))):
            raise EnsembleError(f"array {key!r}: expected {ndim}-D {'float' if kind == 'f' else 'int'}, "
                                f"got {v.dtype} {v.shape}")
        return v

    def fail(why: str) -> EnsembleError:
        return EnsembleError(f"inconsistent ensemble arrays: {why}")

    classes = need("classes", 1, "i")
    C = len(classes)
    if C < 2 or np.any(np.diff(classes) <= 0):
        raise fail("classes must be >= 2 sorted distinct labels")
    D, K = meta.get("n_features"), meta.get("pca_components")
    comps = need("pca.components", 2)
    if comps.shape != (K, D) or need("pca.mean", 1).shape != (D,):
        raise fail(f"pca shapes {comps.shape} for {K} components of {D} features")
    if meta["params"].get("standardize"):
        if need("scaler.mean", 1).shape != (D,) or need("scaler.scale", 1).shape != (D,) \
                or np.any(a["scaler.scale"] == 0):
            raise fail("scaler shapes")
    if "prior.ratio" in a:
        r = need("prior.ratio", 1)
        if r.shape != (C,) or np.any(r < 0):
            raise fail("prior ratio shape or sign")
    members = meta["params"]["members"]
    if "mlp" in members:
        n, width = meta.get("mlp_layers"), K
        if not isinstance(n, int) or n < 1:
            raise fail("mlp_layers")
        for i in range(n):
            w, b = need(f"mlp.w{i}", 2), need(f"mlp.b{i}", 1)
            if w.shape[0] != width or b.shape != (w.shape[1],):
                raise fail(f"mlp layer {i} shapes {w.shape} {b.shape}")
            width = w.shape[1]
        if width != (1 if C == 2 else C) or f"mlp.w{n}" in a:
            raise fail(f"mlp output width {width} for {C} classes")
    if "rf" in members:
        offsets = need("rf.offsets", 1, "i")
        left, right, feat = need("rf.left", 1, "i"), need("rf.right", 1, "i"), need("rf.feature", 1, "i")
        thr, value = need("rf.threshold", 1), need("rf.value", 2)
        total = len(left)
        if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total or np.any(np.diff(offsets) < 1) \
                or not len(right) == len(feat) == len(thr) == len(value) == total or value.shape[1] != C:
            raise fail("random forest array sizes")
        sizes = np.diff(offsets)
        size = np.repeat(sizes, sizes)
        local = np.arange(total) - np.repeat(offsets[:-1], sizes)
        inner = left >= 0
        # children lie after their parent inside the same tree: no cycles, no out-of-range jumps
        bad_link = inner & ((left <= local) | (right <= local) | (left >= size) | (right >= size))
        if np.any(bad_link) or np.any(~inner & ((left != -1) | (right != -1))) \
                or np.any(inner & ((feat < 0) | (feat >= K))):
            raise fail("random forest tree links")
    if "svm" in members:
        coef, icpt = need("svm.coef", 2), need("svm.intercept", 1)
        cols = 1 if C == 2 else C
        if coef.shape != (cols, K) or icpt.shape != (cols,) or need("svm.calib_a", 1).shape != (cols,) \
                or need("svm.calib_b", 1).shape != (cols,):
            raise fail(f"svm shapes {coef.shape} for {C} classes")
    return a, meta
