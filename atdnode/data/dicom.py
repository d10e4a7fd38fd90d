"""`dicom:PATH` — DICOM files via pydicom, laid out like `folder:` (or `labels=FILE.csv`).

Per file (DICOM PS3.3 C.11 / PS3.4 N.2 order): decode the pixels; apply the modality LUT
(RescaleSlope / RescaleIntercept, or a Modality LUT Sequence); then the VOI: `window=`
when given, else the header's VOI LUT Sequence (first item) or window centre/width (first
pair; VOILUTFunction LINEAR, LINEAR_EXACT or SIGMOID), else min-max of the image;
MONOCHROME1 is inverted so that bright means dense, as for MONOCHROME2.

Only pixels and the label leave this module: the header is read into local variables and
dropped; nothing of it reaches `LabeledImages` or the report (file paths do).

Skipped and reported: files without the DICM preamble, unreadable files, objects without
pixel data. Refused with one line naming the file: multi-frame files without `frame=K`,
compressed transfer syntaxes that no installed decoder handles (pydicom decodes RLE itself
and JPEG baseline / JPEG 2000 through Pillow; JPEG-LS and others need pylibjpeg or GDCM),
and images above the decompression-bomb pixel limit.
Limitation: enhanced multi-frame per-frame functional groups (per-frame rescale/window)
are not read; the top-level attributes are used.
"""
from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

from atdnode.data.images import pixel_limit_check
from atdnode.data.intensity import Scaling, default_for
from atdnode.data.layout import Catalog, Skip, list_files, rel
from atdnode.data.spec import DataSpec
from atdnode.errors import DataError

_PIXEL_TAGS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")


def _accept(f: Path) -> str | None:
    try:
        with open(f, "rb") as fh:
            head = fh.read(132)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None if head[128:132] == b"DICM" else "not a DICOM file (no DICM preamble)"


def _first(v) -> float:
    return float(v[0] if isinstance(v, (list, tuple)) or type(v).__name__ == "MultiValue" else v)


def _voi(ds) -> Scaling | None:
    """The header's VOI transform, or None."""
    seq = ds.get("VOILUTSequence")
    if seq:
        item = seq[0]
        desc = [int(x) for x in item.LUTDescriptor]
        entries = desc[0] or 65536
        bits = desc[2]
        data = item.get("LUTData")
        if isinstance(data, (bytes, bytearray)):  # OW: little-endian words (or bytes for 8-bit LUTs)
            data = np.frombuffer(data, dtype="<u2" if bits > 8 else np.uint8)
        table = np.asarray(data if data is not None else [], dtype=np.float64).ravel()
        if len(table) >= entries and 1 <= bits <= 16:
            return Scaling(lut=(desc[1], table[:entries], bits), how="DICOM VOI LUT (header)")
    if "WindowCenter" in ds and "WindowWidth" in ds:
        c, w = _first(ds.WindowCenter), _first(ds.WindowWidth)
        fn = str(ds.get("VOILUTFunction", "LINEAR") or "LINEAR").upper()
        if fn == "SIGMOID" and w > 0:
            return Scaling(sigmoid=(c, w), how="DICOM window (header, SIGMOID)")
        if fn == "LINEAR_EXACT" and w > 0:
            return Scaling(window=(c - w / 2, c + w / 2), how="DICOM window (header, LINEAR_EXACT)")
        if w >= 1:  # PS3.3 C.11.2.1.2.1: lo/hi of the linear ramp
            return Scaling(window=(c - 0.5 - (w - 1) / 2, c - 0.5 + (w - 1) / 2), how="DICOM window (header)")
    return None


@contextmanager
def _quiet():
    """pydicom warns and logs about malformed values *quoting them* (patient names included):
    silence both while reading, so no header text reaches the node's logs."""
    log = logging.getLogger("pydicom")
    was = log.disabled
    log.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.disabled = was


