"""`load_dataset`: spec -> catalog -> label space -> split side -> selection -> pixels.

Only the requested split's pixels are decoded. Sides come from the source (train / val /
test folders, npz keys, a `split` column of `labels=`), else from a seeded, per-class
80/20 split of the *whole source* (whole volumes for NIfTI), so a sample is on the same
side whatever classes / shard a node keeps, and whichever of its files turn out unreadable.

Every selection judges on the val split, never on test: a source with no val split gets
one carved from its training split (`select.carve_val`: seeded, stratified, whole groups;
`val=val`, the default). `val=train` merges the source's val into training and carves
nothing (no selection can then be made); `val=test` forces selection on the test split
(every number it chose is then flagged, `atdnode.aggregation.candidates`). The report's
`val_origin` says which, and the training run and the model's record carry it.

A command that reads several splits of one spec parses it once: `resolve_data(spec)` parses the
spec, lists its catalogue, builds its label space and sides, and keeps each side's selection, and
`load_dataset` / `peek` / `training_window` take that `DataSource` in place of the spec string.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from atdnode.data.arrays import digits_catalog, npz_catalog
from atdnode.data.intensity import AUTO_FILES, auto_window, sample_pixels
from atdnode.data.labeled import LabeledImages
from atdnode.data.labels import label_space, read_class_map
from atdnode.data.layout import Catalog, Skip
from atdnode.data.report import DataReport
from atdnode.data.select import ReadStats, _select, carve_val, carved_note, split_indices, to_tensor
from atdnode.data.spec import ALL, SPLITS, DataSpec
from atdnode.errors import DataError


def open_catalog(ds: DataSpec) -> tuple[Catalog, str]:
    if ds.source == "digits":
        return digits_catalog(), "digits"
    if ds.source == "digits-jitter":
        from atdnode.data.jitter import digits_jitter_catalog
        return digits_jitter_catalog(ds.variants, public=ds.public, part=ds.part), "digits-jitter"
    path = Path(ds.path).expanduser()
    if ds.source == "npz":
        return npz_catalog(path), ds.path
    if ds.source == "folder":
        from atdnode.data.images import folder_catalog
        return folder_catalog(ds), ds.path
    _require({"dicom": "pydicom", "nifti": "nibabel"}[ds.source], ds.source)
    if ds.source == "dicom":
        from atdnode.data.dicom import dicom_catalog
        return dicom_catalog(ds), ds.path
    from atdnode.data.nifti import nifti_catalog
    return nifti_catalog(ds), ds.path


def _require(module: str, source: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise DataError(f"{source}: sources need the {module} package (pip install {module})")


def _sides(cat: Catalog, labels: np.ndarray, ds: DataSpec, seed: int) -> tuple[np.ndarray, str]:
    """(split side per sample, where the val split comes from: `val_origin`)."""
    sides = cat.sides.astype("<U5").copy()
    if ds.val == "train":
        sides[sides == "val"] = "train"
    sub = np.flatnonzero(sides == "all")
    if len(sub):
        sp = split_indices(labels[sub], seed, groups=None if cat.groups is None else cat.groups[sub])
        sides[sub[sp["train"]]] = "train"
        sides[sub[sp["test"]]] = "test"
    if (sides == "val").any():
        return sides, "the source's val split"
    if ds.val != "val":
        return sides, {"train": "none (val=train: the source's val joins training; nothing carved)",
                       "test": "none: selection forced on the test split (val=test)"}[ds.val]
    tr = np.flatnonzero(sides == "train")
    cut = carve_val(labels[tr], seed, groups=None if cat.groups is None else cat.groups[tr])
    if not len(cut["val"]):
        return sides, "none (too few training samples to carve one)"
    sides[tr[cut["val"]]] = "val"
    return sides, carved_note(seed)


def _auto(cat: Catalog, train_idx: np.ndarray, where: str) -> tuple[float, float]:
    """window=auto: percentiles over up to AUTO_FILES training images, evenly spaced."""
    if not len(train_idx):
        raise DataError(f"{where}: window=auto needs a training split")
    pick = np.unique(np.linspace(0, len(train_idx) - 1, min(len(train_idx), AUTO_FILES)).round().astype(int))
    samples = []
    for i in train_idx[pick]:
        try:
            samples.append(sample_pixels(cat.read(int(i))[0]))
        except Skip:
            continue
    return auto_window(samples, where)


@dataclass
class DataSource:
    """A data spec parsed, its catalogue listed and its label space and sides made, once
    (`resolve_data`): every split a command reads comes from it. `seed` is the data seed in use
    (the spec's `seed=`, else the default it was resolved with)."""

    spec: str
    ds: DataSpec
    seed: int
    cat: Catalog
    where: str
    names: list[str]
    labels: np.ndarray
    sides: np.ndarray  # split side per sample
    val_origin: str
    _selected: dict = field(default_factory=dict, repr=False)
    _window: tuple[float, float] | None = field(default=None, repr=False)

    def selected(self, side: str) -> tuple[np.ndarray, list[str], np.ndarray]:
        """classes= / shard= / limit= applied to the samples of `side`: (indices into the
        catalogue, class names kept, new labels); made once per side (`ALL`: every sample)."""
        if side not in self._selected:
            base = np.arange(len(self.sides)) if side == ALL else np.flatnonzero(self.sides == side)
            sel, keep, new = _select(self.labels[base], self.names, self.ds, self.seed, self.where,
                                     None if self.cat.groups is None else self.cat.groups[base])
            self._selected[side] = (base[sel], keep, new)
        return self._selected[side]

    def auto_window(self) -> tuple[float, float]:
        """window=auto's percentiles over the training split (`_auto`), computed once."""
        if self._window is None:
            self._window = _auto(self.cat, np.flatnonzero(self.sides == "train"), self.where)
        return self._window


def resolve_data(spec: "str | DataSource", seed: int = 0, *, parsed: DataSpec | None = None) -> DataSource:
    """`spec` parsed (unless the caller passes it `parsed`) and its catalogue opened (a
    `DataSource` is returned as it is: it was resolved with its own seed). DataError /
    ConfigError for a bad spec or source."""
    if isinstance(spec, DataSource):
        return spec
    ds = parsed if parsed is not None else DataSpec.parse(spec)
    dseed = ds.seed if ds.seed is not None else seed
    cat, where = open_catalog(ds)
    if len(cat.keys) == 0:
        raise DataError(f"{where}: no usable files" + (f" (skipped {len(cat.skipped)}, first {cat.skipped[0][0]}: "
                                                       f"{cat.skipped[0][1]})" if cat.skipped else ""))
    mapping = read_class_map(ds.class_map) if ds.class_map else cat.names
    names, labels = label_space(cat.keys, mapping, ids=cat.ids, where=where,
                                map_name="classes file" if ds.class_map else "source's class list")
    sides, val_origin = _sides(cat, labels, ds, dseed)
    return DataSource(spec=spec, ds=ds, seed=dseed, cat=cat, where=where, names=names, labels=labels, sides=sides,
                      val_origin=val_origin)


def training_window(spec: "str | DataSource", seed: int = 0) -> tuple[float, float] | str | None:
    """The `window=` a spec's training split was scaled with: its lo,hi or minmax as given,
    `window=auto`'s percentiles recomputed over the same training images (DataError when the
    source is not readable here), None when the spec gives no window."""
    window = spec.ds.window if isinstance(spec, DataSource) else DataSpec.parse(spec).window
    if window != "auto":
        return window
    return resolve_data(spec, seed).auto_window()


def declared_splits(spec: "str | DataSource") -> list[str]:
    """The splits a source declares itself (train / val / test folders, npz keys, a `split`
    column of `labels=`), in SPLITS order; [] when its sides come from the seeded 80/20 split.
    Reads no pixels."""
    cat = spec.cat if isinstance(spec, DataSource) else open_catalog(DataSpec.parse(spec))[0]
    return [s for s in SPLITS if (cat.sides == s).any()]


def peek(spec: "str | DataSource", seed: int = 0, *, files: int = 8) -> tuple[int, int]:
    """(training images, median native side in pixels) of a spec, reading the pixels of at
    most `files` samples spread over the train side (what `atdnode.learning.autosize`
    chooses a model size from); DataError when none of them can be read."""
    src = resolve_data(spec, seed)
    cat, where = src.cat, src.where
    train = src.selected("train")[0]
    pick = np.unique(np.linspace(0, len(train) - 1, min(len(train), files)).round().astype(int)) if len(train) else []
    sides_px = []
    for i in pick:
        try:
            arr = np.asarray(cat.read(int(train[i]))[0])
        except Skip:
            continue
        sides_px.append(min(arr.shape[:2]))
    if not sides_px:
        raise DataError(f"{where}: none of {len(pick)} training files could be read to size the model")
    return len(train), int(np.median(sides_px))


def load_dataset(spec: "str | DataSource", img_size: int, in_chans: int = 3, split: str = "train", seed: int = 0, *,
                 progress: Callable[[int, int], None] | None = None) -> LabeledImages:
    """Load one split (train / val / test, or `all`: every sample of every side) of a data
    spec (or of a `DataSource` resolved from one), ready for a model of `img_size` x `in_chans`.

    `seed` is the default for the spec's `seed=` (80/20 split, shard, subset); it is a data
    seed, deliberately separate from the training seed. The result's `report` says what
    was read, how it was scaled, and which files were skipped and why. `progress(done, total)`
    is called as samples are read.
    """
    if split not in SPLITS + (ALL,):
        raise DataError(f"unknown split {split!r} (train, val, test or all)")
    src = resolve_data(spec, seed)
    spec, ds, cat, where, val_origin = src.spec, src.ds, src.cat, src.where, src.val_origin
    present = [ALL] if split == ALL else [s for s in SPLITS if (src.sides == s).any()]
    if split not in present:
        raise DataError(f"{where}: no {split} split (has {', '.join(present)})")
    listed = {}
    for s in present:
        _, keep, new = src.selected(s)
        listed[s] = {c: int(n) for c, n in zip(keep, np.bincount(new, minlength=len(keep)).tolist())}
    idx, keep, new = src.selected(split)
    if len(idx) == 0:
        raise DataError(f"{spec}: the {split} split is empty")
    if ds.window != "auto":
        auto = None
    else:  # `all` reads every side as one: no training split to take the window from
        auto = src.auto_window() if split != ALL else _auto(cat, np.zeros(0, dtype=np.int64), where)
    stats = ReadStats()
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], len(idx))

    images, ok = to_tensor(cat, idx, ds.window, auto, img_size, in_chans, where, stats, tick)
    if not ok.any():
        f, why = stats.skipped[0]
        raise DataError(f"{where}: none of the {len(idx)} {split} files could be read (first {f}: {why})")
    labels_t = torch.from_numpy(np.ascontiguousarray(new[ok]))
    listed[split] = {c: int(n) for c, n in zip(keep, torch.bincount(labels_t, minlength=len(keep)).tolist())}
    report = DataReport(spec=spec, split=split, classes=list(keep), counts=listed, scaling=dict(stats.how),
                        shapes=dict(stats.shapes), dtypes=dict(stats.dtypes),
                        value_range=(stats.lo, stats.hi) if stats.lo <= stats.hi else None,
                        skipped=list(cat.skipped) + stats.skipped, auto_window=auto, val_origin=val_origin)
    return LabeledImages(images=images, labels=labels_t, classes=keep, spec=spec, report=report)
