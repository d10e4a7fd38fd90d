"""Label keys -> label space: class-map files, label CSVs, and the checks that keep labels sane.

Every source gives each sample a label *key* (a string: an npz label id, a folder name, a
CSV value). The label space (ordered class names) comes from, in order of precedence:
  1. `classes=FILE` (.json list of names, .json {id: name} object, or .csv `id,name` rows,
     header optional; a one-column CSV is a list of names): explicit, classes may be empty;
  2. the source's own names (an npz `classes` array): explicit as well;
  3. the keys present: integer ids must be dense 0..K-1 with K at most the number of
     samples (an id of 10^9 is an error, not 10^9 class names); other keys (folder
     names, CSV labels) sort as strings.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from atdnode.errors import DataError

MAX_MAP_BYTES = 16 << 20
_HEADERS = {"id", "label", "key", "class_id", "label_id"}


def read_class_map(path: str) -> dict[str, str]:
    """A classes=FILE map: ordered {label key: class name}."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{path}: classes file not found")
    if p.stat().st_size > MAX_MAP_BYTES:
        raise DataError(f"{path}: classes file larger than {MAX_MAP_BYTES >> 20} MiB")
    try:
        text = p.read_text(encoding="utf-8-sig")
        if p.suffix.lower() == ".json":
            obj = json.loads(text)
            pairs = list(enumerate(obj)) if isinstance(obj, list) else list(obj.items()) if isinstance(obj, dict) else None
            if pairs is None:
                raise ValueError("expected a list of names or an {id: name} object")
        else:
            rows = [r for r in csv.reader(text.splitlines()) if r and any(c.strip() for c in r)]
            if rows and rows[0][0].strip().lower() in _HEADERS | {"name", "class"}:
                rows = rows[1:]
            widths = {len(r) for r in rows}
            if widths == {1}:
                pairs = [(i, r[0]) for i, r in enumerate(rows)]
            elif widths == {2}:
                pairs = [(r[0], r[1]) for r in rows]
            else:
                raise ValueError("expected rows of id,name (or one name per row)")
    except (OSError, UnicodeDecodeError, ValueError, csv.Error) as exc:
        raise DataError(f"{path}: unreadable classes file ({exc})") from None
    out: dict[str, str] = {}
    for k, name in pairs:
        k, name = str(k).strip(), str(name).strip() if isinstance(name, (str, int, float)) else None
        if not name:
            raise DataError(f"{path}: class id {k!r} has no name")
        if k in out:
            raise DataError(f"{path}: class id {k!r} listed twice")
        out[k] = name
    if not out:
        raise DataError(f"{path}: classes file lists no classes")
    if len(set(out.values())) != len(out):
        raise DataError(f"{path}: class names are not unique")
    return out


def read_label_csv(path: Path, where: str) -> list[tuple[str, str, str | None]]:
    """labels=FILE.csv rows: (file, label, split or None). Header optional (file,label[,split])."""
    if not path.is_file():
        raise DataError(f"{where}: labels file {path} not found")
    try:
        rows = [r for r in csv.reader(path.read_text(encoding="utf-8-sig").splitlines()) if r and any(c.strip() for c in r)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: unreadable labels file ({exc})") from None
    cols = (0, 1, 2)
    if rows and {c.strip().lower() for c in rows[0]} & {"file", "path", "filename", "image", "volume"}:
        head = [c.strip().lower() for c in rows[0]]
        pick = lambda names: next((head.index(n) for n in names if n in head), None)  # noqa: E731
        cols = (pick(("file", "path", "filename", "image", "volume")), pick(("label", "class", "target")), pick(("split",)))
        if cols[1] is None:
            raise DataError(f"{path}: header has no label/class column")
        rows = rows[1:]
    out = []
    for n, r in enumerate(rows, start=1):
        try:
            f, lab = r[cols[0]].strip(), r[cols[1]].strip()
            split = r[cols[2]].strip().lower() if cols[2] is not None and len(r) > cols[2] and r[cols[2]].strip() else None
        except IndexError:
            raise DataError(f"{path}: row {n} has {len(r)} columns, expected file,label[,split]") from None
        if not f or not lab:
            raise DataError(f"{path}: row {n} lacks a file or a label")
        if split not in (None, "train", "val", "test"):
            raise DataError(f"{path}: row {n}: split {split!r} is not train, val or test")
        out.append((f, lab, split))
    if not out:
        raise DataError(f"{path}: labels file lists no files")
    return out


def label_space(keys: np.ndarray, mapping: dict[str, str] | None, *, ids: bool, where: str,
                map_name: str = "classes file") -> tuple[list[str], np.ndarray]:
    """(class names, label index per sample) for label keys `keys` (N,) of str.

    `ids`: keys are integer label ids (npz) that, without a map, must be dense and bounded.
    """
    present = np.unique(keys)
    if mapping is not None:
        unknown = [k for k in present.tolist() if k not in mapping]
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise DataError(f"{where}: label ids {shown} are not in the {map_name} ({len(mapping)} classes)")
        order = list(mapping)
        names = [mapping[k] for k in order]
    elif ids:
        vals = present.astype(np.int64) if present.size else np.empty(0, np.int64)
        if vals.size and (vals.min() < 0 or vals.max() >= len(keys)):
            raise DataError(f"{where}: label ids out of range: must be 0..K-1 with K <= the number of samples ({len(keys)}); "
                            f"found {int(vals.min())}..{int(vals.max())} (name classes with classes=FILE)")
        top = int(vals.max()) + 1 if vals.size else 0
        if len(vals) != top:
            missing = sorted(set(range(top)) - set(vals.tolist()))
            raise DataError(f"{where}: label ids are not dense: {len(missing)} of 0..{top - 1} have no samples "
                            f"(first {missing[:5]}); list the classes with classes=FILE")
        order = [str(i) for i in range(top)]
        names = list(order)
    else:
        order = sorted(present.tolist())
        names = list(order)
    pos = {k: i for i, k in enumerate(order)}
    labels = np.fromiter((pos[k] for k in keys.tolist()), dtype=np.int64, count=len(keys))
    return names, labels
