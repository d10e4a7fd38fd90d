"""Labeled image data for a node: `digits`, MedMNIST-style `.npz`, and image folders.

A data spec is `SOURCE[?opt=val&...]` with SOURCE one of

    digits              scikit-learn's bundled 8x8 handwritten digits (real data, no download)
    npz:PATH            MedMNIST layout: train_images/train_labels[, val_*][, test_*]; images
                        (N,H,W) or (N,H,W,C) uint8, labels (N,) or (N,1); optional `classes`
                        string array naming the labels
    folder:PATH         one sub-folder per class with PNG/JPEG files; or PATH/train and
                        PATH/test each laid out that way

and options
    classes=a,b,c   keep only these classes (by name); labels are renumbered in source order
    shard=i/n       keep the i-th of n disjoint seeded parts (i in 1..n)
    limit=N         keep at most N samples (seeded subset)
    seed=S          seed of the 80/20 split, shards and subsets (default: `load_dataset(seed=)`)

Sources without a test split get a seeded, per-class 80/20 split of the *whole source*
first, so a sample is on the same side of the split whatever classes/shard a node keeps.
Images become float32 (N, C, H, W), resized to the model's size and normalised with
mean 0.5 / std 0.5 (timm's ViT default). The label space is the ordered list of class
names; its fingerprint is sha256 over its canonical JSON. Bad data raises DataError
naming the file.
"""
from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl

import numpy as np
import torch
import torch.nn.functional as F

from atdnode.errors import DataError

MEAN, STD = 0.5, 0.5
IMAGE_EXTS = {".png", ".jpg", ".jpeg"}
SPLITS = ("train", "test")


