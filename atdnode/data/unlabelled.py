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
from typing import Callable, Iterator

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


class UnlabelledReader:
    """The inputs, parsed and listed (no pixels read yet); `chunks()` reads them in bounded
    batches, so a folder of any size is predicted in bounded memory.

    `window` (lo,hi | "minmax" | "auto"; e.g. the model's training window) applies to every
    input that gives no `window=` of its own. DataError for a malformed input or no images."""

    def __init__(self, inputs: list[str], img_size: int, in_chans: int = 3, *,
                 window: tuple[float, float] | str | None = None) -> None:
        if not inputs:
            raise DataError(f"no input images (give {FORMS})")
        self.parsed = [_parse(a) for a in inputs]
        for inp in self.parsed:
            if inp.window is None:
                inp.window = window
        self.img_size, self.in_chans = img_size, in_chans
        self.total = sum(len(p.files) for p in self.parsed)
        self.skipped = [s for p in self.parsed for s in p.skipped]
        self.stats = ReadStats()
        if self.total == 0:
            first = f" (skipped {len(self.skipped)}, first {self.skipped[0][0]}: {self.skipped[0][1]})" if self.skipped else ""
            raise DataError(f"{', '.join(inputs)}: no images found{first}")

    def chunks(self, size: int = 512, progress: Callable[[int, int], None] | None = None
               ) -> Iterator[tuple[torch.Tensor, list[str]]]:
        """(images (n, C, H, W), their display names) per batch of up to `size` files; the
        unreadable ones are left out and added to `skipped`. DataError at the end when none
        at all could be read; `progress(done, total)` as files are read."""
        done, read = [0], 0

        def tick(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], self.total)

        for inp in self.parsed:
            if not inp.files:
                continue
            cat = _catalog(inp)
            auto = _auto(cat, np.arange(len(inp.files)), inp.where) if inp.window == "auto" else None
            for s in range(0, len(inp.files), size):
                idx = np.arange(s, min(s + size, len(inp.files)))
                images, ok = to_tensor(cat, idx, inp.window, auto, self.img_size, self.in_chans, inp.where,
                                       self.stats, tick)
                self.skipped += self.stats.skipped
                self.stats.skipped = []
                names = [inp.names[i] for i, k in zip(idx, ok) if k]
                read += len(names)
                if names:
                    yield images, names
        if read == 0:
            f, why = self.skipped[0]
            raise DataError(f"none of the {self.total} images could be read (first {f}: {why})")

    @property
    def scaling(self) -> dict[str, int]:
        return dict(self.stats.how)


def load_unlabelled(inputs: list[str], img_size: int, in_chans: int = 3, *,
                    window: tuple[float, float] | str | None = None,
                    progress: Callable[[int, int], None] | None = None) -> UnlabelledImages:
    """Every image the inputs name, in memory at once (`UnlabelledReader` reads in batches)."""
    reader = UnlabelledReader(inputs, img_size, in_chans, window=window)
    parts, names = [], []
    for images, batch in reader.chunks(progress=progress):
        parts.append(images)
        names += batch
    return UnlabelledImages(images=torch.cat(parts), files=names, skipped=reader.skipped, scaling=reader.scaling)
