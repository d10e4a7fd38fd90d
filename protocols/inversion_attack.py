"""The p-FESTA paper's attacker, who does NOT know the clients' patch embedder.

Threat model (p-FESTA §III-B): the server (or anyone holding the uploads) sees every
client's patch embeddings — permuted per image by p-FESTA, in order without permutation —
and holds public images of the same domain (an auxiliary set, disjoint from the clients').
It does not know the embedder's projection or position embedding (the clients' secret,
`atdnode.split.secret`). It trains, on the public images only:

* an encoder F̂ of the embedder's (public) architecture — patch projection + position
  embedding — standing in for the unknown embedder;
* a decoder G with ``G(F̂(x)) ≈ x`` (reconstruction loss on public images);
* a discriminator D between the clients' uploads and F̂'s outputs; F̂ is trained to fool
  it (and to match the statistics D sees), so F̂'s feature space drifts onto the clients'
  and G learns to decode the uploads.

Then ``G(upload)`` is its reconstruction. With permutation the order of the tokens is
lost, so the attacker also runs MSD's jigsaw solver (MSD §III-D, Eq. 5–7): a position
classifier ``q(j | z)`` on single tokens, trained with cross-entropy on F̂'s tokens of
public images whose positions it knows (Eq. 5–6), and, per image, the assignment of tokens
to positions that maximises ``Σ log q`` (Eq. 7, Hungarian algorithm); G decodes the
reordered tokens. D judges single tokens — with their position when the uploads are in
order, without it when they are permuted (there is no order to match).

Deviations (small models, seconds of CPU): MLP decoder / critic instead of the papers'
convolutional ones; non-saturating GAN loss; a fixed step budget; and, for stability with
few uploads, feature matching (Salimans et al. 2016) on the critic's input statistics — F̂
also matches the uploads' mean and covariance, per position when they are in order, over
all tokens when permuted. Without it the GAN alone found the embedder for some secrets and
not for others (SSIM 0.38–0.75 in order); with it, 0.77–0.90 over three secrets, against
0.23–0.30 permuted (900 public / 300 private digits, 800 steps). Reported: MSE and SSIM
against the private images, next to the "mean public image" baseline.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as Fn
from scipy.optimize import linear_sum_assignment
from torch import nn

from atdnode.model import ModelConfig
from protocols.pfesta import permute_tokens, random_permutations
from protocols.reconstruction import mse, ssim
from protocols.split_parts import BatchSampler


@dataclass(frozen=True)
class AttackConfig:
    """The attacker's training budget."""

    steps: int = 600
    batch_size: int = 64
    lr: float = 2e-3
    adv_weight: float = 0.05
    hidden: int = 256
    jigsaw_steps: int = 300
    match_weight: float = 1.0  # feature matching on the critic's input statistics (0: plain GAN)
    seed: int = 0


class PatchEncoder(nn.Module):
    """F̂: the embedder's public architecture with trainable weights: (B, C, H, W) -> (B, N, D)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(cfg.in_chans, cfg.embed_dim, cfg.patch_size, cfg.patch_size)
        self.pos = nn.Parameter(torch.randn(1, cfg.num_patches, cfg.embed_dim) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos  # (B, N, D)


class TokenDecoder(nn.Module):
    """G: ordered tokens (B, N, D) -> image (B, C, H, W) in [0, 1]."""

    def __init__(self, cfg: ModelConfig, hidden: int) -> None:
        super().__init__()
        self.shape = (cfg.in_chans, cfg.img_size, cfg.img_size)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(cfg.num_patches * cfg.embed_dim, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, cfg.in_chans * cfg.img_size ** 2))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net(z)).reshape(-1, *self.shape)


class TokenCritic(nn.Module):
    """D: per-token logits "this token came from a client upload", (B, N, D) -> (B, N).
    Judging single tokens gives it N samples per image (the uploads are few). Ordered
    uploads: each token with its position (one-hot); ``order_free`` (permuted uploads): the
    token alone, as its position is unknown."""

    def __init__(self, cfg: ModelConfig, hidden: int, order_free: bool) -> None:
        super().__init__()
        self.order_free, self.n = order_free, cfg.num_patches
        width = cfg.embed_dim + (0 if order_free else cfg.num_patches)
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden),
                                 nn.LeakyReLU(0.2), nn.Linear(hidden, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if not self.order_free:
            z = torch.cat([z, torch.eye(self.n).expand(z.shape[0], -1, -1)], dim=-1)  # (B, N, D+N)
        return self.net(z).squeeze(-1)


class JigsawSolver(nn.Module):
    """MSD's jigsaw solver: per-token position logits (Eq. 5) and the most likely
    one-to-one assignment of an image's tokens to positions (Eq. 7)."""

    def __init__(self, cfg: ModelConfig, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(cfg.embed_dim, hidden), nn.GELU(), nn.Linear(hidden, cfg.num_patches))

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, N tokens, N positions)
        return self.net(z)

    @torch.no_grad()
    def reorder(self, z: torch.Tensor) -> torch.Tensor:
        """Tokens put back at their most likely positions: argmax_perm Σ_i log q(perm(i) | z_i)."""
        logp = Fn.log_softmax(self(z), dim=-1)  # (B, N, N)
        out = torch.empty_like(z)
        for b in range(z.shape[0]):
            rows, cols = linear_sum_assignment(-logp[b].numpy())
            out[b, torch.as_tensor(cols)] = z[b, torch.as_tensor(rows)]
        return out


