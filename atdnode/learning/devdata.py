"""Training images where the training runs: resident on the GPU when they fit, compact when lossless.

`DeviceImages(images, device)` holds a split's normalised float32 images (N, C, H, W) and
serves `gather(src) -> (B, C, H, W)` float32 batches on `device`:

* CPU: the host tensor itself, indexed as before (nothing changes, bit for bit);
* CUDA, fits: the whole split on the GPU, once. When every value is an 8-bit intensity
  (`(q / 255 - MEAN) / STD` for integer q, checked bit for bit on the device) it is kept as
  uint8 — four times smaller — and normalised on the GPU per batch, giving the same floats;
  otherwise as float32;
* CUDA, does not fit: rows gathered on the host into pinned memory and copied without
  blocking, so the next batch's copy overlaps this batch's compute.

"Fits" means at most `budget` (default 0.4) of the GPU's free memory.
"""
from __future__ import annotations

import torch

from atdnode.data import MEAN, STD
from atdnode.learning.device import to_device

_CHUNK = 4096  # rows per chunk when moving / checking a split on the device


def _normalise_u8(q: torch.Tensor) -> torch.Tensor:
    """uint8 intensities -> the loader's normalised float32 (its formula, so the same bits)."""
    return (q.float() / 255.0 - MEAN) / STD


def lossless_uint8(images: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """`images` as uint8 intensities on `device` when `_normalise_u8` of them gives back every
    value bit for bit there (8-bit sources the loader did not resize), else None."""
    out = torch.empty(images.shape, dtype=torch.uint8, device=device)
    ok = torch.ones((), dtype=torch.bool, device=device)
    for s in range(0, len(images), _CHUNK):
        x = images[s:s + _CHUNK].to(device)
        q = ((x * STD + MEAN) * 255.0).round().clamp(0, 255).to(torch.uint8)
        ok &= (_normalise_u8(q) == x).all()  # bit for bit, on the device
        out[s:s + _CHUNK] = q
    return out if bool(ok) else None  # one synchronisation, at construction


class DeviceImages:
    """Images (and labels) of one split, served as batches on one device."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, device: torch.device, *, budget: float = 0.4) -> None:
        self.device = device
        self.host = images
        self.labels = to_device(labels, device)  # (N,) int64: small, always resident
        self.resident: torch.Tensor | None = None  # (N, C, H, W) float32 or uint8 on the device
        self.kind = "host"
        if device.type != "cuda":
            self.resident, self.kind = images, "host"
            return
        free, _ = torch.cuda.mem_get_info(device)
        if images.numel() <= budget * free:  # uint8 fits: try it
            q = lossless_uint8(images, device)
            if q is not None:
                self.resident, self.kind = q, "uint8"
                return
        if images.numel() * images.element_size() <= budget * free:
            self.resident, self.kind = images.to(device), "float32"
            return
        self.kind = "pinned"

    def gather(self, src: torch.Tensor) -> torch.Tensor:
        """Rows `src` ((B,) int64 on the CPU) as normalised float32 (B, C, H, W) on the device."""
        if self.kind == "host":
            return self.host[src]
        if self.kind == "pinned":
            return to_device(self.host[src], self.device)
        rows = self.resident[to_device(src, self.device)]
        return _normalise_u8(rows) if self.kind == "uint8" else rows

    def gather_labels(self, src: torch.Tensor) -> torch.Tensor:
        """Labels of rows `src` ((B,) int64 on the CPU), on the device."""
        return self.labels[to_device(src, self.device)] if self.labels.device != src.device else self.labels[src]
