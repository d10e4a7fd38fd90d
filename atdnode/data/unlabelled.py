"""Unlabelled images for prediction (`atd predict`): the training readers, without labels.

Inputs, any number of them:

    folder:DIR[?window=..&frame=K]   every PNG / JPEG / TIFF / BMP below DIR (class sub-folders
                                     are allowed and ignored; none are needed)
    dicom:DIR[?window=..&frame=K]    every DICOM file below DIR
    FILE                             one image or DICOM file (told apart by extension, then by
                                     the DICM preamble)

Pixels go through exactly what training uses: `images.read_image` / `dicom.read_dicom`, the
default scaling of `intensity.default_for` / the DICOM VOI, `window=` overrides, and
`select.to_tensor` (channels, resize, normalisation). An input without `window=` takes the
caller's default (`atd predict`: the model's training window); `window=auto` here takes its
percentiles over the images being predicted. Unreadable files are skipped and listed, as in
training; only the spec options that concern pixels (`window`, `frame`) apply here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from atdnode.data.dicom import _accept as dicom_accept, read_dicom
from atdnode.data.images import IMAGE_EXTS, _accept as image_accept, read_image
from atdnode.data.intensity import default_for
from atdnode.data.layout import Catalog, visible_files
from atdnode.data.loader import _auto
from atdnode.data.select import ReadStats, to_tensor
from atdnode.data.spec import DataSpec, did_you_mean
from atdnode.errors import DataError

PIXEL_OPTIONS = ("window", "frame")
FORMS = "folder:DIR, dicom:DIR or image / DICOM files"


@dataclass
class UnlabelledImages:
    """Images ready for a model, one display name per image (the path as the input named it)."""

    images: torch.Tensor  # (N, C, H, W) float32, normalised as in training
    files: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    scaling: dict[str, int] = field(default_factory=dict)  # how -> images

    def __len__(self) -> int:
        return len(self.files)


@dataclass
class _Input:
    files: list[Path]
    names: list[str]
    kinds: list[str]  # "image" | "dicom" per file
    window: tuple[float, float] | str | None
    frame: int | None
    where: str
    skipped: list[tuple[str, str]]


def _is_dicom_file(p: Path) -> bool:
    return p.suffix.lower() in (".dcm", ".dicom") or dicom_accept(p) is None


def _parse(arg: str) -> _Input:
    """One input: a `folder:` / `dicom:` spec or a single file."""
    head = arg.partition("?")[0]
    kind, sep, _ = head.partition(":")
    if sep and kind in ("folder", "dicom"):
        ds = DataSpec.parse(arg)
        extra = [k for k in ("classes", "class_map", "shard", "limit", "seed", "labels")
                 if getattr(ds, k) is not None] + (["val"] if ds.val != "val" else [])
        if extra:
            raise DataError(f"{arg}: option {extra[0]} does not apply to prediction (only {', '.join(PIXEL_OPTIONS)})")
        root = Path(ds.path).expanduser()
        if not root.is_dir():
            raise DataError(f"{root}: no such folder")
        accept = image_accept if kind == "folder" else dicom_accept
        files, names, skipped = [], [], []
        for f in visible_files(root):
            why = accept(f)
            name = str(Path(ds.path) / f.relative_to(root))
            if why is None:
                files.append(f)
                names.append(name)
            else:
                skipped.append((name, why))
        what = "image" if kind == "folder" else "dicom"
        return _Input(files, names, [what] * len(files), ds.window, ds.frame, ds.path, skipped)
    if sep and len(kind) > 1 and not Path(arg).exists():  # a spec of another source (digits, npz:, nifti:, a typo)
        hint = did_you_mean(kind, ("folder", "dicom"), n=1)
        raise DataError(f"{arg}: atd predict reads {FORMS}{hint}")
    p = Path(arg).expanduser()
    if p.is_dir():
        raise DataError(f"{arg}: a folder; give folder:{arg} (images) or dicom:{arg} (DICOM files)")
    if not p.is_file():
        raise DataError(f"{arg}: no such file (atd predict reads {FORMS})")
    if p.suffix.lower() in IMAGE_EXTS:
        return _Input([p], [arg], ["image"], None, None, arg, [])
    if _is_dicom_file(p):
        return _Input([p], [arg], ["dicom"], None, None, arg, [])
    raise DataError(f"{arg}: neither an image ({', '.join(sorted(IMAGE_EXTS))}) nor a DICOM file")


def _catalog(inp: _Input) -> Catalog:
    def read(i: int):
        f = inp.files[i]
        if inp.kinds[i] == "dicom":
            return read_dicom(f, inp.frame, str(f))
        arr = read_image(f, inp.frame, str(f))
        return arr, default_for(arr.dtype)

    n = len(inp.files)
    return Catalog(keys=np.full(n, ""), sides=np.full(n, "all"), read=read, where=list(inp.names))


def load_unlabelled(inputs: list[str], img_size: int, in_chans: int = 3, *,
                    window: tuple[float, float] | str | None = None,
                    progress: Callable[[int, int], None] | None = None) -> UnlabelledImages:
    """Every image the inputs name, ready for a model of `img_size` x `in_chans`.

    `window` (lo,hi | "minmax" | "auto"; e.g. the model's training window) applies to every
    input that gives no `window=` of its own. Raises DataError for a malformed input or when
    no image at all could be read; `progress(done, total)` is called as images are read."""
    if not inputs:
        raise DataError(f"no input images (give {FORMS})")
    parsed = [_parse(a) for a in inputs]
    for inp in parsed:
        if inp.window is None:
            inp.window = window
    total = sum(len(p.files) for p in parsed)
    skipped = [s for p in parsed for s in p.skipped]
    if total == 0:
        raise DataError(f"{', '.join(inputs)}: no images found" + (f" (skipped {len(skipped)}, first {skipped[0][0]}: "
                                                                     f"{skipped[0][1]})" if skipped else ""))
    stats, done = ReadStats(), [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    parts, names = [], []
    for inp in parsed:
        if not inp.files:
            continue
        cat = _catalog(inp)
        idx = np.arange(len(inp.files))
        auto = _auto(cat, idx, inp.where) if inp.window == "auto" else None
        images, ok = to_tensor(cat, idx, inp.window, auto, img_size, in_chans, inp.where, stats, tick)
        parts.append(images)
        names += [n for n, k in zip(inp.names, ok) if k]
    skipped += stats.skipped
    if not names:
        f, why = skipped[0]
        raise DataError(f"none of the {total} images could be read (first {f}: {why})")
    return UnlabelledImages(images=torch.cat(parts), files=names, skipped=skipped, scaling=dict(stats.how))
