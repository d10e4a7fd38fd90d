"""`atd data inspect SPEC`: what a node would train on, and a contact sheet of samples.

`inspect_data` loads every split the source has exactly as training would (same loader,
same scaling, same model input size) and merges their reports; `contact_sheet` draws a few
samples per class of one split as a PNG (one row per class, the class name on the left).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from atdnode.data.labeled import LabeledImages
from atdnode.data.loader import load_dataset
from atdnode.data.sanity import caution_for, require_classes
from atdnode.data.select import MEAN, STD
from atdnode import progress
from atdnode.errors import DataError

TILE = 64
LABEL_W = 140


@dataclass
class Inspection:
    spec: str
    img_size: int
    in_chans: int
    splits: dict[str, LabeledImages]

    def to_dict(self) -> dict:
        first = next(iter(self.splits.values()))
        skipped = _unique(f for d in self.splits.values() for f in d.report.skipped)
        lo = min((d.report.value_range[0] for d in self.splits.values() if d.report.value_range), default=None)
        hi = max((d.report.value_range[1] for d in self.splits.values() if d.report.value_range), default=None)
        merge = lambda attr: _sum_counts(getattr(d.report, attr) for d in self.splits.values())  # noqa: E731
        return {
            "spec": self.spec, "classes": first.classes,
            "counts": {s: d.report.counts[s] for s, d in self.splits.items()},
            "model_input": [self.in_chans, self.img_size, self.img_size],
            "native_shapes": merge("shapes"), "dtypes": merge("dtypes"), "scaling": merge("scaling"),
            "value_range": None if lo is None else [lo, hi],
            "auto_window": first.report.auto_window,
            "skipped": [list(x) for x in skipped],
            "warnings": self.warnings(),
        }

    def warnings(self) -> list[str]:
        """What training on this data would refuse or caution about (`atdnode.data.sanity`)."""
        out = []
        try:
            require_classes(self.splits["train"])
        except DataError as exc:
            out.append(str(exc))
        test = self.splits.get("test")
        caution = caution_for(dict(zip(test.classes, test.class_counts()))) if test is not None else None
        if caution is not None:
            out.append(f"test metrics {caution.line()}")
        return out

    def lines(self) -> list[str]:
        d = self.to_dict()
        out = [f"data {self.spec}", f"  classes ({len(d['classes'])}): {', '.join(d['classes'])}"]
        w = max([5, *(len(c) for c in d["classes"])])
        out.append("  " + "split".ljust(6) + "".join(c.rjust(w + 2) for c in d["classes"]) + "total".rjust(8))
        for s, per in d["counts"].items():
            out.append("  " + s.ljust(6) + "".join(str(per.get(c, 0)).rjust(w + 2) for c in d["classes"])
                       + str(sum(per.values())).rjust(8))
        out.append("  native shapes: " + _fmt(d["native_shapes"]) + "; dtypes: " + _fmt(d["dtypes"]))
        rng = d["value_range"]
        out.append("  intensity: " + _fmt(d["scaling"]) + (f"; raw range {rng[0]:g} .. {rng[1]:g}" if rng else ""))
        out.append(f"  model input: (N, {self.in_chans}, {self.img_size}, {self.img_size}) float32 in [-1, 1]")
        out.append(f"  skipped ({len(d['skipped'])})" + (":" if d["skipped"] else ""))
        out.extend(f"    {f}: {why}" for f, why in d["skipped"])
        out.extend(f"  warning: {w}" for w in d["warnings"])
        return out


def _unique(items):
    seen, out = set(), []
    for x in items:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def _sum_counts(dicts) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in counts.items()) or "-"


def inspect_data(spec: str, img_size: int = 64, in_chans: int = 3, seed: int = 0) -> Inspection:
    """Load every split of `spec` as a node would (raises DataError as training would); the
    files read are reported through `atdnode.progress`."""
    def load(split: str) -> LabeledImages:
        with progress.task(f"reading {split}", total=None) as step:
            return load_dataset(spec, img_size, in_chans, split, seed=seed, progress=step.update)

    splits = {"train": load("train")}
    for s in splits["train"].report.splits:
        if s != "train":
            splits[s] = load(s)
    return Inspection(spec=spec, img_size=img_size, in_chans=in_chans, splits=splits)


def contact_sheet(data: LabeledImages, path: Path, per_class: int = 4, seed: int = 0) -> Path:
    """A PNG with up to `per_class` samples (seeded choice) of every class, one row per class."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    rows = len(data.classes)
    sheet = Image.new("RGB", (LABEL_W + per_class * (TILE + 4), max(1, rows) * (TILE + 4)), "white")
    draw = ImageDraw.Draw(sheet)
    labels = data.labels.numpy()
    for r, name in enumerate(data.classes):
        y0 = r * (TILE + 4) + 2
        draw.text((4, y0 + TILE // 2 - 6), f"{name} ({int((labels == r).sum())})"[:22], fill="black")
        idx = np.flatnonzero(labels == r)
        for c, i in enumerate(np.sort(rng.permutation(idx)[:per_class]) if len(idx) else []):
            x = (data.images[int(i)] * STD + MEAN).clamp(0, 1)  # (C, H, W)
            x = x.expand(3, -1, -1) if x.shape[0] == 1 else x[:3]
            u8 = (x.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
            tile = Image.fromarray(u8, "RGB").resize((TILE, TILE), Image.NEAREST)
            sheet.paste(tile, (LABEL_W + c * (TILE + 4), y0))
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path
