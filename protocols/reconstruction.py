"""Privacy check for p-FESTA: can whoever sees the uploaded patch embeddings rebuild the images?

Threat model of :func:`decoder_attack` (the p-FESTA paper's): the attacker (the server,
or anyone reading the uploads) sees the embeddings, and has *public* images of the same
domain. It turns the public images into what it would observe — embeddings, permuted
per image when clients permute — and trains a decoder observation -> image, then applies
it to the private observations. Reported: MSE and SSIM against the private images, next to
the trivial "predict the mean public image" baseline.

:func:`known_embedder_attack` is a stronger attacker that knows the shared frozen embedder
(projection ``W``, bias ``b``, position table ``pos``). Every token is ``W p + b + pos_j``;
when ``D > C*p*p`` the position ``j`` is identifiable from the component of the token
outside ``range(W)``, so an assignment per image undoes the permutation and least squares
inverts ``W``. Permutation alone therefore does not hide images from a party that knows the
embedder when the embedding is wider than a patch; with ``D == C*p*p`` (ViT-B/16 on RGB:
768 = 3*16*16) this particular attack has nothing to match on, though priors such as the
pixel range ([0, 1]) could still single out positions. Treat permutation as protection
against parties that do not hold the embedder, and keep the embedder away from the server.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as Fn
from scipy.optimize import linear_sum_assignment
from torch import nn

from protocols.pfesta import permute_tokens, random_permutations
from protocols.split_parts import BatchSampler, TimmStem


@dataclass(frozen=True)
class AttackConfig:
    """The attacker's decoder training budget."""

    hidden: int = 512
    steps: int = 400
    batch_size: int = 64
    lr: float = 2e-3
    seed: int = 0


@torch.no_grad()
def observed_features(embedder: TimmStem, images: torch.Tensor, *, permute: bool,
                      gen: torch.Generator) -> torch.Tensor:
    """What leaves a p-FESTA client for ``images``: (M, N, D) embeddings, permuted per image."""
    tokens = embedder(images)
    if permute:
        tokens = permute_tokens(tokens, random_permutations(tokens.shape[0], tokens.shape[1], gen))
    return tokens


class Decoder(nn.Module):
    """MLP from a flattened token sequence to an image in [0, 1]."""

    def __init__(self, tokens: int, dim: int, image_shape: tuple[int, int, int], hidden: int) -> None:
        super().__init__()
        self.image_shape = image_shape
        out = image_shape[0] * image_shape[1] * image_shape[2]
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(tokens * dim, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, out))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, C, H, W)
        return torch.sigmoid(self.net(feats)).reshape(-1, *self.image_shape)


def train_decoder(feats: torch.Tensor, images: torch.Tensor, cfg: AttackConfig = AttackConfig()) -> Decoder:
    """The attacker's training on its public (observation, image) pairs; MSE loss."""
    gen_state = torch.random.fork_rng(devices=[])
    with gen_state:
        torch.manual_seed(cfg.seed)
        dec = Decoder(feats.shape[1], feats.shape[2], tuple(images.shape[1:]), cfg.hidden)
    opt = torch.optim.Adam(dec.parameters(), lr=cfg.lr)
    sampler = BatchSampler(feats.shape[0], min(cfg.batch_size, feats.shape[0]), seed=cfg.seed + 1)
    for _ in range(cfg.steps):
        idx = sampler.next()
        loss = Fn.mse_loss(dec(feats[idx]), images[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return dec.eval()


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


def decoder_attack(embedder: TimmStem, public: torch.Tensor, private: torch.Tensor, *, permute: bool,
                   cfg: AttackConfig = AttackConfig()) -> dict[str, float]:
    """Train on public images, reconstruct private ones from their observed embeddings.
    Returns mse, ssim, and the mean-image baseline's mse / ssim."""
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    dec = train_decoder(observed_features(embedder, public, permute=permute, gen=gen), public, cfg)
    with torch.no_grad():
        rec = dec(observed_features(embedder, private, permute=permute, gen=gen))
    base = public.mean(0, keepdim=True).expand_as(private)
    return {"mse": mse(rec, private), "ssim": ssim(rec, private),
            "baseline_mse": mse(base, private), "baseline_ssim": ssim(base, private)}


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
