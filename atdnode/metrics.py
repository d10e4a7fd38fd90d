"""Classification metrics (macro) and the confusion-matrix PNG.

`classification_metrics` returns a JSON-ready dict: accuracy, precision, recall
(= sensitivity, also under that name), f1 — all macro-averaged over the label space,
with classes absent from both truth and prediction contributing 0 (sklearn's
`zero_division=0`) — plus the confusion matrix (rows = true, columns = predicted) and n.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def classification_metrics(y_true, y_pred, num_classes: int) -> dict:
    from sklearn.metrics import accuracy_score, confusion_matrix, precision_recall_fscore_support

    y_true = np.asarray(y_true, dtype=np.int64)
    y_pred = np.asarray(y_pred, dtype=np.int64)
    labels = list(range(num_classes))
    if len(y_true) == 0:
        return {"n": 0, "accuracy": 0.0, "precision": 0.0, "recall": 0.0, "sensitivity": 0.0, "f1": 0.0,
                "confusion": [[0] * num_classes for _ in labels]}
    p, r, f, _ = precision_recall_fscore_support(y_true, y_pred, labels=labels, average="macro", zero_division=0)
    cm = confusion_matrix(y_true, y_pred, labels=labels)
    return {
        "n": int(len(y_true)),
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "precision": float(p),
        "recall": float(r),
        "sensitivity": float(r),
        "f1": float(f),
        "confusion": cm.astype(int).tolist(),
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
