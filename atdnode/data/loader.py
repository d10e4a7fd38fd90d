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
"""
from __future__ import annotations

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


def _labelled_catalog(spec: str, seed: int):
    """(spec, data seed, catalog, where, class names, label per sample, split side per sample,
    val origin)."""
    ds = DataSpec.parse(spec)
    dseed = ds.seed if ds.seed is not None else seed
    cat, where = open_catalog(ds)
    if len(cat.keys) == 0:
        raise DataError(f"{where}: no usable files" + (f" (skipped {len(cat.skipped)}, first {cat.skipped[0][0]}: "
                                                       f"{cat.skipped[0][1]})" if cat.skipped else ""))
    mapping = read_class_map(ds.class_map) if ds.class_map else cat.names
    names, labels = label_space(cat.keys, mapping, ids=cat.ids, where=where,
                                map_name="classes file" if ds.class_map else "source's class list")
    return (ds, dseed, cat, where, names, labels, *_sides(cat, labels, ds, dseed))


def training_window(spec: str, seed: int = 0) -> tuple[float, float] | str | None:
    """The `window=` a spec's training split was scaled with: its lo,hi or minmax as given,
    `window=auto`'s percentiles recomputed over the same training images (DataError when the
    source is not readable here), None when the spec gives no window."""
    window = DataSpec.parse(spec).window
    if window != "auto":
        return window
    _, _, cat, where, _, _, sides, _ = _labelled_catalog(spec, seed)
    return _auto(cat, np.flatnonzero(sides == "train"), where)


def declared_splits(spec: str) -> list[str]:
    """The splits a source declares itself (train / val / test folders, npz keys, a `split`
    column of `labels=`), in SPLITS order; [] when its sides come from the seeded 80/20 split.
    Reads no pixels."""
    ds = DataSpec.parse(spec)
    cat, _ = open_catalog(ds)
    return [s for s in SPLITS if (cat.sides == s).any()]


def peek(spec: str, seed: int = 0, *, files: int = 8) -> tuple[int, int]:
    """(training images, median native side in pixels) of a spec, reading the pixels of at
    most `files` samples spread over the train side (what `atdnode.learning.autosize`
    chooses a model size from); DataError when none of them can be read."""
    ds, dseed, cat, where, names, labels, sides, _ = _labelled_catalog(spec, seed)
    base = np.flatnonzero(sides == "train")
    sel = _select(labels[base], names, ds, dseed, where, None if cat.groups is None else cat.groups[base])[0]
    train = base[sel]
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


def load_dataset(spec: str, img_size: int, in_chans: int = 3, split: str = "train", seed: int = 0, *,
                 progress: Callable[[int, int], None] | None = None) -> LabeledImages:
    """Load one split (train / val / test, or `all`: every sample of every side) of a data
    spec, ready for a model of `img_size` x `in_chans`.

    `seed` is the default for the spec's `seed=` (80/20 split, shard, subset); it is a data
    seed, deliberately separate from the training seed. The result's `report` says what
    was read, how it was scaled, and which files were skipped and why. `progress(done, total)`
    is called as samples are read.
    """
    if split not in SPLITS + (ALL,):
        raise DataError(f"unknown split {split!r} (train, val, test or all)")
    ds, dseed, cat, where, names, labels, sides, val_origin = _labelled_catalog(spec, seed)
    if split == ALL:
        sides = np.full(len(sides), ALL)
    present = [s for s in SPLITS + (ALL,) if (sides == s).any()]
    if split not in present:
        raise DataError(f"{where}: no {split} split (has {', '.join(present)})")
    listed, chosen = {}, None
    for s in present:
        base = np.flatnonzero(sides == s)
        sel, keep, new = _select(labels[base], names, ds, dseed, where, None if cat.groups is None else cat.groups[base])
        listed[s] = {c: int(n) for c, n in zip(keep, np.bincount(new, minlength=len(keep)).tolist())}
        if s == split:
            chosen = (base[sel], keep, new)
    idx, keep, new = chosen
    if len(idx) == 0:
        raise DataError(f"{spec}: the {split} split is empty")
    auto = _auto(cat, np.flatnonzero(sides == "train"), where) if ds.window == "auto" else None
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
