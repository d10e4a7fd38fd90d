"""`DataReport`: what the loader read, how it scaled it, and what it skipped and why.

It holds counts, shapes, dtypes, value ranges, scaling descriptions and file paths only —
never header fields (a DICOM's patient data stays in the reader)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DataReport:
    spec: str
    split: str  # the split that was loaded
    classes: list[str]
    counts: dict[str, dict[str, int]]  # split -> class -> samples (loaded split: read; others: listed)
    scaling: dict[str, int] = field(default_factory=dict)  # how -> samples
    shapes: dict[str, int] = field(default_factory=dict)  # native "HxW[xC]" -> samples
    dtypes: dict[str, int] = field(default_factory=dict)
    value_range: tuple[float, float] | None = None  # raw values (DICOM: after rescale) of what was read
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    auto_window: tuple[float, float] | None = None
    val_origin: str = ""  # where the val split comes from: the source's, carved from train, or none (loader)

    @property
    def splits(self) -> list[str]:
        return list(self.counts)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self, max_skipped: int = 3) -> str:
        """One line: the loaded split's counts per class, scaling used, skipped files (first few named)."""
        per = self.counts[self.split]
        cls = ", ".join(f"{c} {n}" for c, n in list(per.items())[:8]) + (" …" if len(per) > 8 else "")
        line = f"data {self.spec} [{self.split}]: {sum(per.values())} images ({cls})"
        if self.scaling:
            line += "; scaling: " + ", ".join(f"{h} x{n}" for h, n in self.scaling.items())
        if self.skipped:
            named = "; ".join(f"{f}: {r}" for f, r in self.skipped[:max_skipped])
            more = f"; +{len(self.skipped) - max_skipped} more (atd data inspect lists all)" if len(self.skipped) > max_skipped else ""
            line += f"; skipped {len(self.skipped)} file(s): {named}{more}"
        return line
