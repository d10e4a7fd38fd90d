"""Model parts and tasks shared by FESTA, p-FESTA and masked sampling distillation.

All transformer parts are timm's: a client *head* is a depth-0 timm ``VisionTransformer``
(patch embedding, cls token, position embedding; ``forward_features`` gives
``(B, 1+N, D)``), the p-FESTA *plain embedder* is the same without cls token
(``(B, N, D)``), and the server *body* is the ``blocks`` of a timm ``VisionTransformer``.
A *tail* is timm-style final norm + a task head. Nothing here is re-implemented
transformer code.

The split parts build timm's patch embedding only: a `ModelConfig` with ``stem = "conv"``
(`protocols.vit_stem`) is refused with a ModelConfigError naming the field (`split_config`,
`split_dict` and every part built from a config). A conv stem's BatchNorm statistics would
have to travel with the clients' secret embedder, which nothing here carries.

Task kinds (per-task loss weights live in :class:`TaskSpec`):

- ``classification`` — pooled token -> logits, cross-entropy, metric accuracy;
- ``regression``     — pooled token -> one scalar (e.g. a severity score), MSE, metric MSE;
- ``segmentation``   — every patch token -> one logit (a per-patch mask), BCE, metric
  per-patch accuracy.
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as Fn
from timm.layers import build_sincos2d_pos_embed
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from protocols.seeding import seeded

from protocols.vit_config import ModelConfig, ModelConfigError

TASK_KINDS = ("classification", "regression", "segmentation")


# The split ViT's shape is a `protocols.vit_config.ModelConfig` (the one ViT configuration class;
# its num_classes is unused here: tasks carry their outputs). Its wire form in `service`
# offers, MSD `weights` entries and saved server state is `split_dict`: these fields only.
SPLIT_FIELDS = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio")
# the default split service: tiny, digits-sized. `timm.create_model(SPLIT_MODEL.name, ...)`
# with these fields builds the same blocks as SplitBody (tests/test_split_config.py).
SPLIT_MODEL = ModelConfig(name="vit_tiny_patch16_224", img_size=16, patch_size=4, in_chans=1, embed_dim=32,
                          depth=2, num_heads=2, mlp_ratio=2.0, num_classes=0)


def split_config(body: Mapping | None = None, **overrides: Any) -> ModelConfig:
    """:data:`SPLIT_MODEL` with the :data:`SPLIT_FIELDS` of ``body`` and ``overrides``
    (other keys ignored, as a newer peer may add some); ModelConfigError (a ValueError) if
    the shape is unusable. Integral floats (``8.0``) are taken as integers."""
    _patch_only({**(body or {}), **overrides}.get("stem", "patch"))
    given = {k: v for k, v in {**(body or {}), **overrides}.items() if k in SPLIT_FIELDS}
    for k, v in given.items():
        if k != "mlp_ratio" and isinstance(v, float) and v.is_integer():
            given[k] = int(v)
    return replace(SPLIT_MODEL, **given)  # each field, num_heads | embed_dim, patch | img checked (vit_config)


def split_dict(cfg: ModelConfig) -> dict:
    """The split shape's wire form (the :data:`SPLIT_FIELDS` of ``cfg``)."""
    _patch_only(cfg.stem)
    return {k: getattr(cfg, k) for k in SPLIT_FIELDS}


def _patch_only(stem: Any) -> None:
    if stem != "patch":
        raise ModelConfigError(f"split learning builds timm's patch embedding: stem {stem!r} is not supported "
                               f"(use stem \"patch\")", field="stem")


