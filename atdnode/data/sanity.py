"""Sanity rules for what a split can support: training needs two classes; small test splits
make metrics unreliable, and every metric they affect says so.

* `require_classes(data)`: a training split with fewer than 2 classes that have samples is a
  one-line `DataError` (a one-class model is "100 % accurate" and useless).
* `caution_for(counts)`: a test split under `MIN_TEST_IMAGES` images, or with a class
  under `MIN_TEST_PER_CLASS` images, gives a `Caution` naming the metrics it affects:
  every metric when the split is small; the per-class (macro) ones — precision,
  sensitivity / recall, F1 — when only a class is small.
"""
from __future__ import annotations

from dataclasses import dataclass

from atdnode.errors import DataError

MIN_TRAIN_CLASSES = 2
MIN_TEST_IMAGES = 20
MIN_TEST_PER_CLASS = 5
OVERALL = ("accuracy", "robust_accuracy")
PER_CLASS = ("precision", "recall", "sensitivity", "f1")
MARK = "(!)"


def require_classes(data, what: str = "training") -> None:
    """DataError unless `data` (LabeledImages) has samples of at least 2 classes."""
    counts = data.class_counts()
    present = [c for c, n in zip(data.classes, counts) if n > 0]
    if len(present) < MIN_TRAIN_CLASSES:
        has = f"only class {present[0]!r}" if present else "no samples"
        raise DataError(f"{data.spec}: the train split has {has} ({len(data)} images); {what} needs at least "
                        f"{MIN_TRAIN_CLASSES} classes (check the data's class folders, labels= or classes=)")


@dataclass(frozen=True)
class Caution:
    """Which metrics a small test split makes unreliable, and why (one line)."""

    metrics: tuple[str, ...]
    reason: str

    def affects(self, metric: str) -> bool:
        return metric in self.metrics

    def mark(self, metric: str) -> str:
        """" (!)" after a metric this caution affects, else ""."""
        return f" {MARK}" if self.affects(metric) else ""

    def line(self) -> str:
        return f"{MARK} unreliable: {self.reason}"

    def to_json(self) -> dict:
        return {"metrics": list(self.metrics), "reason": self.reason}


def caution_for(counts: dict[str, int]) -> Caution | None:
    """The caution for a test split with `counts` {class: images} (classes with 0 images are
    classes the split lacks, not small ones), or None when the split is large enough."""
    total = sum(counts.values())
    small = {c: n for c, n in counts.items() if 0 < n < MIN_TEST_PER_CLASS}
    why = []
    if total < MIN_TEST_IMAGES:
        why.append(f"the test split has {total} image(s) (under {MIN_TEST_IMAGES})")
    if small:
        shown = ", ".join(f"{c!r} {n}" for c, n in list(small.items())[:5]) + (" …" if len(small) > 5 else "")
        why.append(f"class(es) under {MIN_TEST_PER_CLASS} test images: {shown}")
    if not why:
        return None
    metrics = OVERALL + PER_CLASS if total < MIN_TEST_IMAGES else PER_CLASS
    return Caution(metrics=metrics, reason="; ".join(why))


def caution_of(metrics: dict) -> Caution | None:
    """The `Caution` stored in a metrics dict (`metrics["caution"]`), or None."""
    c = metrics.get("caution") if isinstance(metrics, dict) else None
    if not isinstance(c, dict) or not isinstance(c.get("reason"), str):
        return None
    return Caution(metrics=tuple(str(m) for m in c.get("metrics") or ()), reason=c["reason"])


def metric_text(metrics: dict, shown: list[tuple[str, str]], digits: int = 4) -> str:
    """"label value[ (!)]" for each (label, key) of `shown`, two spaces apart: the warning sits
    beside every metric a small test split makes unreliable (see `caution_for`)."""
    c = caution_of(metrics)
    parts = []
    for label, key in shown:
        v = metrics.get(key)
        text = f"{v:.{digits}f}" if isinstance(v, (int, float)) else "-"
        parts.append(f"{label} {text}{c.mark(key) if c else ''}")
    return "  ".join(parts)
