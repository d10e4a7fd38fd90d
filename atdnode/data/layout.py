"""What a source holds before any pixel is read: a `Catalog` of samples, their label keys,
split sides and split groups, plus the files skipped on the way and why.

File sources (folder / dicom / nifti) share one layout:
  * `labels=FILE.csv` (file -> class[, split]; a row may name a directory: every file below
    it), paths relative to the CSV's own directory, else to PATH; or
  * PATH/train, PATH/test (optionally PATH/val), each with one sub-folder per class -- also
    when PATH holds only some of them (a folder with just `test/` is a test split, not a
    class named "test"); or
  * PATH with one sub-folder per class.
Class folders are searched recursively (DICOM exports nest patient/study/series); hidden
files and folders are ignored; every other file the source cannot use is listed as skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from atdnode.data.intensity import Scaling
from atdnode.data.labels import read_label_csv
from atdnode.data.spec import SPLITS
from atdnode.errors import DataError


class Skip(Exception):
    """A file the source cannot use: counted and named in the report, never fatal alone."""


# read(i) -> (float or integer array (H, W) or (H, W, C), its scaling); raises Skip or DataError
Reader = Callable[[int], tuple[np.ndarray, Scaling]]


@dataclass
class Catalog:
    """Every sample a source offers, before pixels are read."""

    keys: np.ndarray  # (N,) str label key
    sides: np.ndarray  # (N,) str: "train" / "val" / "test", or "all" (seeded 80/20 split later)
    read: Reader
    names: dict[str, str] | None = None  # the source's own id -> name map, if any
    ids: bool = False  # keys are integer label ids (npz): dense and bounded unless named
    groups: np.ndarray | None = None  # (N,) samples of one group (a volume) share a split side
    where: list[str] = field(default_factory=list)  # (N,) display name per sample ("" for arrays)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    uniform: bool = False  # every sample has one shape and one scaling (vectorised reading)


def visible_files(d: Path) -> Iterator[Path]:
    """Regular files below `d`, sorted, skipping hidden files and folders."""
    for p in sorted(d.rglob("*")):
        rel = p.relative_to(d).parts
        if any(part.startswith(".") for part in rel) or not p.is_file():
            continue
        yield p


@dataclass
class Listing:
    files: list[Path]
    keys: list[str]
    sides: list[str]
    skipped: list[tuple[str, str]]


def list_files(root: Path, accept: Callable[[Path], str | None], labels: str | None, what: str) -> Listing:
    """Files of a folder/dicom/nifti source with their label keys and split sides.

    `accept(path)` returns None for a usable candidate, else the reason it is skipped.
    """
    if not root.is_dir():
        raise DataError(f"{root}: no such folder")
    out = Listing([], [], [], [])

    def add(f: Path, key: str, side: str) -> None:
        reason = accept(f)
        if reason is None:
            out.files.append(f)
            out.keys.append(key)
            out.sides.append(side)
        else:
            out.skipped.append((rel(root, f), reason))

    if labels is not None:
        csv_path = Path(labels).expanduser()
        if not csv_path.is_absolute() and not csv_path.is_file():
            csv_path = root / labels
        for name, key, side in read_label_csv(csv_path, str(root)):
            p = Path(name) if Path(name).is_absolute() else root / name
            if p.is_dir():
                for f in visible_files(p):
                    add(f, key, side or "all")
            elif p.is_file():
                add(p, key, side or "all")
            else:
                out.skipped.append((name, f"listed in {csv_path.name} but missing"))
        if set(out.sides) - {"all"} and "all" in out.sides:
            raise DataError(f"{csv_path}: give a split for every row or for none")
        return out
    sides = [s for s in SPLITS if (root / s).is_dir()]
    others = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in SPLITS]
    if sides and (("train" in sides and "test" in sides) or not others):
        for s in sides:
            _class_folders(root / s, root, s, add, out, what)
    else:
        _class_folders(root, root, "all", add, out, what)
    return out


def _class_folders(d: Path, root: Path, side: str, add, out: Listing, what: str) -> None:
    class_dirs = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise DataError(f"{d}: no class sub-folders (expected one folder per class, or labels=FILE.csv)")
    for f in sorted(p for p in d.iterdir() if p.is_file() and not p.name.startswith(".")):
        out.skipped.append((rel(root, f), "not in a class folder"))
    for cd in class_dirs:
        before = len(out.files)
        for f in visible_files(cd):
            add(f, cd.name, side)
        if len(out.files) == before:
            raise DataError(f"{cd}: class folder has no {what}")


def rel(root: Path, f: Path) -> str:
    try:
        return str(f.relative_to(root))
    except ValueError:
        return str(f)
