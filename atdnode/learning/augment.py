"""VGS-ATD augmentation for small classes (paper §4.2).

`mode="enlarge"` (the paper's rule, the default): every class with fewer than `threshold`
training samples is enlarged with extra samples — augmented copies of its own samples,
cycling through them, until the class reaches `threshold` or has `copies` extra copies of
each sample (default 1), whichever comes first. Each extra sample is made by three
distinct random picks out of five operations. `mode="inplace"` (the former behaviour, an
option): the training set keeps its size and each sample of a small class is, with
probability `prob`, replaced by such a transformed version in that epoch. The operations:
rotation (+-30 deg), horizontal flip, zoom (0.8-1.2), gaussian blur (sigma 0.1-2.0) and
brightness (0.5-1.5), batched on the images' device (`augment_batch`; grid_sample, matmul
blurs), with torchvision's semantics (tests compare them with torchvision's per-image ops).

Randomness is a pure function of (seed, epoch, sample id), so the result does not depend
on batch composition, the number of DDP processes, or a resume in the middle of a run.
The parameters are drawn on the host (numpy, per sample); the pixels are computed on the
images' device, reproducible on each device (bits may differ between CPU and CUDA, and on
CUDA between batch sizes, where the batched blur matmul may take another kernel).
Images arrive normalised (mean 0.5, std 0.5) and leave normalised; the operations act on
the [0, 1] intensities in between.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from atdnode.data import MEAN, STD
from atdnode.learning.device import to_device

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
        `sample_ids` (>= N, on the CPU), each by three of the five operations, batched on
        the images' device."""
        return augment_batch(images, [self.params(int(sid), epoch, always=True) for sid in sample_ids.tolist()])

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
        """In place mode: the batch with small-class samples transformed (each with `prob`).
        `labels` and `sample_ids` are read on the host (pass CPU tensors to avoid a device
        synchronisation); `images` may live on any device."""
        if not self.active or self.mode != "inplace":
            return images
        sel = self.small[labels.cpu()]  # (B,) bool
        if not bool(sel.any()):
            return images
        ids = sample_ids.cpu().tolist()
        return augment_batch(images, [self.params(int(ids[b]), epoch) if ok else None
                                      for b, ok in enumerate(sel.tolist())])


def _blur_taps(n: int, sigma: float, width: int) -> tuple[np.ndarray, int]:
    """1-D gaussian taps at offsets -width..width (zero beyond this sigma's radius), float64,
    summing to 1; torchvision's kernel size 2*ceil(3 sigma)+1, capped to fit the image."""
    k = min(2 * math.ceil(3 * sigma) + 1, (n - 1) | 1)  # odd, fits the image
    r = k // 2
    t = np.arange(-width, width + 1, dtype=np.float64)
    w = np.where(np.abs(t) <= r, np.exp(-0.5 * (t / sigma) ** 2), 0.0)
    return w / w.sum(), r


