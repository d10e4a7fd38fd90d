"""Privacy check for p-FESTA: can whoever sees the uploaded patch embeddings rebuild the images?

The p-FESTA paper's attacker, who does not know the embedder (§III-B), is in
`protocols.inversion_attack`; this module holds what it and the tests share
(:func:`observed_features`, :func:`mse`, :func:`ssim`) and the attacker the secret
is there to stop.

:func:`known_embedder_attack` is a stronger attacker that knows the shared frozen embedder
(projection ``W``, bias ``b``, position table ``pos``). Every token is ``W p + b + pos_j``;
when ``D > C*p*p`` the position ``j`` is identifiable from the component of the token
outside ``range(W)``, so an assignment per image undoes the permutation and least squares
inverts ``W``. Permutation alone therefore does not hide images from a party that knows the
embedder when the embedding is wider than a patch; with ``D == C*p*p`` (ViT-B/16 on RGB:
768 = 3*16*16) this particular attack has nothing to match on, though priors such as the
pixel range ([0, 1]) could still single out positions. Permutation protects only against
parties that do not hold the embedder: that is why the embedder is the clients' secret
(`atdnode.split.secret`) and the server never sees it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as Fn
from scipy.optimize import linear_sum_assignment

from protocols.pfesta import permute_tokens, random_permutations
from protocols.split_parts import TimmStem


@torch.no_grad()
def observed_features(embedder: TimmStem, images: torch.Tensor, *, permute: bool,
                      gen: torch.Generator) -> torch.Tensor:
    """What leaves a p-FESTA client for ``images``: (M, N, D) embeddings, permuted per image."""
    tokens = embedder(images)
    if permute:
        tokens = permute_tokens(tokens, random_permutations(tokens.shape[0], tokens.shape[1], gen))
    return tokens


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(Fn.mse_loss(a, b))


def ssim(a: torch.Tensor, b: torch.Tensor, *, data_range: float = 1.0, window: int = 7,
         sigma: float = 1.5) -> float:
    """Mean SSIM (Wang et al. 2004; Gaussian window, K1=0.01, K2=0.03) of (B, C, H, W) images."""
    coords = torch.arange(window, dtype=torch.float32) - (window - 1) / 2
    g = torch.exp(-coords ** 2 / (2 * sigma ** 2))
    g = g / g.sum()
    c = a.shape[1]
    k = (g[:, None] * g[None, :]).expand(c, 1, window, window).contiguous()

    def blur(t: torch.Tensor) -> torch.Tensor:
        return Fn.conv2d(t, k, groups=c)  # 'valid' windows only, as scikit-image does at borders

    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a ** 2
    var_b = blur(b * b) - mu_b ** 2
    cov = blur(a * b) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return float(s.mean())


@torch.no_grad()
def known_embedder_attack(embedder: TimmStem, feats: torch.Tensor) -> torch.Tensor:
    """Rebuild images from permuted embeddings knowing the frozen embedder (see module doc).
    ``feats`` (M, N, D) -> images (M, C, H, W)."""
    vit = embedder.vit
    proj = vit.patch_embed.proj
    c, p = proj.in_channels, proj.kernel_size[0]
    w = proj.weight.reshape(proj.out_channels, -1)  # (D, C*p*p)
    pos = vit.pos_embed[0, -feats.shape[1]:]  # (N, D)
    w_pinv = torch.linalg.pinv(w)  # (C*p*p, D)
    outside = torch.eye(w.shape[0]) - w @ w_pinv  # projector onto the complement of range(W)
    centred = feats - proj.bias  # (M, N, D)
    # cost[m, i, j] = || outside (token_i - pos_j) ||: zero exactly at the true position
    cost = torch.cdist(centred @ outside.T, (pos @ outside.T).expand(feats.shape[0], -1, -1))
    side = int(feats.shape[1] ** 0.5)
    out = torch.empty(feats.shape[0], c, side * p, side * p)
    for m in range(feats.shape[0]):
        rows, cols = linear_sum_assignment(cost[m].numpy())
        patches = (centred[m, rows] - pos[cols]) @ w_pinv.T  # (N, C*p*p) in assigned positions
        ordered = torch.empty_like(patches)
        ordered[torch.as_tensor(cols)] = patches
        grid = ordered.reshape(side, side, c, p, p).permute(2, 0, 3, 1, 4)  # (C, h, p, w, p)
        out[m] = grid.reshape(c, side * p, side * p)
    return out
