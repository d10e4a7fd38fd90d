"""Builders of small medical-image files for the data tests (pydicom, nibabel, Pillow)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

SECRET = "SECRET^PATIENT"  # must never leave the loader


def write_dicom(path: Path, stored: np.ndarray, *, slope: float = 1.0, intercept: float = 0.0,
                window: tuple[float, float] | None = None, voi_function: str | None = None,
                photometric: str = "MONOCHROME2", frames: int = 1, voi_lut: tuple[int, np.ndarray, int] | None = None,
                transfer_syntax=None) -> Path:
    """A CT-like DICOM file of `stored` values (uint16 or int16; (frames, H, W) when frames > 1)."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.sequence import Sequence
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = CTImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, meta.MediaStorageSOPInstanceUID
    ds.PatientName, ds.PatientID, ds.Modality = SECRET, "ID-0042-SECRET", "CT"
    ds.Rows, ds.Columns = stored.shape[-2:]
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, photometric
    ds.BitsAllocated, ds.BitsStored, ds.HighBit = 16, 16, 15
    ds.PixelRepresentation = 1 if stored.dtype == np.int16 else 0
    if frames > 1:
        ds.NumberOfFrames = frames
    ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
    if window is not None:
        ds.WindowCenter, ds.WindowWidth = window
    if voi_function:
        ds.VOILUTFunction = voi_function
    if voi_lut is not None:
        first, table, bits = voi_lut
        item = Dataset()
        item.LUTDescriptor = [len(table), first, bits]
        item.add_new(0x00283006, "US", [int(v) for v in table])  # LUTData
        ds.VOILUTSequence = Sequence([item])
    ds.PixelData = np.ascontiguousarray(stored).tobytes()
    if transfer_syntax is not None:
        ds.compress(transfer_syntax)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return path


def write_png16(path: Path, values: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(values.astype(np.uint16)).save(path)
    return path


def write_nifti(path: Path, volume: np.ndarray, *, slope: float | None = None, inter: float | None = None) -> Path:
    import nibabel as nib

    img = nib.Nifti1Image(volume, affine=np.eye(4))
    if slope is not None:
        img.header.set_slope_inter(slope, inter or 0.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(img, str(path))
    return path


def ct_slice(rng: np.random.Generator, size: int, lesion: bool) -> np.ndarray:
    """Hounsfield-like slice: air outside, soft tissue body, a bright disc for the lesion class."""
    yy, xx = np.mgrid[:size, :size]
    r = np.hypot(yy - size / 2, xx - size / 2)
    hu = np.where(r < size * 0.45, 40.0, -1000.0) + rng.normal(0, 15, (size, size))
    if lesion:
        cy, cx = rng.integers(size // 3, 2 * size // 3, 2)
        hu = np.where(np.hypot(yy - cy, xx - cx) < size * 0.15, 300.0, hu)
    return np.clip(hu, -1024.0, 3071.0)  # the 12-bit CT range


def damaged(good: bytes, rng: np.random.Generator, *, keep: int, step: int, flips: int) -> list[bytes]:
    """Truncations of `good` every `step` bytes and `flips` copies with 3 random bytes changed,
    all keeping the first `keep` bytes (a file's magic) intact."""
    cases = [good[:n] for n in range(keep, len(good), step)]
    for _ in range(flips):
        b = bytearray(good)
        for pos in rng.integers(keep, len(b), 3):
            b[pos] = int(rng.integers(0, 256))
        cases.append(bytes(b))
    return cases


def outcomes_of(read, path: Path, cases: list[bytes]) -> set[str]:
    """Write each case to `path` and call `read(path)`: the set of outcomes ("ok" or the
    exception's type name); only Skip and DataError may escape `read`."""
    from atdnode.data.layout import Skip
    from atdnode.errors import DataError

    seen = set()
    for c in cases:
        path.write_bytes(c)
        try:
            read(path)
            seen.add("ok")
        except (Skip, DataError) as exc:
            assert "SECRET" not in str(exc)
            seen.add(type(exc).__name__)
    return seen