def read_dicom(path: Path, frame: int | None, where: str) -> tuple[np.ndarray, Scaling]:
    """(pixels after the modality LUT, scaling) of one file; raises Skip or DataError.

    Reasons name the stage and the exception type, never pydicom's message: those quote
    header values."""
    with _quiet():
        try:
            return _read(path, frame, where)
        except (Skip, DataError):
            raise
        except Exception as exc:  # pydicom raises many types on malformed files
            raise Skip(f"unreadable DICOM ({type(exc).__name__})") from None


def _read(path: Path, frame: int | None, where: str) -> tuple[np.ndarray, Scaling]:
    import pydicom
    from pydicom.pixels import apply_color_lut, apply_modality_lut, get_decoder, pixel_array

    ds = pydicom.dcmread(path)
    if not any(t in ds for t in _PIXEL_TAGS):
        raise Skip("no pixel data (not an image object)")
    try:
        rows, cols = int(ds.Rows), int(ds.Columns)
        frames = int(ds.get("NumberOfFrames", 1) or 1)
        spp = int(ds.get("SamplesPerPixel", 1) or 1)
        photometric = str(ds.get("PhotometricInterpretation", "MONOCHROME2")).upper()
        ts = ds.file_meta.TransferSyntaxUID
    except (AttributeError, ValueError, TypeError) as exc:
        raise Skip(f"incomplete image header ({type(exc).__name__})") from None
    pixel_limit_check(rows * cols * spp, where)
    if frames > 1 and frame is None:
        raise DataError(f"{where}: multi-frame DICOM ({frames} frames); choose one with frame=K")
    index = None
    if frame is not None and frames > 1:
        if frame >= frames:
            raise Skip(f"has {frames} frames, frame={frame} asked")
        index = frame
    elif frame:
        raise Skip(f"has 1 frame, frame={frame} asked")
    if ts.is_compressed:
        try:
            ok = get_decoder(ts).is_available
        except (NotImplementedError, ValueError):
            ok = False
        if not ok:
            raise DataError(f"{where}: compressed transfer syntax {ts.name} and no installed decoder for it "
                            f"(pip install pylibjpeg pylibjpeg-libjpeg pylibjpeg-openjpeg, or python-gdcm)")
    try:
        arr = pixel_array(ds, index=index) if index is not None else ds.pixel_array
        stored = np.asarray(arr).dtype.name
        if photometric == "PALETTE COLOR":
            arr = apply_color_lut(arr, ds)
            return arr, default_for(arr.dtype)
        if spp == 1:
            arr = apply_modality_lut(arr, ds)
    except Exception as exc:  # decoders raise many types on corrupt data
        raise Skip(f"undecodable pixel data ({type(exc).__name__})") from None
    arr = np.asarray(arr)
    if arr.ndim != (2 if spp == 1 else 3):
        raise Skip(f"unexpected pixel array shape {arr.shape}")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise Skip("has NaN or infinite pixels")
    if spp != 1:  # colour: no VOI (PS3.3 C.11.2: grayscale only)
        return arr, default_for(arr.dtype)
    voi = replace(_voi(ds) or Scaling(how="DICOM, min-max per image (no VOI in header)"), stored=stored)
    if photometric == "MONOCHROME1":
        voi = replace(voi, invert=True, how=voi.how + ", MONOCHROME1 inverted")
    return arr, voi


def dicom_catalog(ds: DataSpec) -> Catalog:
    root = Path(ds.path).expanduser()
    lst = list_files(root, _accept, ds.labels, "DICOM files")
    files = lst.files

    def read(i: int) -> tuple[np.ndarray, Scaling]:
        return read_dicom(files[i], ds.frame, str(files[i]))

    return Catalog(keys=np.asarray(lst.keys, dtype=str), sides=np.asarray(lst.sides, dtype=str), read=read,
                   where=[rel(root, f) for f in files], skipped=lst.skipped)
