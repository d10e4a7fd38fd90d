"""Driver-free VGS-ATD steps on in-memory models and arrays (the daemon supplies I/O).

* Horizontal: heads are averaged only when :func:`heads_comparable` holds
  (same class names in the same order, so head rows mean the same classes),
  else extractors only (the node side is ``atdnode.aggregation.horizontal``).
* Vertical: each node's CLS features come with labels that index *its own*
  class list; :func:`merge_labeled_features` maps them onto the union of
  class names, and :func:`fit_vertical_ensemble` trains one
  :class:`~protocols.ensemble.EnsembleClassifier` over it -- e.g. from
  features other nodes shared through :mod:`protocols.feature_crypto`.
* Hierarchical: see :mod:`protocols.hierarchical`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from protocols.ensemble import EnsembleClassifier, EnsembleError

__all__ = ["heads_comparable", "LabeledFeatures", "merge_labeled_features",
           "fit_vertical_ensemble"]


def heads_comparable(label_spaces: Sequence[Sequence[str]]) -> bool:
    """True when all inputs list the same class names in the same order."""
    first = list(label_spaces[0]) if label_spaces else None
    return first is not None and all(list(ls) == first for ls in label_spaces)


class LabeledFeatures(NamedTuple):
    X: np.ndarray  # (N, D) float32
    y: np.ndarray  # (N,) int64 indices into classes
    classes: list[str]


def merge_labeled_features(parts: Sequence[tuple[np.ndarray, np.ndarray, Sequence[str]]], *,
                           classes: Sequence[str] | None = None) -> LabeledFeatures:
    """Stack ``(features, labels, class_names)`` parts onto one class list.

    ``classes`` defaults to the sorted union of the parts' class names (the
    same on every node, whatever order the parts arrive in). Raises
    :class:`~protocols.ensemble.EnsembleError` for mismatched feature widths,
    labels outside a part's class list, or names missing from ``classes``.
    """
    if not parts:
        raise EnsembleError("no feature sets to merge")
    union = sorted({str(c) for _, _, names in parts for c in names}) if classes is None else list(classes)
    index = {c: i for i, c in enumerate(union)}
    if len(index) != len(union):
        raise EnsembleError("classes must be distinct")
    Xs, ys, width = [], [], None
    for k, (X, y, names) in enumerate(parts):
        X, y = np.asarray(X, dtype=np.float32), np.asarray(y)
        if X.ndim != 2 or y.shape != (len(X),) or not np.issubdtype(y.dtype, np.integer):
            raise EnsembleError(f"part {k}: need features (N, D) and N integer labels, got {X.shape} {y.dtype}{y.shape}")
        width = X.shape[1] if width is None else width
        if X.shape[1] != width:
            raise EnsembleError(f"part {k}: {X.shape[1]} features, part 0 has {width}")
        if len(y) and (y.min() < 0 or y.max() >= len(names)):
            raise EnsembleError(f"part {k}: labels must index its {len(names)} class names")
        missing = [c for c in names if c not in index]
        if missing:
            raise EnsembleError(f"part {k}: classes {missing} are not in the target class list")
        lut = np.array([index[c] for c in names], dtype=np.int64)
        Xs.append(X)
        ys.append(lut[y] if len(y) else np.zeros(0, np.int64))
    return LabeledFeatures(np.concatenate(Xs), np.concatenate(ys), union)


def fit_vertical_ensemble(parts: Sequence[tuple[np.ndarray, np.ndarray, Sequence[str]]], *,
                          classes: Sequence[str] | None = None, own: int = 0,
                          **ensemble: Any) -> tuple[EnsembleClassifier, list[str]]:
    """Merge the parts and fit one ensemble over the union of their label spaces.
    ``parts[own]`` is the fitting node's own data: its class counts are the target of the
    ``prior="node"`` correction (:mod:`protocols.ensemble`, step 5).
    Returns the classifier and its class names (``classes_`` index them)."""
    merged = merge_labeled_features(parts, classes=classes)
    _, y, names = parts[own]
    index = {c: i for i, c in enumerate(merged.classes)}
    counts = np.bincount(np.asarray(y, dtype=np.int64), minlength=len(names)) if len(y) else np.zeros(len(names))
    target = {index[str(c)]: int(n) for c, n in zip(names, counts) if n > 0}
    return EnsembleClassifier(**ensemble).fit(merged.X, merged.y, target_counts=target), merged.classes
