"""Data spec grammar: `SOURCE[?opt=val&...]` parsed into a `DataSpec`.

Sources: `digits`, `digits-jitter` (`jitter.py`), `npz:PATH`, `folder:PATH`, `dicom:PATH`, `nifti:PATH`. Options (each
checked against the source it applies to, so a typo is an error, not a silent no-op):

    classes=a,b,c       keep only these classes (by name), renumbered in label-space order
    classes=FILE        a .json / .csv map of label ids to names (any source); may be given
                        together with a `classes=a,b` selection (`classes=map.json&classes=a,b`)
    shard=i/n limit=N seed=S
    window=lo,hi|auto|minmax   intensity scaling (see `intensity.py`)
    val=val|train|test  a source's validation split stays separate (default; a source with none
                        gets one carved from train, `loader`), joins train (nothing carved),
                        or selection is forced on test (flagged wherever its numbers show)
    labels=FILE.csv     folder/dicom/nifti: file -> class (and optional split) table
    frame=K             dicom/folder: frame K (0-based) of multi-frame DICOM / multi-page TIFF
    axis=0|1|2          nifti: slice along this array axis (default 2)
    slices=all|mid|a:b[:s]|f0:f1   nifti: which slices (ints: indices, python slice
                        semantics; floats in [0, 1]: fractions of the depth)
    variants=K          digits-jitter: K seeded renderings of every source digit (default 1);
                        the K variants of a digit share a split side (no train/test leakage)
    public=F            digits-jitter: a fixed fraction F (0 < F < 1) of the source digits, per
                        class, is reserved as a public labelled pool (`jitter.public_digits`);
                        the source then holds only the other (private) digits
    part=private|public digits-jitter with public=F: the private digits (default) or the
                        public pool's (whose own 80/20 split is by source digit too)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl

from atdnode.errors import DataError

SPLITS = ("train", "val", "test")  # the sides a source's samples lie on
ALL = "all"  # load_dataset's split for every sample, whatever its side
SOURCES = ("digits", "digits-jitter", "npz", "folder", "dicom", "nifti")
_BUILTIN = ("digits", "digits-jitter")  # no path
_FILE_SOURCES = ("folder", "dicom", "nifti")
# option -> sources it applies to (None: every source)
_APPLIES = {"classes": None, "shard": None, "limit": None, "seed": None, "window": None, "val": None,
            "labels": _FILE_SOURCES, "frame": ("folder", "dicom"), "axis": ("nifti",), "slices": ("nifti",),
            "variants": ("digits-jitter",), "public": ("digits-jitter",), "part": ("digits-jitter",)}
# option -> its accepted forms (named in every error about its value)
FORMS = {"classes": "a,b,c or a .json/.csv class map", "shard": "i/n with 1 <= i <= n, e.g. 1/3",
         "limit": "a positive integer", "seed": "an integer >= 0", "window": "lo,hi (numbers, lo < hi), auto or minmax",
         "val": "val (the source's val split, else one carved from train), train (merged into training) or test (selection on test, flagged)", "labels": "a CSV file of file,label[,split]",
         "frame": "a frame index >= 0", "axis": "0, 1 or 2", "slices": "all, mid, a:b[:step] or fractions f0:f1",
         "variants": "an integer from 1 to 64", "public": "a fraction strictly between 0 and 1",
         "part": "private or public (with public=F)"}


@dataclass(frozen=True)
class DataSpec:
    source: str  # one of SOURCES
    path: str | None
    classes: tuple[str, ...] | None = None  # selection by name
    shard: tuple[int, int] | None = None  # (i, n), 1-based i
    limit: int | None = None
    seed: int | None = None
    class_map: str | None = None  # path of a .json/.csv id -> name map
    window: tuple[float, float] | str | None = None  # (lo, hi) | "auto" | "minmax"
    val: str = "val"  # "val" | "train" | "test"
    labels: str | None = None
    frame: int | None = None
    axis: int = 2
    slices: tuple | str = "all"  # "all" | "mid" | ("idx", a, b, s) | ("frac", f0, f1)
    variants: int = 1  # digits-jitter: renderings per source digit
    public: float | None = None  # digits-jitter: fraction of source digits reserved as a public pool
    part: str = "private"  # digits-jitter with public: "private" (the rest) | "public" (the pool)

    @classmethod
    def parse(cls, spec: str) -> "DataSpec":
        head, _, query = spec.partition("?")
        kind, sep, path = head.partition(":")
        if kind in _BUILTIN and not sep:
            path = None
        elif kind in SOURCES and kind not in _BUILTIN and sep and path:
            pass
        else:
            hint = did_you_mean(kind, SOURCES, n=1) if kind not in SOURCES else ""
            raise DataError(f"bad data spec {spec!r}: expected digits, digits-jitter, npz:PATH, folder:PATH, dicom:PATH or nifti:PATH{hint}")
        opts: dict = {}
        try:
            for k, v in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
                if k not in _APPLIES:
                    raise ValueError(f"unknown option {k!r}{did_you_mean(k, _APPLIES, n=1)} (options: {', '.join(_APPLIES)})")
                if _APPLIES[k] is not None and kind not in _APPLIES[k]:
                    raise ValueError(f"option {k!r} does not apply to {kind} (only {', '.join(_APPLIES[k])})")
                if k == "classes":
                    key = "class_map" if _is_map_file(v) else "classes"
                    if key in opts:
                        raise ValueError(f"classes given twice as a {'file' if key == 'class_map' else 'list'}")
                    opts[key] = v if key == "class_map" else tuple(c for c in v.split(",") if c)
                elif k in opts:
                    raise ValueError(f"option {k!r} given twice")
                else:
                    opts[k] = _checked(k, v)
        except ValueError as exc:
            raise DataError(f"bad data spec {spec!r}: {exc}") from None
        if "part" in opts and "public" not in opts:
            raise DataError(f"bad data spec {spec!r}: part={opts['part']} needs public=F (expected {FORMS['part']})")
        return cls(source=kind, path=path, **opts)


def without_val(spec: str) -> str:
    """`spec` with `val=train` (no val split: the source's joins training, nothing is carved)
    unless it already says what its val split is — for callers that partition a source's
    training split themselves and carve each part's val from its share (netsim)."""
    if DataSpec.parse(spec).val != "val" or "val=val" in spec.partition("?")[2].split("&"):
        return spec
    return spec + ("&" if "?" in spec else "?") + "val=train"


def _is_map_file(v: str) -> bool:
    """`classes=` names a map file when it ends in .json/.csv, or is a path to an existing file."""
    return Path(v).suffix.lower() in (".json", ".csv") or (("/" in v or "\\" in v) and Path(v).expanduser().is_file())


def did_you_mean(word: str, choices, n: int = 3) -> str:
    """" (did you mean 'x'?)" for the closest of `choices` (names starting with `word` first), or ""."""
    import difflib

    choices = list(choices)
    near = [c for c in choices if c.startswith(word) and c != word][:n] if len(word) >= 3 else []
    near = near or difflib.get_close_matches(word, choices, n=n, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in near)}?)" if near else ""


