"""`folder:PATH` — PNG / JPEG / TIFF / BMP files via Pillow, at their full bit depth.

8-bit grayscale and RGB stay 8-bit (fixed 0..255); 16-bit (`I;16`), 32-bit integer (`I`)
and float (`F`) images keep their values and are min-max scaled per image unless `window=`
says otherwise. Pillow's decompression-bomb limit (`PIL.Image.MAX_IMAGE_PIXELS`) is a hard
limit here: a larger image is a one-line `DataError` naming the file, before it is decoded.
Multi-page TIFFs need `frame=K`. A file Pillow cannot read is skipped and reported.
Limitation: Pillow reads 48-bit RGB PNGs as 8-bit RGB.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from atdnode.data.intensity import Scaling, default_for
from atdnode.data.layout import Catalog, Skip, list_files, rel
from atdnode.data.spec import DataSpec
from atdnode.errors import DataError

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp"}
_HINTS = {".dcm": "DICOM: use dicom:PATH", ".nii": "NIfTI: use nifti:PATH", ".gz": "use nifti:PATH for .nii.gz"}


def _accept(f: Path) -> str | None:
    ext = f.suffix.lower()
    if ext in IMAGE_EXTS:
        return None
    return f"not an image ({_HINTS[ext]})" if ext in _HINTS else f"not an image (extension {ext or 'none'!r})"


def pixel_limit_check(n_pixels: int, where: str) -> None:
    """Refuse images above Pillow's decompression-bomb limit (same rule for every format)."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and n_pixels > limit:
        raise DataError(f"{where}: image of {n_pixels} pixels exceeds the decompression-bomb limit of {limit} pixels")


def read_image(path: Path, frame: int | None, where: str) -> np.ndarray:
    """One image as (H, W) or (H, W, 3) array of its own dtype (uint8 / uint16 / int32 / float32)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # damaged-file chatter; the reason goes into the report
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                n = getattr(im, "n_frames", 1) if im.format == "TIFF" else 1  # (animated PNG, MPO JPEG: first frame)
                if n > 1 and frame is None:
                    raise DataError(f"{where}: multi-page image ({n} pages); choose one with frame=K")
                if frame:
                    if frame >= n:
                        raise Skip(f"has {n} page(s), frame={frame} asked")
                    im.seek(frame)
                pixel_limit_check(im.size[0] * im.size[1], where)
                if im.mode in ("I;16", "I;16B", "I;16L", "I;16N"):
                    arr = np.asarray(im).astype(np.uint16)
                elif im.mode in ("I", "F", "L", "RGB"):
                    arr = np.asarray(im)
                elif im.mode in ("1", "LA", "La"):
                    arr = np.asarray(im.convert("L"))
                else:  # P, RGBA, CMYK, YCbCr, ...
                    arr = np.asarray(im.convert("RGB"))
                arr = arr.copy()
    except (DataError, Skip):
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(f"{where}: refused, {exc}") from None
    except UnidentifiedImageError as exc:
        raise Skip(f"unreadable image ({exc})") from None
    except Exception as exc:  # Pillow's plugins raise many types on damaged files (struct.error, EOFError, ...)
        raise Skip(f"unreadable image ({type(exc).__name__}: {exc})") from None
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise Skip("has NaN or infinite pixels")
    return arr


def folder_catalog(ds: DataSpec) -> Catalog:
    root = Path(ds.path).expanduser()
    lst = list_files(root, _accept, ds.labels, "PNG/JPEG/TIFF/BMP images")
    files = lst.files

    def read(i: int) -> tuple[np.ndarray, Scaling]:
        arr = read_image(files[i], ds.frame, str(files[i]))
        return arr, default_for(arr.dtype)

    return Catalog(keys=np.asarray(lst.keys, dtype=str), sides=np.asarray(lst.sides, dtype=str), read=read,
                   where=[rel(root, f) for f in files], skipped=lst.skipped)