def label_fingerprint(classes: list[str]) -> str:
    """sha256 of the canonical JSON of the ordered class-name list."""
    canon = json.dumps([str(c) for c in classes], separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()


@dataclass
class LabeledImages:
    """A split of a data source, ready for a model."""

    images: torch.Tensor  # (N, C, H, W) float32, normalised
    labels: torch.Tensor  # (N,) int64 in [0, len(classes))
    classes: list[str]
    spec: str = ""

    def __post_init__(self) -> None:
        if self.images.shape[0] != self.labels.shape[0]:
            raise DataError(f"{self.spec}: {self.images.shape[0]} images but {self.labels.shape[0]} labels")

    @property
    def label_fp(self) -> str:
        return label_fingerprint(self.classes)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def class_counts(self) -> list[int]:
        return torch.bincount(self.labels, minlength=len(self.classes)).tolist()


@dataclass(frozen=True)
class DataSpec:
    source: str  # digits | npz | folder
    path: str | None
    classes: tuple[str, ...] | None = None
    shard: tuple[int, int] | None = None  # (i, n), 1-based i
    limit: int | None = None
    seed: int | None = None

    @classmethod
    def parse(cls, spec: str) -> "DataSpec":
        head, _, query = spec.partition("?")
        kind, sep, path = head.partition(":")
        if kind == "digits" and not sep:
            path = None
        elif kind in ("npz", "folder") and sep and path:
            pass
        else:
            raise DataError(f"bad data spec {spec!r}: expected digits, npz:PATH or folder:PATH")
        opts: dict = {}
        try:
            for k, v in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
                if k == "classes":
                    opts[k] = tuple(c for c in v.split(",") if c)
                elif k == "shard":
                    i, n = (int(x) for x in v.split("/"))
                    if not 1 <= i <= n:
                        raise ValueError(f"shard {v} needs 1 <= i <= n")
                    opts[k] = (i, n)
                elif k in ("limit", "seed"):
                    opts[k] = int(v)
                    if opts[k] < 0 or (k == "limit" and opts[k] == 0):
                        raise ValueError(f"{k} must be positive")
                else:
                    raise ValueError(f"unknown option {k!r}")
        except ValueError as exc:
            raise DataError(f"bad data spec {spec!r}: {exc}") from None
        return cls(source=kind, path=path, **opts)


# --- raw sources: (images uint8 (N,H,W[,C]) or list of PIL-decoded arrays, labels, classes) ---

@dataclass
class _Raw:
    images: list[np.ndarray] | np.ndarray  # uint8, (H,W) or (H,W,C) per sample
    labels: np.ndarray  # int64 (N,)
    scale: float = 255.0  # value of full intensity


def _digits() -> tuple[dict[str, _Raw], list[str]]:
    from sklearn.datasets import load_digits

    d = load_digits()
    raw = _Raw(d.images.astype(np.uint8), d.target.astype(np.int64), scale=16.0)
    return {"all": raw}, [str(i) for i in range(10)]


def _npz(path: Path) -> tuple[dict[str, _Raw], list[str]]:
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as z:  # never unpickle data files
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(f"{path}: not a readable .npz ({exc})") from None
    if "train_images" not in arrays or "train_labels" not in arrays:
        raise DataError(f"{path}: missing keys train_images/train_labels (has {sorted(arrays)})")
    out: dict[str, _Raw] = {}
    for split in ("train", "val", "test"):
        ik, lk = f"{split}_images", f"{split}_labels"
        if (ik in arrays) != (lk in arrays):
            raise DataError(f"{path}: has {ik if ik in arrays else lk} without its pair")
        if ik not in arrays:
            continue
        imgs, labs = arrays[ik], arrays[lk]
        if imgs.ndim not in (3, 4) or (imgs.ndim == 4 and imgs.shape[-1] not in (1, 3)):
            raise DataError(f"{path}: {ik} has shape {imgs.shape}, expected (N,H,W) or (N,H,W,C)")
        if imgs.dtype != np.uint8:
            raise DataError(f"{path}: {ik} has dtype {imgs.dtype}, expected uint8")
        if labs.ndim == 2 and labs.shape[1] == 1:
            labs = labs[:, 0]
        if labs.ndim != 1 or not np.issubdtype(labs.dtype, np.integer):
            raise DataError(f"{path}: {lk} must be integer (N,) or (N,1), got {labs.dtype} {labs.shape}")
        if len(imgs) != len(labs):
            raise DataError(f"{path}: {len(imgs)} {ik} but {len(labs)} {lk}")
        out[split] = _Raw(imgs, labs.astype(np.int64))
    top = max(int(r.labels.max(initial=-1)) for r in out.values())
    if "classes" in arrays:
        names = [str(c) for c in arrays["classes"].tolist()]
    else:
        names = [str(i) for i in range(top + 1)]
    for split, r in out.items():
        if len(r.labels) and (r.labels.min() < 0 or r.labels.max() >= len(names)):
            raise DataError(f"{path}: {split}_labels out of range 0..{len(names) - 1}")
    if not names or sum(len(r.labels) for r in out.values()) == 0:
        raise DataError(f"{path}: no samples")
    if "val" in out:  # atd uses train/test; validation data joins training
        v = out.pop("val")
        t = out["train"]
        if t.images.shape[1:] != v.images.shape[1:]:
            raise DataError(f"{path}: val_images shape {v.images.shape[1:]} != train {t.images.shape[1:]}")
        out["train"] = _Raw(np.concatenate([t.images, v.images]), np.concatenate([t.labels, v.labels]))
    if "test" not in out:
        out = {"all": out["train"]}
    return out, names


def _folder_split(root: Path) -> tuple[_Raw, list[str]]:
    from PIL import Image, UnidentifiedImageError

    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise DataError(f"{root}: no class sub-folders (expected one folder per class)")
    images, labels = [], []
    for ci, d in enumerate(class_dirs):
        files = sorted(p for p in d.iterdir() if p.suffix.lower() in IMAGE_EXTS and not p.name.startswith("."))
        if not files:
            raise DataError(f"{d}: class folder has no PNG/JPEG images")
        for f in files:
            try:
                with Image.open(f) as im:
                    im = im.convert("RGB") if im.mode not in ("L", "RGB") else im
                    images.append(np.asarray(im, dtype=np.uint8).copy())
            except (UnidentifiedImageError, OSError, ValueError) as exc:
                raise DataError(f"{f}: unreadable image ({exc})") from None
            labels.append(ci)
    return _Raw(images, np.asarray(labels, dtype=np.int64)), [d.name for d in class_dirs]


def _folder(path: Path) -> tuple[dict[str, _Raw], list[str]]:
    if not path.is_dir():
        raise DataError(f"{path}: no such folder")
    if (path / "train").is_dir() and (path / "test").is_dir():
        tr, names = _folder_split(path / "train")
        te, tnames = _folder_split(path / "test")
        if tnames != names:
            raise DataError(f"{path}: train classes {names} != test classes {tnames}")
        return {"train": tr, "test": te}, names
    raw, names = _folder_split(path)
    return {"all": raw}, names


# --- selection -------------------------------------------------------------------------

def _rng(seed: int, *salt: int) -> np.random.Generator:
    return np.random.default_rng([seed, *salt])


def split_indices(labels: np.ndarray, seed: int, test_frac: float = 0.2) -> dict[str, np.ndarray]:
    """Seeded per-class split: about `test_frac` of each class goes to test."""
    rng = _rng(seed, 0x5EED)
    train, test = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        n_test = int(round(len(idx) * test_frac)) if len(idx) > 1 else 0
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return {"train": np.sort(np.concatenate(train)), "test": np.sort(np.concatenate(test))}


def _select(labels: np.ndarray, names: list[str], spec: DataSpec, seed: int, where: str) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Apply classes= / shard= / limit=: returns (indices, class names kept, new labels)."""
    idx = np.arange(len(labels))
    keep = names
    if spec.classes is not None:
        unknown = [c for c in spec.classes if c not in names]
        if unknown:
            raise DataError(f"{where}: unknown classes {unknown} (has {names})")
        keep = [c for c in names if c in set(spec.classes)]  # source order, not spec order
        old = np.asarray([names.index(c) for c in keep])
        idx = idx[np.isin(labels, old)]
    remap = {names.index(c): i for i, c in enumerate(keep)}
    if spec.shard is not None:
        i, n = spec.shard
        perm = idx[_rng(seed, 0x5A4D).permutation(len(idx))]
        idx = np.sort(perm[i - 1::n])
    if spec.limit is not None and spec.limit < len(idx):
        idx = np.sort(idx[_rng(seed, 0x11A1).permutation(len(idx))[: spec.limit]])
    new = np.asarray([remap[int(l)] for l in labels[idx]], dtype=np.int64)
    return idx, keep, new


def _to_tensor(images, idx: np.ndarray, scale: float, img_size: int, in_chans: int, where: str) -> torch.Tensor:
    """uint8 (H,W[,C]) samples -> normalised float32 (N, C, img, img), in chunks."""
    out = torch.empty((len(idx), in_chans, img_size, img_size), dtype=torch.float32)
    chunk = 512
    for s in range(0, len(idx), chunk):
        part = [images[int(i)] for i in idx[s:s + chunk]]
        shapes = {p.shape for p in part}
        groups = [part] if len(shapes) == 1 else [[p] for p in part]  # folders may mix sizes
        row = s
        for g in groups:
            x = torch.from_numpy(np.stack(g)).float() / scale  # (B, H, W[, C])
            x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)  # (B, c, H, W)
            if x.shape[1] != in_chans:
                if x.shape[1] == 1:
                    x = x.expand(-1, in_chans, -1, -1)
                elif in_chans == 1:
                    x = x.mean(dim=1, keepdim=True)
                else:
                    raise DataError(f"{where}: cannot map {x.shape[1]} channels to {in_chans}")
            if x.shape[-2:] != (img_size, img_size):
                x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", antialias=True, align_corners=False)
            out[row:row + len(g)] = (x.clamp(0, 1) - MEAN) / STD
            row += len(g)
    return out


def load_dataset(spec: str, img_size: int, in_chans: int = 3, split: str = "train", seed: int = 0) -> LabeledImages:
    """Load one split of a data spec (see module doc) ready for a model of `img_size` x `in_chans`.

    `seed` is the default for the spec's `seed=` (80/20 split, shard, subset); it is a data
    seed, deliberately separate from the training seed.
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r} (train or test)")
    ds = DataSpec.parse(spec)
    dseed = ds.seed if ds.seed is not None else seed
    if ds.source == "digits":
        splits, names = _digits()
        where = "digits"
    elif ds.source == "npz":
        splits, names = _npz(Path(ds.path).expanduser())
        where = ds.path
    else:
        splits, names = _folder(Path(ds.path).expanduser())
        where = ds.path
    if "all" in splits:
        raw = splits["all"]
        base = split_indices(raw.labels, dseed)[split]
    else:
        raw = splits[split]
        base = np.arange(len(raw.labels))
    sel, keep, labels = _select(raw.labels[base], names, ds, dseed, where)
    idx = base[sel]
    if len(idx) == 0:
        raise DataError(f"{spec}: the {split} split is empty")
    images = _to_tensor(raw.images, idx, raw.scale, img_size, in_chans, where)
    return LabeledImages(images=images, labels=torch.from_numpy(labels), classes=keep, spec=spec)
