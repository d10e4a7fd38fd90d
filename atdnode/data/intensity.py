"""Intensity scaling: a sample's raw values -> [0, 1], never by silent clipping to 8 bits.

Defaults, by what the source holds:
  * 8-bit images (PNG/JPEG/npz uint8): fixed 0..255 (digits: 0..16);
  * 16-bit / float images (PNG, TIFF, npz, NIfTI slices): min-max of each image;
  * DICOM: the header's VOI LUT or window centre/width when present (after the modality
    rescale), else min-max of the image; MONOCHROME1 inverted.
`window=lo,hi` (values in the source's units — Hounsfield units for CT DICOM after rescale)
overrides all of them; `window=auto` uses the 0.5th..99.5th percentiles of the training
side's pixels (up to `AUTO_FILES` images, evenly spaced); `window=minmax` forces per-image
min-max. Windowing maps lo..hi linearly and saturates outside it — that is what a window
is; nothing else ever clips. Each sample's scaling is described by `how`, which the loader
reports.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

AUTO_FILES = 64
AUTO_PIXELS = 65536  # per image, strided
AUTO_PCT = (0.5, 99.5)


@dataclass(frozen=True)
class Scaling:
    """How one sample's (rescaled) values map to [0, 1]."""

    window: tuple[float, float] | None = None  # linear lo..hi, saturating; None: the image's min..max
    sigmoid: tuple[float, float] | None = None  # DICOM VOI SIGMOID (centre, width)
    lut: tuple[int, np.ndarray, int] | None = None  # DICOM VOI LUT (first mapped value, table, bits)
    invert: bool = False  # MONOCHROME1
    how: str = "min-max per image"
    stored: str | None = None  # the stored dtype when the reader already converted (DICOM rescale)

    def apply(self, x: torch.Tensor, per_image_dims: tuple[int, ...]) -> torch.Tensor:
        """x: float tensor; min-max is taken over `per_image_dims` (keepdim)."""
        if self.lut is not None:
            first, table, bits = self.lut
            idx = (x.round().long() - first).clamp(0, len(table) - 1)
            y = torch.from_numpy(np.asarray(table, dtype=np.float64)).to(x.dtype)[idx] / float(2 ** bits - 1)
        elif self.sigmoid is not None:
            c, w = self.sigmoid
            y = torch.sigmoid(4.0 * (x - c) / w)
        elif self.window is not None:
            lo, hi = self.window
            y = ((x - lo) / (hi - lo)).clamp(0, 1)
        else:
            lo = x.amin(dim=per_image_dims, keepdim=True)
            span = x.amax(dim=per_image_dims, keepdim=True) - lo
            y = torch.where(span > 0, (x - lo) / torch.where(span > 0, span, 1), torch.zeros_like(x))
        return 1.0 - y if self.invert else y


FIXED_8BIT = Scaling(window=(0.0, 255.0), how="8-bit, fixed 0..255")
MINMAX = Scaling()


def default_for(dtype: np.dtype) -> Scaling:
    """8-bit data keeps its fixed scale; anything deeper is min-max scaled per image."""
    if dtype == np.uint8:
        return FIXED_8BIT
    return Scaling(how=f"{np.dtype(dtype).name}, min-max per image")


def override(s: Scaling, window: tuple[float, float] | str | None, auto: tuple[float, float] | None = None) -> Scaling:
    """Apply the spec's `window=` to a sample's default scaling (keeps MONOCHROME1 inversion)."""
    if window is None:
        return s
    if window == "minmax":
        return Scaling(invert=s.invert, stored=s.stored, how="min-max per image (window=minmax)")
    if window == "auto":
        assert auto is not None
        return Scaling(window=auto, invert=s.invert, stored=s.stored,
                       how=f"window=auto {auto[0]:g}..{auto[1]:g} (percentiles)")
    return Scaling(window=tuple(window), invert=s.invert, stored=s.stored, how=f"window {window[0]:g}..{window[1]:g}")


def sample_pixels(x: np.ndarray) -> np.ndarray:
    """Up to AUTO_PIXELS of an image's values, strided (deterministic), finite only."""
    flat = np.asarray(x, dtype=np.float64).ravel()
    step = max(1, flat.size // AUTO_PIXELS)
    flat = flat[::step]
    return flat[np.isfinite(flat)]


def auto_window(samples: list[np.ndarray], where: str) -> tuple[float, float]:
    """0.5th..99.5th percentiles of pooled pixel samples; a degenerate range widens to 1."""
    from atdnode.errors import DataError

    pooled = np.concatenate(samples) if samples else np.empty(0)
    if pooled.size == 0:
        raise DataError(f"{where}: window=auto found no readable training images")
    lo, hi = (float(v) for v in np.percentile(pooled, AUTO_PCT))
    return (lo, hi) if hi > lo else (lo, lo + 1.0)
