"""A model size that fits the data, for `atd train` without size flags.

`choose_size(side, images, device)` picks the ViT's input size, patch size, width, depth and
heads from the images' native side (pixels), the number of training images and the device
type, and says why in one line. The rules (a ViT of ~50-200 tokens trains in minutes):

* input size: the native side, made a multiple of the patch and capped at ``CAP`` (CPU:
  128, CUDA: 224); images are never enlarged beyond their native side (a 28-px image
  stays 28 px; a 512-px X-ray is resized to the cap);
* patch: 4 px up to 32 px, 8 px up to 64 px, else 16 px (7x7 up to 14x14 patches);
* width / depth / heads: on CPU embed 64, depth 4, 4 heads (below ``LARGE`` images) or
  embed 128, depth 6, 4 heads; on CUDA embed 192, depth 6, 3 heads or timm's
  ViT-Tiny (192, 12, 3) from ``LARGE`` images on;
* CPU threads: the small CPU model runs on one thread (``threads=1``): its matrices are
  too small to gain from more, and a second thread that has to wait for a busy core makes
  each step many times slower; None leaves torch's default.

The result is the override set for `atdnode.learning.model.resolve_config` of
``DEFAULT_MODEL`` (timm's family the sizes are applied to).
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "vit_tiny_patch16_224"
CAP = {"cpu": 128, "cuda": 224}
LARGE = 5000  # training images from which a larger model pays


@dataclass(frozen=True)
class SizeChoice:
    img_size: int
    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    why: str
    threads: int | None = None

    def overrides(self) -> dict[str, int]:
        return {"img_size": self.img_size, "patch_size": self.patch_size, "embed_dim": self.embed_dim,
                "depth": self.depth, "num_heads": self.num_heads}


def _patch(side: int) -> int:
    return 4 if side <= 32 else 8 if side <= 64 else 16


def choose_size(side: int, images: int, device: str) -> SizeChoice:
    """The model size for `images` training images of native side `side` px on `device`
    ("cpu", "cuda", "cuda:N"; anything else is treated as CPU); see the module docstring."""
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    side = max(8, int(side))
    target = min(side, CAP[kind])
    patch = _patch(target)
    img = max(patch * 2, (target // patch) * patch)  # a multiple of the patch, never above the native side
    threads = None
    if kind == "cpu":
        embed, depth, heads = (64, 4, 4) if images < LARGE else (128, 6, 4)
        threads = 1 if images < LARGE else None
    else:
        embed, depth, heads = (192, 6, 3) if images < LARGE else (192, 12, 3)
    grid = img // patch
    why = (f"{side}-px images, {images} for training, {kind.upper()}: img {img}, patch {patch} "
           f"({grid}x{grid} tokens), embed {embed}, depth {depth}, {heads} heads"
           + (f", {threads} thread" if threads else ""))
    return SizeChoice(img_size=img, patch_size=patch, embed_dim=embed, depth=depth, num_heads=heads, why=why,
                      threads=threads)