@dataclass(frozen=True)
class TaskSpec:
    """One task served by the shared body. ``num_outputs``: classes for classification, 1 otherwise."""

    name: str
    kind: str
    num_outputs: int = 1
    loss_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise ValueError(f"task {self.name!r}: kind must be one of {TASK_KINDS}, not {self.kind!r}")
        if self.num_outputs < 1 or (self.kind != "classification" and self.num_outputs != 1):
            raise ValueError(f"task {self.name!r}: bad num_outputs {self.num_outputs} for {self.kind}")
        if not (self.loss_weight >= 0 and math.isfinite(self.loss_weight)):
            raise ValueError(f"task {self.name!r}: loss_weight must be finite and >= 0")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> TaskSpec:
        return cls(name=str(d["name"]), kind=str(d["kind"]), num_outputs=int(d.get("num_outputs", 1)),
                   loss_weight=float(d.get("loss_weight", 1.0)))


def _vit(cfg: ModelConfig, depth: int, **kw) -> VisionTransformer:
    _patch_only(cfg.stem)
    return VisionTransformer(img_size=cfg.img_size, patch_size=cfg.patch_size, in_chans=cfg.in_chans,
                             embed_dim=cfg.embed_dim, depth=depth, num_heads=cfg.num_heads,
                             mlp_ratio=cfg.mlp_ratio, num_classes=0, **kw)


class TimmStem(nn.Module):
    """A depth-0 timm ViT used for its ``forward_features`` (patch embed + tokens + pos embed)."""

    def __init__(self, vit: VisionTransformer) -> None:
        super().__init__()
        self.vit = vit

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, T, D)
        return self.vit.forward_features(x)


# std of the secret random position table. Measured on digits (tests/test_msd.py, two
# embedder seeds): at 0.1 MSD beats scratch fine-tuning by 0.04-0.07; at the sin-cos
# table's RMS (0.71) or 0.3 the margin shrinks to 0.01-0.03 (position swamps content).
# Privacy (bench/inversion_bench.py; 16 px digits, width 32, content norm 2.8):
# at 0.1 (table norm 0.54) the strongest attacker on permuted uploads (MSD Eq. 7's
# transformer jigsaw) reaches MSE 1.74x the mean-image baseline's, at 0.5 (norm 2.7, equal
# to content) 1.33x -- a larger table helps the attacker re-order, it does not hide more.
# Both above the baseline; 0.1 is kept for the wider privacy margin and MSD's accuracy.
SECRET_POS_STD = 0.1
# std of the secret projection bias: nonzero so that a blank patch does not upload pos_j
# itself. Small: at 0.1 p-FESTA digit accuracy fell from 0.65 to 0.43 (tests/test_pfesta.py).
SECRET_BIAS_STD = 0.02


def _content_friendly_init(stem: TimmStem, cfg: ModelConfig, content_gain: float, *,
                           gen: torch.Generator | None = None) -> None:
    """Position embedding and an orthogonal patch projection scaled by ``content_gain``.
    timm's default init (a 0.02-std position embedding, default conv init) is made for long
    training and leaves patch content ~30x weaker than position at this scale; a frozen
    embedder could never fix that, a trainable head fixes it slowly.

    Position embedding: with ``gen`` None the public 2-D sin-cos table (FESTA's trainable
    head); with a generator a random Gaussian table (std :data:`SECRET_POS_STD`), the
    p-FESTA / MSD secret (p-FESTA §III-B: the server must not know it); the projection's
    bias is then random too (:data:`SECRET_BIAS_STD`; else a blank patch uploads ``pos_j``)."""
    side = cfg.img_size // cfg.patch_size
    proj = stem.vit.patch_embed.proj  # Conv2d(C, D, p, p)
    if gen is None:
        pos = build_sincos2d_pos_embed([side, side], dim=cfg.embed_dim).unsqueeze(0)  # (1, N, D)
    else:
        pos = torch.randn(1, side * side, cfg.embed_dim, generator=gen) * SECRET_POS_STD  # (1, N, D)
    with torch.no_grad():
        stem.vit.pos_embed[:, -pos.shape[1]:].copy_(pos)  # FESTA's cls slot (first) keeps timm's init
        w = torch.empty(proj.out_channels, proj.in_channels * cfg.patch_size ** 2)
        nn.init.orthogonal_(w, gain=content_gain, generator=gen)
        proj.weight.copy_(w.reshape_as(proj.weight))
        if gen is None:
            proj.bias.zero_()
        else:  # random like the rest of the secret: a blank patch's token is bias + pos, not pos itself
            proj.bias.copy_(torch.randn(proj.out_channels, generator=gen) * SECRET_BIAS_STD)