def _checked(k: str, v: str):
    """`_value`, with a conversion failure (`int('abc')`) reworded to name the accepted forms."""
    try:
        return _value(k, v)
    except ValueError as exc:
        msg = str(exc)
        if msg.startswith(("invalid literal", "could not convert", "not enough values", "too many values")):
            raise ValueError(f"{k}={v}: expected {FORMS[k]}") from None
        raise ValueError(f"{msg} (expected {FORMS[k]})" if FORMS[k] not in msg else msg) from None


def _value(k: str, v: str):
    if k == "shard":
        i, n = (int(x) for x in v.split("/"))
        if not 1 <= i <= n:
            raise ValueError(f"shard {v} needs 1 <= i <= n")
        return (i, n)
    if k == "variants":
        x = int(v)
        if not 1 <= x <= 64:
            raise ValueError(f"variants={v} out of range")
        return x
    if k == "public":
        x = float(v)
        if not 0.0 < x < 1.0:
            raise ValueError(f"public={v} out of range")
        return x
    if k == "part":
        if v not in ("private", "public"):
            raise ValueError(f"part={v}: expected {FORMS['part']}")
        return v
    if k in ("limit", "seed", "frame", "axis"):
        x = int(v)
        if x < 0 or (k == "limit" and x == 0) or (k == "axis" and x > 2):
            raise ValueError(f"{k}={v} out of range")
        return x
    if k == "window":
        if v in ("auto", "minmax"):
            return v
        lo, hi = (float(x) for x in v.split(","))
        if not lo < hi:
            raise ValueError(f"window={v} needs lo < hi")
        return (lo, hi)
    if k == "val":
        if v not in ("val", "train", "test"):
            raise ValueError(f"val={v}: expected {FORMS['val']}")
        return v
    if k == "labels":
        if not v:
            raise ValueError("labels needs a CSV file")
        return v
    if k == "slices":
        return _slices(v)
    raise ValueError(f"unknown option {k!r}")  # pragma: no cover - _APPLIES lists every key


def _slices(v: str):
    if v in ("all", "mid"):
        return v
    parts = v.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and "." in v):
        raise ValueError(f"slices={v}: expected all, mid, a:b[:step] or fractions f0:f1")
    if "." in v:
        f0, f1 = (float(x) for x in parts)
        if not 0.0 <= f0 < f1 <= 1.0:
            raise ValueError(f"slices={v}: fractions need 0 <= f0 < f1 <= 1")
        return ("frac", f0, f1)
    a, b = (int(x) if x else None for x in parts[:2])
    s = int(parts[2]) if len(parts) == 3 and parts[2] else 1
    if s <= 0:
        raise ValueError(f"slices={v}: step must be positive")
    return ("idx", a, b, s)


def slice_indices(sel, depth: int) -> list[int]:
    """The slice indices `sel` (a parsed `slices=` value) picks from a volume of `depth`."""
    if sel == "all":
        return list(range(depth))
    if sel == "mid":
        return [depth // 2] if depth else []
    if sel[0] == "frac":
        lo, hi = int(round(sel[1] * depth)), int(round(sel[2] * depth))
        return list(range(lo, max(hi, lo + 1 if lo < depth else lo)))
    return list(range(depth))[slice(sel[1], sel[2], sel[3])]
