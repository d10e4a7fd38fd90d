"""VGS-ATD augmentation for small classes (paper §4.2).

`mode="enlarge"` (the paper's rule, the default): every class with fewer than `threshold`
training samples is enlarged with extra samples — augmented copies of its own samples,
cycling through them, until the class reaches `threshold` or has `copies` extra copies of
each sample (default 1), whichever comes first. Each extra sample is made by three
distinct random picks out of five operations. `mode="inplace"` (the former behaviour, an
option): the training set keeps its size and each sample of a small class is, with
probability `prob`, replaced by such a transformed version in that epoch. The operations:
rotation (+-30 deg), horizontal flip, zoom (0.8-1.2), gaussian blur (sigma 0.1-2.0) and
brightness (0.5-1.5), via torchvision.transforms.v2.functional on tensors.

Randomness is a pure function of (seed, epoch, sample id), so the result does not depend
on batch composition, the number of DDP processes, or a resume in the middle of a run.
Images arrive normalised (mean 0.5, std 0.5) and leave normalised; the operations act on
the [0, 1] intensities in between.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from atdnode.data import MEAN, STD

OPS = ("rotate", "hflip", "zoom", "blur", "brightness")
MODES = ("enlarge", "inplace")


class SmallClassAugment:
    """Callable `(images (B,C,H,W), labels (B,), sample_ids (B,), epoch) -> images`."""

    def __init__(self, class_counts: list[int], *, threshold: int = 1000, prob: float = 0.5, seed: int = 0,
                 mode: str = "enlarge", copies: int = 1) -> None:
        if not 0.0 <= prob <= 1.0:
            raise ValueError("prob must be in [0, 1]")
        if mode not in MODES:
            raise ValueError(f"augmentation mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.copies = mode, int(copies)
        self.threshold = int(threshold)
        self.prob = float(prob)
        self.seed = int(seed)
        self.small = torch.tensor([c < threshold for c in class_counts], dtype=torch.bool)

    @property
    def active(self) -> bool:
        return bool(self.small.any()) and (self.prob > 0 or self.mode == "enlarge")

    def describe(self) -> dict:
        return {"augment": "vgs-small-class", "mode": self.mode, "threshold": self.threshold, "prob": self.prob,
                "small_classes": int(self.small.sum())}

    def extra_sources(self, labels: torch.Tensor) -> torch.Tensor:
        """Enlarge mode: the source sample of each extra sample (indices into `labels`), class
        by class; empty in place mode. Extra sample k of the set is sample N + k."""
        if self.mode != "enlarge" or not self.active:
            return torch.zeros(0, dtype=torch.int64)
        out = []
        for c in torch.nonzero(self.small).flatten().tolist():
            idx = torch.nonzero(labels == c).flatten()
            n = len(idx)
            k = min(self.threshold - n, self.copies * n)
            if n and k > 0:
                out.append(idx.repeat(math.ceil(k / n))[:k])
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)

    def make_extra(self, images: torch.Tensor, sample_ids: torch.Tensor, epoch: int) -> torch.Tensor:
        """Enlarge mode: transform the (already gathered) source images of extra samples
        `sample_ids` (>= N), each by three of the five operations."""
        out = images.clone()
        for b, sid in enumerate(sample_ids.tolist()):
            out[b] = apply_ops(images[b], self.params(int(sid), epoch, always=True))
        return out

    def params(self, sample_id: int, epoch: int, *, always: bool = False) -> dict | None:
        """The operations (with parameters) applied to one sample in one epoch, or None."""
        rng = np.random.default_rng([self.seed, epoch, int(sample_id), 0xA06])
        if rng.random() >= self.prob and not always:
            return None
        picks = rng.choice(len(OPS), size=3, replace=False)
        draws = {"rotate": rng.uniform(-30.0, 30.0), "zoom": rng.uniform(0.8, 1.2),
                 "blur": rng.uniform(0.1, 2.0), "brightness": rng.uniform(0.5, 1.5)}
        return {OPS[i]: draws.get(OPS[i], True) for i in sorted(picks)}

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, sample_ids: torch.Tensor, epoch: int) -> torch.Tensor:
        """In place mode: the batch with small-class samples transformed (each with `prob`)."""
        if not self.active or self.mode != "inplace":
            return images
        sel = self.small.to(labels.device)[labels]  # (B,) bool
        if not bool(sel.any()):
            return images
        out = images.clone()
        for b in torch.nonzero(sel).flatten().tolist():
            p = self.params(int(sample_ids[b]), epoch)
            if p is not None:
                out[b] = apply_ops(images[b], p)
        return out


def _blur_matrix(n: int, sigma: float) -> torch.Tensor:
    """(n, n) matrix of a 1-D gaussian blur with reflect padding (torchvision's kernel size)."""
    k = min(2 * math.ceil(3 * sigma) + 1, (n - 1) | 1)  # odd, fits the image
    r = k // 2
    t = np.arange(-r, r + 1, dtype=np.float64)
    w = np.exp(-0.5 * (t / sigma) ** 2)
    w /= w.sum()
    src = np.arange(n)[:, None] + t[None, :].astype(np.int64)  # (n, k) source pixel of each tap
    src = np.where(src < 0, -src, np.where(src >= n, 2 * (n - 1) - src, src))  # reflect
    m = np.zeros((n, n), dtype=np.float64)
    np.add.at(m, (np.repeat(np.arange(n), k), src.ravel()), np.tile(w, n))
    m = torch.from_numpy(m)
    return m.float()


def gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable gaussian blur of (C, H, W) as two small matmuls.

    Same result as `TF.gaussian_blur` (reflect padding, kernel 2*ceil(3 sigma)+1), but
    that one's depthwise convolution costs ~20 ms per 32 px image on some CPU builds.
    """
    mh = _blur_matrix(x.shape[-2], sigma)
    mw = mh if x.shape[-1] == x.shape[-2] else _blur_matrix(x.shape[-1], sigma)
    return mh @ x @ mw.T


def apply_ops(img: torch.Tensor, p: dict) -> torch.Tensor:
    """Apply the operations in `p` (as from `SmallClassAugment.params`) to one normalised image."""
    x = img * STD + MEAN  # (C, H, W) in [0, 1]
    if "rotate" in p or "zoom" in p:
        x = TF.affine(x, angle=float(p.get("rotate", 0.0)), translate=[0, 0], scale=float(p.get("zoom", 1.0)),
                      shear=[0.0, 0.0], interpolation=InterpolationMode.BILINEAR)
    if "hflip" in p:
        x = TF.horizontal_flip(x)
    if "blur" in p:
        x = gaussian_blur(x, float(p["blur"]))
    if "brightness" in p:
        x = TF.adjust_brightness(x, float(p["brightness"]))
    return (x.clamp(0, 1) - MEAN) / STD