@dataclass
class Attacker:
    encoder: PatchEncoder
    decoder: TokenDecoder
    jigsaw: JigsawSolver | None

    @torch.no_grad()
    def reconstruct(self, uploads: torch.Tensor) -> torch.Tensor:
        """Images from uploaded tokens (M, N, D): jigsaw-reordered first if permuted."""
        z = self.jigsaw.reorder(uploads) if self.jigsaw is not None else uploads
        return self.decoder.eval()(z)


def train_attacker(uploads: torch.Tensor, public: torch.Tensor, cfg: ModelConfig, *, permuted: bool,
                   ac: AttackConfig = AttackConfig()) -> Attacker:
    """Train F̂, G, D on ``public`` images against the observed ``uploads`` (M, N, D);
    with ``permuted`` also the jigsaw solver (module docstring)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ac.seed)
        enc, dec = PatchEncoder(cfg), TokenDecoder(cfg, ac.hidden)
        critic = TokenCritic(cfg, ac.hidden, order_free=permuted)
        opt_g = torch.optim.Adam(list(enc.parameters()) + list(dec.parameters()), lr=ac.lr)
        opt_d = torch.optim.Adam(critic.parameters(), lr=ac.lr, betas=(0.5, 0.999))
        pub = BatchSampler(public.shape[0], min(ac.batch_size, public.shape[0]), seed=ac.seed + 1)
        obs = BatchSampler(uploads.shape[0], min(ac.batch_size, uploads.shape[0]), seed=ac.seed + 2)
        gen = torch.Generator().manual_seed(ac.seed + 3)
        target = _moments(uploads, order_free=permuted)
        for _ in range(ac.steps):
            x, real = public[pub.next()], uploads[obs.next()]
            fake = enc(x)  # (b, N, D)
            if permuted:  # what a permuting client would have sent for x
                fake = permute_tokens(fake, random_permutations(fake.shape[0], fake.shape[1], gen))
            real_logit, fake_logit = critic(real), critic(fake.detach())
            d_loss = (Fn.binary_cross_entropy_with_logits(real_logit, torch.ones_like(real_logit))
                      + Fn.binary_cross_entropy_with_logits(fake_logit, torch.zeros_like(fake_logit)))
            opt_d.zero_grad(set_to_none=True)
            d_loss.backward()
            opt_d.step()
            z = enc(x)
            loss = Fn.mse_loss(dec(z), x)
            adv = critic(permute_tokens(z, random_permutations(z.shape[0], z.shape[1], gen)) if permuted else z)
            loss = loss + ac.adv_weight * Fn.binary_cross_entropy_with_logits(adv, torch.ones_like(adv))
            if ac.match_weight:
                loss = loss + ac.match_weight * _moment_gap(_moments(z, order_free=permuted), target)
            opt_g.zero_grad(set_to_none=True)
            loss.backward()
            opt_g.step()
        jig = _train_jigsaw(enc, public, cfg, ac) if permuted else None
    return Attacker(enc.eval(), dec.eval(), jig)


def _moments(z: torch.Tensor, *, order_free: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance of tokens (B, N, D): per position -> ((N, D), (N, D, D)), or over
    all tokens when ``order_free`` -> ((1, D), (1, D, D)) (all a permuted upload shows)."""
    if order_free:
        z = z.reshape(1, -1, z.shape[-1]).transpose(0, 1)  # (B*N, 1, D)
    mu = z.mean(0)  # (N, D)
    c = z - mu
    return mu, torch.einsum("bnd,bne->nde", c, c) / max(1, z.shape[0] - 1)


def _moment_gap(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Relative squared gap between two (mean, covariance) pairs."""
    return (((a[0] - b[0]) ** 2).sum() / (b[0] ** 2).sum().clamp_min(1e-8)
            + ((a[1] - b[1]) ** 2).sum() / (b[1] ** 2).sum().clamp_min(1e-8))


def _train_jigsaw(enc: PatchEncoder, public: torch.Tensor, cfg: ModelConfig, ac: AttackConfig) -> JigsawSolver:
    """MSD Eq. 6: cross-entropy of each F̂ token's known position, on public images."""
    jig = JigsawSolver(cfg, ac.hidden)
    opt = torch.optim.Adam(jig.parameters(), lr=ac.lr)
    sampler = BatchSampler(public.shape[0], min(ac.batch_size, public.shape[0]), seed=ac.seed + 4)
    target = torch.arange(cfg.num_patches)
    for _ in range(ac.jigsaw_steps):
        with torch.no_grad():
            z = enc(public[sampler.next()])  # (b, N, D), token i sits at position i
        loss = Fn.cross_entropy(jig(z).reshape(-1, cfg.num_patches), target.repeat(z.shape[0]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return jig.eval()


def paper_attack(uploads: torch.Tensor, private: torch.Tensor, public: torch.Tensor, cfg: ModelConfig, *,
                 permuted: bool, ac: AttackConfig = AttackConfig()) -> dict[str, float]:
    """Reconstruct ``private`` images from their ``uploads``; returns mse, ssim and the
    mean-public-image baseline's mse / ssim."""
    rec = train_attacker(uploads, public, cfg, permuted=permuted, ac=ac).reconstruct(uploads)
    base = public.mean(0, keepdim=True).expand_as(private)
    return {"mse": mse(rec, private), "ssim": ssim(rec, private),
            "baseline_mse": mse(base, private), "baseline_ssim": ssim(base, private)}
