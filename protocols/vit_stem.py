"""The convolutional stem of a ViT with ``stem = "conv"`` (`protocols.vit_config`).

Xiao et al., *Early Convolutions Help Transformers See Better* (NeurIPS 2021): the single
patch-size convolution of the patch embedding is replaced by a small stack of convolutions.
For a patch size p = 2^k: k convolutions 3x3, stride 2, padding 1, no bias, of widths
``embed_dim >> (k - i)`` for i = 0..k-1 (p = 4, embed_dim 64: 1 -> 16 -> 32), each followed by
BatchNorm (`StemNorm`) and ReLU; then ``proj``, a 1x1 convolution (with bias) to
``embed_dim``. The output grid is img_size / p on a side, as with the patch embedding it
replaces.

`ConvStem` is a `timm.layers.PatchEmbed`, passed to timm's VisionTransformer as its
``embed_layer``, so everything timm reads off a patch embedding (``img_size``, ``patch_size``,
``grid_size``, ``num_patches``, ``feat_ratio``) keeps its meaning. Its tensors are
``patch_embed.stem.*`` (BatchNorm running statistics among them, and ``num_batches_tracked``,
an int64 that stays 0) and ``patch_embed.proj.*``; they belong to the extractor like the rest of
the patch embedding, and average like it (running statistics are floats).
``in_chans`` is kept as an attribute (``proj`` no longer sees the image).
"""
from __future__ import annotations

import torch
import torch.nn.functional as Fn
from timm.layers import PatchEmbed, to_2tuple
from timm.layers.format import Format, nchw_to
from torch import nn

from protocols.vit_config import conv_stem_depth


class StemNorm(nn.BatchNorm2d):
    """torch's BatchNorm2d (momentum 0.1) that keeps no batch count: its
    ``num_batches_tracked`` stays 0. The count only matters for ``momentum=None`` (a cumulative
    average), and models trained on different numbers of batches would otherwise differ in an
    integer tensor, which a weighted average refuses (`protocols.aggregation`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        return Fn.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                             self.momentum, self.eps)


class ConvStem(PatchEmbed):
    """A conv stem in the place of timm's patch embedding (the module doc); timm's
    ``embed_layer`` signature. ModelConfigError (a ValueError) for a patch size that is not a
    power of two >= 2 or an embed_dim below it."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, *, bias=True,
                 device=None, dtype=None, **kw) -> None:
        dd = {"device": device, "dtype": dtype}
        p = patch_size if isinstance(patch_size, int) else patch_size[0]
        k = conv_stem_depth(int(p), int(embed_dim))
        super().__init__(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
                         bias=bias, **dd, **kw)
        del self.proj  # the patch-size convolution; `proj` below is the stem's last one
        layers: list[nn.Module] = []
        c_in = in_chans
        for i in range(k):
            c_out = embed_dim >> (k - i)
            layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False, **dd),
                       StemNorm(c_out, **dd), nn.ReLU(inplace=True)]
            c_in = c_out
        self.stem = nn.Sequential(*layers)
        self.proj = nn.Conv2d(c_in, embed_dim, 1, bias=bias, **dd)
        self.in_chans = in_chans

    def set_input_size(self, img_size=None, patch_size=None) -> None:
        """timm's, for a new image size; a new patch size would need another stack: refused."""
        if patch_size is not None and to_2tuple(patch_size) != tuple(self.patch_size):
            raise ValueError("a conv stem's patch size is fixed by its convolutions")
        super().set_input_size(img_size=img_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, N, D), as PatchEmbed
        _, _, h, w = x.shape
        ph, pw = self.patch_size
        if self.img_size is not None and self.strict_img_size:
            torch._assert((h, w) == tuple(self.img_size), f"input size {(h, w)} != the model's {tuple(self.img_size)}")
        elif not self.dynamic_img_pad:
            torch._assert(h % ph == 0 and w % pw == 0, f"input size {(h, w)} is not a multiple of the patch size")
        if self.dynamic_img_pad:
            x = Fn.pad(x, (0, (pw - w % pw) % pw, 0, (ph - h % ph) % ph))
        x = self.proj(self.stem(x))
        if self.flatten:
            x = x.flatten(2).transpose(1, 2)
        elif self.output_fmt != Format.NCHW:
            x = nchw_to(x, self.output_fmt)
        return self.norm(x)