def _blur_matrices(n: int, sigmas: list[float], device: torch.device) -> torch.Tensor:
    """(S, n, n) matrices of 1-D gaussian blurs with reflect padding, one per sigma.

    Built tap by tap as sums of 0/1 shift matrices (no scatter-add): the same bits for a
    sigma whatever the batch, and deterministic on CUDA too.
    """
    width = max(min(2 * math.ceil(3 * s) + 1, (n - 1) | 1) // 2 for s in sigmas)
    taps = to_device(torch.from_numpy(np.stack([_blur_taps(n, s, width)[0] for s in sigmas])).float(), device)  # (S, K)
    i = torch.arange(n, device=device)
    m = torch.zeros(len(sigmas), n, n, device=device)
    for j, t in enumerate(range(-width, width + 1)):
        src = i + t
        src = torch.where(src < 0, -src, torch.where(src >= n, 2 * (n - 1) - src, src))  # reflect
        shift = (src[:, None] == i[None, :]).float()  # (n, n): row r reads pixel src[r]
        m += taps[:, j, None, None] * shift
    return m


def gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable gaussian blur of (C, H, W) as two small matmuls.

    Same result as `TF.gaussian_blur` (reflect padding, kernel 2*ceil(3 sigma)+1), but
    that one's depthwise convolution costs ~20 ms per 32 px image on some CPU builds.
    """
    mh = _blur_matrices(x.shape[-2], [sigma], x.device)[0]
    mw = mh if x.shape[-1] == x.shape[-2] else _blur_matrices(x.shape[-1], [sigma], x.device)[0]
    return mh @ x @ mw.T


def _affine_theta(angles: list[float], scales: list[float], h: int, w: int) -> torch.Tensor:
    """(S, 2, 3) normalised inverse maps of `TF.affine(angle, scale)` about the centre (no
    translation, no shear), as torchvision's `_get_inverse_affine_matrix` + `_gen_affine_grid`."""
    a = torch.tensor(angles, dtype=torch.float64) * (math.pi / 180.0)
    s = torch.tensor(scales, dtype=torch.float64)
    cos, sin, zero = torch.cos(a) / s, torch.sin(a) / s, torch.zeros_like(a)
    rows = [torch.stack([cos, sin * (h / w), zero], 1), torch.stack([-sin * (w / h), cos, zero], 1)]
    return torch.stack(rows, 1).float()


def augment_batch(images: torch.Tensor, params: list[dict | None]) -> torch.Tensor:
    """Apply each sample's operations (`SmallClassAugment.params`; None: unchanged) to a
    normalised batch (B, C, H, W) on its own device, the operations batched.

    Order and meaning as in the paper's list: rotation and zoom (one bilinear affine warp,
    zeros outside, as `TF.affine`), horizontal flip, gaussian blur (reflect padding),
    brightness, then clamp to [0, 1]. Samples with None come back bit for bit.
    """
    if len(params) != len(images):
        raise ValueError(f"{len(params)} parameter sets for {len(images)} images")
    todo = [b for b, p in enumerate(params) if p is not None]
    if not todo:
        return images
    dev = images.device
    b_h, c, h, w = images.shape
    x = images * STD + MEAN  # (B, C, H, W) in [0, 1]
    warp = [b for b in todo if "rotate" in params[b] or "zoom" in params[b]]
    if warp:
        theta = to_device(_affine_theta([float(params[b].get("rotate", 0.0)) for b in warp],
                              [float(params[b].get("zoom", 1.0)) for b in warp], h, w), dev)
        ib = to_device(torch.tensor(warp), dev)
        grid = F.affine_grid(theta, [len(warp), c, h, w], align_corners=False)  # (S, H, W, 2)
        x[ib] = F.grid_sample(x[ib], grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    flip = [b for b in todo if "hflip" in params[b]]
    if flip:
        ib = to_device(torch.tensor(flip), dev)
        x[ib] = x[ib].flip(-1)
    blur = [b for b in todo if "blur" in params[b]]
    if blur:
        sig = [float(params[b]["blur"]) for b in blur]
        mh = _blur_matrices(h, sig, dev)
        mw = mh if h == w else _blur_matrices(w, sig, dev)
        ib = to_device(torch.tensor(blur), dev)
        x[ib] = mh[:, None] @ x[ib] @ mw[:, None].transpose(-1, -2)  # (S, C, H, W)
    factor = [float(p.get("brightness", 1.0)) if p is not None else 1.0 for p in params]
    if any(f != 1.0 for f in factor):
        x = x * to_device(torch.tensor(factor, dtype=x.dtype), dev)[:, None, None, None]
    keep = to_device(torch.tensor([p is None for p in params]), dev)[:, None, None, None]
    return torch.where(keep, images, (x.clamp(0, 1) - MEAN) / STD)


def apply_ops(img: torch.Tensor, p: dict) -> torch.Tensor:
    """Apply the operations in `p` (as from `SmallClassAugment.params`) to one normalised image."""
    return augment_batch(img[None], [p])[0]
