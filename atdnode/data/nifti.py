"""`nifti:PATH` — 2-D slices of 3-D NIfTI volumes (.nii / .nii.gz) via nibabel.

Volumes are laid out like `folder:` (class sub-folders) or listed in `labels=FILE.csv`
(volume file -> class): the class belongs to the volume, and every slice inherits it.
Slice k along `axis=a` (array axis as stored, default 2 — axial for volumes written by
dcm2niix and most tools) is `volume.take(k, axis=a)`, with the header's scl_slope /
scl_inter applied; no reorientation (as MONAI's LoadImage). `slices=` picks which (see
`spec.py`). All slices of one volume land on the same side of the 80/20 split and in the
same `shard=`, so a patient is never in both train and test, nor on two nodes. Slices are min-max scaled per slice unless
`window=` is given (e.g. `window=-1000,400` for CT lungs, or `window=auto`).
A 4-D volume with more than one time point is skipped (reported).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from atdnode.data.images import pixel_limit_check
from atdnode.data.intensity import Scaling
from atdnode.data.layout import Catalog, Skip, list_files, rel
from atdnode.data.spec import DataSpec, slice_indices

_SLICE = Scaling(how="NIfTI slice, min-max per slice")
VOLUME_FACTOR = 4  # a volume may hold 4x the per-image pixel limit (512 x 512 x 1365 by default)


def _is_nifti(f: Path) -> bool:
    n = f.name.lower()
    return n.endswith(".nii") or n.endswith(".nii.gz")


def volume_shape(path: Path) -> tuple[int, int, int]:
    """The 3-D shape of a volume from its header (no voxel data read); raises Skip."""
    import nibabel as nib

    try:
        img = nib.load(str(path))
        shape = tuple(int(s) for s in img.shape)
    except Exception as exc:  # nibabel raises many types (ImageFileError, gzip/zlib errors, ...)
        raise Skip(f"unreadable NIfTI ({type(exc).__name__}: {exc})") from None
    while len(shape) > 3 and shape[-1] == 1:
        shape = shape[:-1]
    if len(shape) == 2:
        shape = (*shape, 1)
    if len(shape) != 3:
        raise Skip(f"{len(shape)}-D volume {shape}; only 3-D volumes (or 2-D images) are read")
    return shape  # type: ignore[return-value]


def read_slice(path: Path, axis: int, k: int) -> np.ndarray:
    import nibabel as nib

    try:
        img = nib.load(str(path))
        if len(img.shape) == 2:
            return np.asarray(img.dataobj, dtype=np.float64)[:, :, None].take(k, axis=axis)
        index: list = [slice(None)] * len(img.shape)
        index[axis] = k
        for d in range(3, len(img.shape)):
            index[d] = 0
        arr = np.asarray(img.dataobj[tuple(index)], dtype=np.float64)
    except Exception as exc:
        raise Skip(f"unreadable NIfTI data ({type(exc).__name__}: {exc})") from None
    return arr


def read_volume(path: Path) -> np.ndarray:
    """A whole volume as 3-D float32 (scl_slope / scl_inter applied); raises Skip."""
    import nibabel as nib

    try:
        vol = np.asarray(nib.load(str(path)).get_fdata(dtype=np.float32))
    except Exception as exc:  # nibabel raises many types (gzip/zlib errors, short files, ...)
        raise Skip(f"unreadable NIfTI data ({type(exc).__name__}: {exc})") from None
    vol = vol.reshape(vol.shape[:3] + (-1,))[..., 0] if vol.ndim > 3 else vol
    return vol[:, :, None] if vol.ndim == 2 else vol


def _take(vol: np.ndarray, axis: int, k: int) -> np.ndarray:
    return np.ascontiguousarray(vol[(slice(None),) * axis + (k,)], dtype=np.float64)  # (ndarray.take copies the volume)


def _finite(arr: np.ndarray, k: int) -> np.ndarray:
    if not np.isfinite(arr).all():
        raise Skip(f"slice {k} has NaN or infinite voxels")
    return arr


def nifti_catalog(ds: DataSpec) -> Catalog:
    root = Path(ds.path).expanduser()
    lst = list_files(root, lambda f: None if _is_nifti(f) else "not a NIfTI file (.nii / .nii.gz)",
                     ds.labels, "NIfTI volumes")
    refs: list[tuple[Path, int, str, str, int]] = []  # (volume, slice, key, side, group)
    skipped = list(lst.skipped)
    for g, (f, key, side) in enumerate(zip(lst.files, lst.keys, lst.sides)):
        try:
            shape = volume_shape(f)
        except Skip as exc:
            skipped.append((rel(root, f), str(exc)))
            continue
        plane = [s for d, s in enumerate(shape) if d != ds.axis]
        pixel_limit_check(plane[0] * plane[1], str(f))
        pixel_limit_check(shape[0] * shape[1] * shape[2] // VOLUME_FACTOR, f"{f} (volume / {VOLUME_FACTOR})")
        for k in slice_indices(ds.slices, shape[ds.axis]):
            refs.append((f, k, key, side, g))

    cache: dict[Path, np.ndarray] = {}  # the last gzipped volume: slicing .nii.gz re-inflates from the start

    def read(i: int) -> tuple[np.ndarray, Scaling]:
        f, k = refs[i][:2]
        if not f.name.lower().endswith(".gz"):
            return _finite(read_slice(f, ds.axis, k), k), _SLICE
        if f not in cache:
            cache.clear()
            cache[f] = read_volume(f)
        return _finite(_take(cache[f], ds.axis, k), k), _SLICE

    return Catalog(keys=np.asarray([r[2] for r in refs], dtype=str), sides=np.asarray([r[3] for r in refs], dtype=str),
                   read=read, groups=np.asarray([r[4] for r in refs], dtype=np.int64),
                   where=[f"{rel(root, r[0])}[{r[1]}]" for r in refs], skipped=skipped)