def build_head(cfg: ModelConfig, seed: int | None = None, *, class_token: bool = False,
               content_gain: float = 2.0) -> TimmStem:
    """FESTA client head, trainable: patch embedding + position embedding (+ cls token if
    ``class_token``) -> (B, N, D) or (B, 1+N, D); initialised like the plain embedder (see
    :func:`_content_friendly_init`) but with the public sin-cos position table."""
    with seeded(seed):
        kw = {} if class_token else {"class_token": False, "no_embed_class": True, "global_pool": "avg"}
        stem = TimmStem(_vit(cfg, 0, final_norm=False, **kw))
        _content_friendly_init(stem, cfg, content_gain)
    return stem


EMBEDDER_KEYS = ("vit.pos_embed", "vit.patch_embed.proj.weight", "vit.patch_embed.proj.bias")


def embedder_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of a plain embedder's state (what a campaign's secret holds)."""
    p, d = cfg.patch_size, cfg.embed_dim
    return {"vit.pos_embed": (1, cfg.num_patches, d), "vit.patch_embed.proj.weight": (d, cfg.in_chans, p, p),
            "vit.patch_embed.proj.bias": (d,)}


def embedder_state_bytes(cfg: ModelConfig) -> int:
    """Bytes of a plain embedder's float32 state (the paper's Ph), computed from shapes only."""
    return sum(4 * math.prod(s) for s in embedder_shapes(cfg).values())


def build_plain_embedder(cfg: ModelConfig, seed: int | None = 0, content_gain: float = 2.0, *,
                         state: Mapping[str, torch.Tensor] | None = None) -> TimmStem:
    """p-FESTA's shared plain patch embedder (patch embed + pos embed, no cls) -> (B, N, D).

    Frozen: ``requires_grad`` is off and it is in eval mode. The patch projection is a
    random orthogonal map scaled by ``content_gain`` (information-preserving when
    D >= C*p*p) and the position embedding a random table of similar scale — random, as in
    the papers (p-FESTA §III-B, MSD §III), not the public sin-cos table, because both are
    the clients' secret. Source of randomness: ``state`` (a campaign's secret, see
    :func:`new_embedder_state`; keys :data:`EMBEDDER_KEYS`) if given, else ``seed`` (for
    in-process experiments only: a seed known to the server is no secret), else the OS."""
    if state is not None:
        _check_embedder_state(cfg, state)
    with seeded(0):
        stem = TimmStem(_vit(cfg, 0, final_norm=False, class_token=False, no_embed_class=True,
                             global_pool="avg"))
    if state is not None:
        with torch.no_grad():
            for k, v in state.items():
                stem.get_parameter(k).copy_(v)
    else:
        gen = torch.Generator()
        if seed is None:
            gen.manual_seed(secrets.randbits(63))
        else:
            gen.manual_seed(seed)
        _content_friendly_init(stem, cfg, content_gain, gen=gen)
    stem.requires_grad_(False)
    return stem.eval()


def new_embedder_state(cfg: ModelConfig, content_gain: float = 2.0, *, seed: int | None = None
                       ) -> dict[str, torch.Tensor]:
    """A fresh secret embedder (projection + position table) from OS randomness: the tensors
    one p-FESTA / MSD client generates and seals to the other clients. No seed survives.
    ``seed``: simulation only (netsim's reproducible runs); a seed is no secret."""
    stem = build_plain_embedder(cfg, seed=seed, content_gain=content_gain)
    return embedder_state(stem)


def embedder_state(stem: TimmStem) -> dict[str, torch.Tensor]:
    """The :data:`EMBEDDER_KEYS` tensors of a plain embedder (contiguous float32 copies)."""
    sd = stem.state_dict()
    return {k: sd[k].detach().clone().contiguous().float() for k in EMBEDDER_KEYS}


def _check_embedder_state(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> None:
    want = embedder_shapes(cfg)
    if set(state) != set(want):
        raise ValueError(f"embedder state keys {sorted(state)} differ from {sorted(want)}")
    for k, shape in want.items():
        v = state[k]
        if v.dtype != torch.float32 or tuple(v.shape) != shape or not bool(torch.isfinite(v).all()):
            raise ValueError(f"embedder state {k}: {v.dtype} {tuple(v.shape)}, expected finite float32 {shape}")


class SplitBody(nn.Module):
    """The server's transformer body: the ``blocks`` of a timm ViT, (B, T, D) -> (B, T, D).
    No position embedding and no token-order dependence inside: permutation-equivariant."""

    def __init__(self, cfg: ModelConfig, seed: int | None = None) -> None:
        super().__init__()
        with seeded(seed):
            self.blocks = _vit(cfg, cfg.depth).blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class TaskTail(nn.Module):
    """Final norm + task head. ``pool``: "token" (token 0 is cls, FESTA) or "avg" (mean of
    the normalised patch tokens, p-FESTA: order-free). Segmentation uses every patch token."""

    def __init__(self, cfg: ModelConfig, task: TaskSpec, pool: str, seed: int | None = None) -> None:
        super().__init__()
        if pool not in ("token", "avg"):
            raise ValueError(f"pool must be 'token' or 'avg', not {pool!r}")
        self.task, self.pool = task, pool
        with seeded(seed):
            self.norm = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
            # MAE-style probe norm: standardise pooled features across the batch so a linear
            # head is well conditioned even while the body still returns near-identical means
            self.bn = (nn.BatchNorm1d(cfg.embed_dim, affine=False)
                       if pool == "avg" and task.kind != "segmentation" else nn.Identity())
            self.head = nn.Linear(cfg.embed_dim, task.num_outputs)
            nn.init.trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.task.kind == "segmentation":
            patches = tokens[:, 1:] if self.pool == "token" else tokens  # (B, N, D)
            return self.head(self.norm(patches)).squeeze(-1)  # (B, N)
        out = self.head(self.bn(self.pooled(tokens)))  # (B, K)
        return out.squeeze(-1) if self.task.kind == "regression" else out

    def pooled(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, D): normalise every token, then pool (the per-token norm is the
        only non-linearity between a near-identity fresh body and the mean, and keeps
        spatial information)."""
        x = self.norm(tokens)  # (B, T, D)
        return x[:, 0] if self.pool == "token" else x.mean(1)

    @torch.no_grad()
    def calibrate(self, pooled: torch.Tensor) -> None:
        """Set the probe BatchNorm's running statistics to those of ``pooled`` (M, D) ("precise
        BN"). Its momentum averages lag behind a body that moves every step; with the
        pooled features' small spread this lag alone made evaluation predict one class."""
        if isinstance(self.bn, nn.BatchNorm1d) and pooled.shape[0] > 1:
            self.bn.running_mean.copy_(pooled.mean(0))
            self.bn.running_var.copy_(pooled.var(0))


def task_loss(task: TaskSpec, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Unweighted loss of one task (the body applies ``task.loss_weight``)."""
    if task.kind == "classification":
        return Fn.cross_entropy(out, target.long())
    if task.kind == "regression":
        return Fn.mse_loss(out, target.float())
    return Fn.binary_cross_entropy_with_logits(out, target.float())


def task_metric(task: TaskSpec, out: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """accuracy (classification), mse (regression), patch_accuracy (segmentation) with
    patch_majority, the accuracy of predicting the majority patch value (its baseline)."""
    if task.kind == "classification":
        return {"accuracy": float((out.argmax(-1) == target).float().mean())}
    if task.kind == "regression":
        return {"mse": float(Fn.mse_loss(out, target.float()))}
    pos = float(target.float().mean())
    return {"patch_accuracy": float(((out > 0).float() == target.float()).float().mean()),
            "patch_majority": max(pos, 1.0 - pos)}


def fedavg(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """Weighted average of structurally identical state dicts (weights need not sum to 1)."""
    if not states or len(states) != len(weights):
        raise ValueError("fedavg needs as many weights as states, and at least one")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("fedavg weights must sum to a positive number")
    keys = list(states[0])
    for s in states[1:]:
        if list(s) != keys:
            raise ValueError("fedavg: state dicts have different keys")
    return {k: sum(s[k].float() * (w / total) for s, w in zip(states, weights)).to(states[0][k].dtype)
            for k in keys}


# A client's parts in what it shares at a unification (``state_up`` / ``state_down``): its
# head's tensors under HEAD_PART (FESTA), its task tail's under TAIL_PART (FESTA, p-FESTA).
# The split head is the client's front (embedding), not the ViT classifier.
HEAD_PART, TAIL_PART = "head.", "tail."


def with_prefix(prefix: str, state: Mapping[str, torch.Tensor], *, copy: bool = False) -> dict[str, torch.Tensor]:
    """``state``'s tensors under ``prefix`` (detached CPU copies with ``copy``: for the wire)."""
    return {f"{prefix}{k}": (v.detach().cpu().clone() if copy else v) for k, v in state.items()}


def under_prefix(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors named ``prefix...``, with the prefix taken off (a part's state dict)."""
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def part_template(cfg: ModelConfig, task: TaskSpec, *, with_head: bool, pool: str) -> dict[str, torch.Tensor]:
    """Keys and shapes of what a client of ``task`` shares at a unification (HEAD_PART /
    TAIL_PART). A head has a cls token exactly when the tail pools by token."""
    out = with_prefix(TAIL_PART, TaskTail(cfg, task, pool).state_dict())
    if with_head:
        out.update(with_prefix(HEAD_PART, build_head(cfg, class_token=pool == "token").state_dict()))
    return out


# --- demo data: sklearn digits, three task kinds over the same images -------------------

def digits_images(img_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's 1797 8x8 digits upscaled (bilinear) to ``img_size``, in [0, 1]; (N,1,H,W), (N,)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    if img_size != 8:
        x = Fn.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False)
    return x.clamp(0, 1), torch.tensor(d.target, dtype=torch.long)


def digits_targets(task: TaskSpec, images: torch.Tensor, labels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Targets for a digits task: the label (classification), the standardised amount of
    ink as a "severity" (regression), or a per-patch ink mask (segmentation, (N, P))."""
    if task.kind == "classification":
        return labels
    if task.kind == "regression":
        ink = images.mean(dim=(1, 2, 3))
        return (ink - ink.mean()) / ink.std()
    patches = Fn.avg_pool2d(images.mean(1, keepdim=True), patch_size)  # (N, 1, h, w)
    return (patches.flatten(1) > 0.2).float()  # (N, h*w), row-major = timm patch order


class BatchSampler:
    """Endless full batches of indices into ``n`` samples: reshuffled each epoch by its own generator."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        if not 1 <= batch_size <= n:
            raise ValueError(f"batch_size {batch_size} must be in 1..{n} (the number of samples)")
        self.n, self.batch_size = n, batch_size
        self._gen = torch.Generator().manual_seed(seed)
        self._order = torch.randperm(n, generator=self._gen)
        self._pos = 0

    def next(self) -> torch.Tensor:
        if self._pos + self.batch_size > self.n:
            self._order, self._pos = torch.randperm(self.n, generator=self._gen), 0
        idx = self._order[self._pos:self._pos + self.batch_size]
        self._pos += self.batch_size
        return idx
