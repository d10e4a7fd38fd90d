"""In-memory sources: `digits` (scikit-learn) and MedMNIST-style `npz:PATH`.

npz layout: train_images / train_labels [, val_*] [, test_*]; images (N, H, W) or
(N, H, W, C) with C in {1, 3}, uint8 (fixed 0..255) or uint16 / int16 / int32 / float
(min-max per image); labels (N,) or (N, 1) integer ids; optional `classes` string array
naming the ids. The file is opened without pickle, and every array's declared size is
checked against the memory available before it is read (a hostile .npz cannot make the
loader allocate what it announces).
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from atdnode.data.images import pixel_limit_check
from atdnode.data.intensity import Scaling, default_for
from atdnode.data.layout import Catalog
from atdnode.errors import DataError

IMAGE_DTYPES = (np.uint8, np.uint16, np.int16, np.int32, np.float32, np.float64)


def _array_reader(images: np.ndarray, scaling: Scaling):
    def read(i: int) -> tuple[np.ndarray, Scaling]:
        return images[i], scaling
    return read


def digits_catalog() -> Catalog:
    from sklearn.datasets import load_digits

    d = load_digits()
    images = d.images.astype(np.uint8)
    keys = d.target.astype(np.int64).astype(str)
    return Catalog(keys=keys, sides=np.full(len(keys), "all"), ids=True, uniform=True,
                   read=_array_reader(images, Scaling(window=(0.0, 16.0), how="digits, fixed 0..16")),
                   names={str(i): str(i) for i in range(10)}, where=[""] * len(keys))


def _declared(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of every array in the archive, from the .npy headers only."""
    out = {}
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            if not name.endswith(".npy"):
                continue
            with zf.open(name) as fh:
                version = np.lib.format.read_magic(fh)
                read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                               (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                if read_header is None:
                    raise ValueError(f"{name}: unsupported .npy format version {version}")
                shape, _, dtype = read_header(fh)  # header only
            out[name[:-4]] = (tuple(shape), np.dtype(dtype))
    return out


def _check_memory(path: Path, declared: dict) -> None:
    import psutil

    need = sum(int(np.prod(s, dtype=np.float64)) * dt.itemsize for s, dt in declared.values())
    avail = psutil.virtual_memory().available
    if need > avail:
        raise DataError(f"{path}: arrays need {need / 2**30:.1f} GiB, only {avail / 2**30:.1f} GiB of memory available")


def npz_catalog(path: Path) -> Catalog:
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        declared = _declared(path)
        _check_memory(path, declared)
        with np.load(path, allow_pickle=False) as z:  # never unpickle data files
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, KeyError) as exc:
        raise DataError(f"{path}: not a readable .npz ({exc})") from None
    if "train_images" not in arrays or "train_labels" not in arrays:
        raise DataError(f"{path}: missing keys train_images/train_labels (has {sorted(arrays)})")
    parts_i, parts_l, sides = [], [], []
    for split in ("train", "val", "test"):
        ik, lk = f"{split}_images", f"{split}_labels"
        if (ik in arrays) != (lk in arrays):
            raise DataError(f"{path}: has {ik if ik in arrays else lk} without its pair")
        if ik not in arrays:
            continue
        imgs, labs = arrays[ik], arrays[lk]
        if imgs.ndim not in (3, 4) or (imgs.ndim == 4 and imgs.shape[-1] not in (1, 3)):
            raise DataError(f"{path}: {ik} has shape {imgs.shape}, expected (N,H,W) or (N,H,W,C)")
        if imgs.dtype not in IMAGE_DTYPES:
            raise DataError(f"{path}: {ik} has dtype {imgs.dtype}, expected uint8 (or uint16/int16/int32/float)")
        if imgs.dtype.kind == "f" and not np.isfinite(imgs).all():
            raise DataError(f"{path}: {ik} has NaN or infinite values")
        if labs.ndim == 2 and labs.shape[1] == 1:
            labs = labs[:, 0]
        if labs.ndim != 1 or not np.issubdtype(labs.dtype, np.integer):
            raise DataError(f"{path}: {lk} must be integer (N,) or (N,1), got {labs.dtype} {labs.shape}")
        if len(imgs) != len(labs):
            raise DataError(f"{path}: {len(imgs)} {ik} but {len(labs)} {lk}")
        pixel_limit_check(int(np.prod(imgs.shape[1:3])), f"{path}: {ik}")
        parts_i.append(imgs)
        parts_l.append(labs.astype(np.int64))
        sides.append(np.full(len(labs), split))
    shapes = {p.shape[1:] for p in parts_i}
    dtypes = {p.dtype for p in parts_i}
    if len(shapes) > 1 or len(dtypes) > 1:
        raise DataError(f"{path}: splits differ in image shape/dtype ({sorted(map(str, shapes))}, {sorted(map(str, dtypes))})")
    images = parts_i[0] if len(parts_i) == 1 else np.concatenate(parts_i)
    labels = np.concatenate(parts_l)
    side = np.concatenate(sides)
    if len(labels) == 0:
        raise DataError(f"{path}: no samples")
    if "test" not in side:  # no test split: train gets the seeded 80/20 split
        side = np.where(side == "train", "all", side)
    names = None
    if "classes" in arrays:
        cl = arrays["classes"]
        if cl.ndim != 1 or cl.dtype.kind not in "US":
            raise DataError(f"{path}: classes must be a 1-D string array, got {cl.dtype} {cl.shape}")
        names = {str(i): str(c) for i, c in enumerate(cl.tolist())}
        bad = labels[(labels < 0) | (labels >= len(names))]
        if bad.size:
            raise DataError(f"{path}: labels out of range 0..{len(names) - 1} (found {int(bad[0])})")
    return Catalog(keys=labels.astype(str), sides=side, ids=True, names=names, uniform=True,
                   read=_array_reader(images, default_for(images.dtype)), where=[""] * len(labels))
