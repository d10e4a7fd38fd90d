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

(the GAN part is MSD §III-D Eq. 5, G's reconstruction loss Eq. 6). Then three ways to
read the uploads, each reported (:func:`attack_all`); the privacy claim is checked against
the strongest (lowest MSE):

``eq7_jigsaw``     MSD Eq. 7 as written: a small transformer J maps permuted features to
                   ordered ones -- an order-free transformer encoder over the token set, then
                   one learned query per position reading its token out (a transformer
                   decoder) -- trained on public images with a feature-space similarity loss
                   ``L_jigsaw(J(permute(F̂(x))), F̂(x))`` (MSE + 1 - cosine per token); G
                   decodes ``J(upload)``.
``per_token``      an order-free per-token decoder: each token alone -> its patch's pixels
                   and a position distribution (trained on F̂'s tokens of public images);
                   patches are placed by the per-image assignment that maximises the summed
                   position log-probability (Hungarian algorithm). Decoding content needs
                   no order at all; only the placement does.
``position_mlp``   the earlier attacker: a per-token MLP position classifier + Hungarian
                   assignment, then G on the reordered tokens (not the paper's J).

In order (the positive control) J and the assignments are skipped: tokens sit at their
positions. D judges single tokens — with their position when the uploads are in order,
without it when they are permuted (there is no order to match).

Deviations (small models, seconds of CPU): MLP decoders / critic instead of the papers'
convolutional ones (MSD: a DCGAN generator and discriminator, a 12-layer transformer J; here
J has 2 encoder + 1 decoder layers of width 64); non-saturating GAN loss; a fixed step budget; and, for stability with
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

from protocols.seeding import seeded
from protocols.vit_config import ModelConfig
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
    jigsaw_width: int = 64  # Eq. 7's transformer J
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


def assign_positions(logp: torch.Tensor) -> torch.Tensor:
    """Per image, the one-to-one token -> position map maximising the summed log-probability:
    ``logp`` (B, N tokens, N positions) -> (B, N) position of each token (Hungarian)."""
    out = torch.empty(logp.shape[:2], dtype=torch.long)
    for b in range(logp.shape[0]):
        rows, cols = linear_sum_assignment(-logp[b].numpy())
        out[b, torch.as_tensor(rows)] = torch.as_tensor(cols)
    return out


class TransformerJigsaw(nn.Module):
    """MSD Eq. 7's J: permuted features (B, N, D) -> ordered features (B, N, D).

    An encoder with no position information (so it sees a set of tokens), then N learned
    position queries attend to that set (one decoder layer) and each reads out the feature
    of its position."""

    def __init__(self, cfg: ModelConfig, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(cfg.embed_dim, width), nn.Linear(width, cfg.embed_dim)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0,
                                                                    batch_first=True), layers)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(width, heads, 2 * width, dropout=0.0,
                                                                    batch_first=True), 1)
        self.queries = nn.Parameter(torch.randn(1, cfg.num_patches, width) * 0.5)

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (B, N, D) permuted -> (B, N, D) ordered
        memory = self.enc(self.inp(z))
        return self.out(self.dec(self.queries.expand(z.shape[0], -1, -1), memory))


class PerTokenDecoder(nn.Module):
    """Order-free per-token decoder: one token (D) -> its patch (C*p*p pixels in [0, 1]) and
    position logits (N). Applied to every token independently."""

    def __init__(self, cfg: ModelConfig, hidden: int) -> None:
        super().__init__()
        self.cfg, self.pix = cfg, cfg.in_chans * cfg.patch_size ** 2
        self.net = nn.Sequential(nn.Linear(cfg.embed_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, self.pix + cfg.num_patches))

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # -> (B, N, pix), (B, N, N)
        h = self.net(z)
        return torch.sigmoid(h[..., :self.pix]), h[..., self.pix:]

    @torch.no_grad()
    def reconstruct(self, z: torch.Tensor, *, ordered: bool) -> torch.Tensor:
        """Images (B, C, H, W): patches at their known positions (``ordered``) or at the most
        likely assignment of positions."""
        patches, logits = self(z)
        pos = (torch.arange(z.shape[1]).expand(z.shape[0], -1) if ordered
               else assign_positions(Fn.log_softmax(logits, dim=-1)))
        placed = torch.empty_like(patches)
        placed.scatter_(1, pos.unsqueeze(-1).expand_as(patches), patches)
        return patches_to_images(placed, self.cfg)


def image_patches(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C*p*p) in the embedder's (row-major) patch order."""
    return Fn.unfold(x, cfg.patch_size, stride=cfg.patch_size).transpose(1, 2)


def patches_to_images(p: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Inverse of :func:`image_patches`."""
    return Fn.fold(p.transpose(1, 2), (cfg.img_size, cfg.img_size), cfg.patch_size, stride=cfg.patch_size)


class JigsawSolver(nn.Module):
    """The ``position_mlp`` attacker's solver: per-token position logits and the most
    likely one-to-one assignment of an image's tokens to positions (not MSD's J)."""

    def __init__(self, cfg: ModelConfig, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(cfg.embed_dim, hidden), nn.GELU(), nn.Linear(hidden, cfg.num_patches))

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, N tokens, N positions)
        return self.net(z)

    @torch.no_grad()
    def reorder(self, z: torch.Tensor) -> torch.Tensor:
        """Tokens put back at their most likely positions: argmax_perm Σ_i log q(perm(i) | z_i)."""
        pos = assign_positions(Fn.log_softmax(self(z), dim=-1))  # (B, N)
        out = torch.empty_like(z)
        out.scatter_(1, pos.unsqueeze(-1).expand_as(z), z)
        return out


ATTACKERS = ("eq7_jigsaw", "per_token", "position_mlp")


@dataclass
class Attacker:
    """What the attacker trained: F̂ and G (Eq. 5-6) and the readers of permuted uploads."""

    encoder: PatchEncoder
    decoder: TokenDecoder
    jigsaw: JigsawSolver | None = None  # position_mlp
    transformer_jigsaw: TransformerJigsaw | None = None  # eq7_jigsaw
    per_token: PerTokenDecoder | None = None

    @torch.no_grad()
    def reconstruct(self, uploads: torch.Tensor, attacker: str = "position_mlp") -> torch.Tensor:
        """Images from uploaded tokens (M, N, D) by one of :data:`ATTACKERS`; in order (no
        solver trained for permuted uploads) the tokens are taken at their positions."""
        ordered = self.jigsaw is None
        if attacker == "per_token":
            return self.per_token.eval().reconstruct(uploads, ordered=ordered)
        if attacker == "eq7_jigsaw" and not ordered:
            return self.decoder.eval()(self.transformer_jigsaw.eval()(uploads))
        if attacker not in ATTACKERS:
            raise ValueError(f"unknown attacker {attacker!r}; choose from {', '.join(ATTACKERS)}")
        z = uploads if ordered else self.jigsaw.reorder(uploads)
        return self.decoder.eval()(z)


def train_attacker(uploads: torch.Tensor, public: torch.Tensor, cfg: ModelConfig, *, permuted: bool,
                   ac: AttackConfig = AttackConfig()) -> Attacker:
    """Train F̂, G, D on ``public`` images against the observed ``uploads`` (M, N, D), then
    the per-token decoder on F̂'s tokens; with ``permuted`` also Eq. 7's J and the position
    MLP (module docstring)."""
    with seeded(ac.seed):
        enc, dec = _train_encoder(uploads, public, cfg, permuted=permuted, ac=ac)
        per_token = _train_per_token(enc, public, cfg, ac)
        jig = _train_jigsaw(enc, public, cfg, ac) if permuted else None
        tj = _train_transformer_jigsaw(enc, public, cfg, ac) if permuted else None
    return Attacker(enc.eval(), dec.eval(), jig, tj, per_token)


def _train_encoder(uploads: torch.Tensor, public: torch.Tensor, cfg: ModelConfig, *, permuted: bool,
                   ac: AttackConfig) -> tuple[PatchEncoder, TokenDecoder]:
    """MSD Eq. 5-6: F̂ fools the critic D (plus feature matching), G decodes F̂'s tokens."""
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
    return enc, dec


def _fit(module: nn.Module, public: torch.Tensor, ac: AttackConfig, salt: int, loss_of) -> None:
    """``ac.jigsaw_steps`` Adam steps of ``loss_of(images)`` over public batches."""
    opt = torch.optim.Adam(module.parameters(), lr=ac.lr)
    sampler = BatchSampler(public.shape[0], min(ac.batch_size, public.shape[0]), seed=ac.seed + salt)
    for _ in range(ac.jigsaw_steps):
        loss = loss_of(public[sampler.next()])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    module.eval()


def _train_per_token(enc: PatchEncoder, public: torch.Tensor, cfg: ModelConfig, ac: AttackConfig) -> PerTokenDecoder:
    """Each F̂ token of a public image -> its patch (MSE) and its position (cross-entropy)."""
    net = PerTokenDecoder(cfg, ac.hidden)
    target = torch.arange(cfg.num_patches)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z = enc(x)  # (b, N, D), token i at position i
        patches, logits = net(z)
        return (Fn.mse_loss(patches, image_patches(x, cfg))
                + Fn.cross_entropy(logits.reshape(-1, cfg.num_patches), target.repeat(z.shape[0])))
    _fit(net, public, ac, 5, loss_of)
    return net


def _train_transformer_jigsaw(enc: PatchEncoder, public: torch.Tensor, cfg: ModelConfig,
                              ac: AttackConfig) -> TransformerJigsaw:
    """MSD Eq. 7: min_J L_jigsaw(J(permute(F̂(x_pub))), F̂(x_pub)), L = MSE + (1 - cosine) per token."""
    j = TransformerJigsaw(cfg, width=ac.jigsaw_width)
    gen = torch.Generator().manual_seed(ac.seed + 6)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z = enc(x)
            shuffled = permute_tokens(z, random_permutations(z.shape[0], z.shape[1], gen))
        out = j(shuffled)
        return Fn.mse_loss(out, z) / z.pow(2).mean() + (1 - Fn.cosine_similarity(out, z, dim=-1)).mean()
    _fit(j, public, ac, 6, loss_of)
    return j


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
    """The position MLP: cross-entropy of each F̂ token's known position, on public images."""
    jig = JigsawSolver(cfg, ac.hidden)
    target = torch.arange(cfg.num_patches)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z = enc(x)  # (b, N, D), token i sits at position i
        return Fn.cross_entropy(jig(z).reshape(-1, cfg.num_patches), target.repeat(z.shape[0]))
    _fit(jig, public, ac, 4, loss_of)
    return jig


def attack_all(uploads: torch.Tensor, private: torch.Tensor, public: torch.Tensor, cfg: ModelConfig, *,
               permuted: bool, ac: AttackConfig = AttackConfig()) -> dict[str, dict[str, float]]:
    """Every attacker of :data:`ATTACKERS` (one training of F̂ / G shared): per attacker the
    mse / ssim of its reconstruction of ``private`` from ``uploads``, and ``baseline``: the
    mean public image's."""
    att = train_attacker(uploads, public, cfg, permuted=permuted, ac=ac)
    out = {}
    for name in ATTACKERS:
        rec = att.reconstruct(uploads, name)
        out[name] = {"mse": mse(rec, private), "ssim": ssim(rec, private)}
    base = public.mean(0, keepdim=True).expand_as(private)
    out["baseline"] = {"mse": mse(base, private), "ssim": ssim(base, private)}
    return out


def paper_attack(uploads: torch.Tensor, private: torch.Tensor, public: torch.Tensor, cfg: ModelConfig, *,
                 permuted: bool, ac: AttackConfig = AttackConfig()) -> dict:
    """The strongest attacker's (lowest MSE) mse and ssim on ``private`` from ``uploads``, the
    mean-public-image baseline's, ``attacker`` (its name) and ``attackers`` (every one's)."""
    res = attack_all(uploads, private, public, cfg, permuted=permuted, ac=ac)
    best = min(ATTACKERS, key=lambda n: res[n]["mse"])
    return {"mse": res[best]["mse"], "ssim": res[best]["ssim"], "attacker": best,
            "baseline_mse": res["baseline"]["mse"], "baseline_ssim": res["baseline"]["ssim"], "attackers": res}
