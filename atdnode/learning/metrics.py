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
- ``n``: the number of samples.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

MACRO = ("precision", "recall", "sensitivity", "f1")


def classification_metrics(y_true, y_pred, *, labels: Iterable[int]) -> dict:
    """Accuracy, macro precision / recall (sensitivity) / F1 over the classes present in
    `y_true`, and the confusion matrix over `labels` (see the module docstring)."""
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
    return {
        "n": int(len(y_true)),
        "accuracy": float((y_true == y_pred).mean()),
        "balanced_accuracy": float(r),
        "precision": float(p),
        "recall": float(r),
        "sensitivity": float(r),
        "f1": float(f),
        "confusion": confusion_matrix(y_true, y_pred, labels=labels).astype(int).tolist(),
    }


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
