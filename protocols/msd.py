"""Masked sampling distillation (MSD): self-supervised pre-training of the transformer body on
the server, over the permuted patch embeddings clients uploaded once (as in p-FESTA).

DINO-style, without labels:

- student and teacher are the same architecture — the timm body, a final LayerNorm, a
  mean over tokens (order-free, so the permutation does not matter) and a projection
  head to ``out_dim`` prototypes; the teacher is an EMA of the student with a cosine
  momentum schedule ``momentum_start -> 1``;
- *views* are random token subsets of one image: ``teacher_views`` large ones
  (``teacher_keep`` of the patches) seen by both networks, plus ``student_views`` small
  ones (``student_keep``) seen by the student only;
- loss: cross-entropy between the teacher's centred, sharpened softmax
  (``teacher_temp`` < ``student_temp``) and the student's softmax, over every
  (teacher view, other student view) pair; the centre is an EMA of teacher outputs.

Communication is one round: each client uploads its permuted embeddings once
(``D * F``) and downloads the body weights (``Pb``); clients then fine-tune body + tail
locally (:func:`fine_tune`).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as Fn
from torch import nn

from protocols.seeding import seeded
from protocols.vit_config import ModelConfig
from protocols.comm_cost import InProcessChannel, tensor_bytes
from protocols.split_parts import BatchSampler, SplitBody, TaskSpec, TaskTail, TimmStem, task_loss, task_metric


@dataclass(frozen=True)
class MSDConfig:
    """Hyper-parameters of masked sampling distillation. The defaults were chosen on digits
    with a 2-block, 32-wide body (about 20 epochs over 1200 images); ``head_bn`` puts
    BatchNorm in the projection MLP (DINO's ``use_bn`` option), without which this tiny
    setting collapsed to the uniform output in every run we tried."""

    steps: int = 200
    batch_size: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.04
    out_dim: int = 64
    hidden_dim: int = 128
    bottleneck_dim: int = 32
    teacher_keep: float = 0.875
    student_keep: float = 0.5
    teacher_views: int = 2
    student_views: int = 2
    teacher_temp: float = 0.04
    student_temp: float = 0.1
    center_momentum: float = 0.9
    momentum_start: float = 0.95
    seed: int = 0
    head_bn: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.student_keep <= self.teacher_keep <= 1:
            raise ValueError("need 0 < student_keep <= teacher_keep <= 1")
        if not 0 < self.teacher_temp < self.student_temp:
            raise ValueError("sharpening needs 0 < teacher_temp < student_temp")
        if self.teacher_views < 1 or self.student_views < 0 or self.teacher_views + self.student_views < 2:
            raise ValueError("need at least one teacher view and two views in all")
        if not 0 <= self.momentum_start <= 1 or not 0 <= self.center_momentum < 1:
            raise ValueError("momenta must lie in [0, 1]")


class ProjectionHead(nn.Module):
    """DINO's projection head: MLP -> bottleneck -> L2 normalise -> weight-normalised prototypes."""

    def __init__(self, dim: int, cfg: MSDConfig) -> None:
        super().__init__()
        bn = (lambda: nn.BatchNorm1d(cfg.hidden_dim)) if cfg.head_bn else nn.Identity
        self.mlp = nn.Sequential(nn.Linear(dim, cfg.hidden_dim), bn(), nn.GELU(),
                                 nn.Linear(cfg.hidden_dim, cfg.hidden_dim), bn(), nn.GELU(),
                                 nn.Linear(cfg.hidden_dim, cfg.bottleneck_dim))
        self.last = nn.utils.parametrizations.weight_norm(nn.Linear(cfg.bottleneck_dim, cfg.out_dim, bias=False))
        self.last.parametrizations.weight.original0.data.fill_(1.0)
        self.last.parametrizations.weight.original0.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(Fn.normalize(self.mlp(x), dim=-1))


class MSDNet(nn.Module):
    """body -> mean over the kept tokens -> LayerNorm -> projection head."""

    def __init__(self, mcfg: ModelConfig, cfg: MSDConfig, seed: int) -> None:
        super().__init__()
        self.body = SplitBody(mcfg, seed=seed)
        self.norm = nn.LayerNorm(mcfg.embed_dim, eps=1e-6)
        with seeded(seed + 7):  # deterministic from the seed, not the caller's RNG
            self.head = ProjectionHead(mcfg.embed_dim, cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, K, D) -> (B, out_dim)
        return self.head(self.norm(self.body(tokens)).mean(1))


def sample_view(tokens: torch.Tensor, keep: float, gen: torch.Generator) -> torch.Tensor:
    """A random subset of ``ceil(keep * N)`` tokens per image: (B, N, D) -> (B, K, D)."""
    b, n, _ = tokens.shape
    k = max(1, math.ceil(keep * n))
    idx = torch.argsort(torch.rand(b, n, generator=gen), dim=1)[:, :k].to(tokens.device)  # drawn on the CPU
    return tokens.gather(1, idx.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))


def cosine_momentum(step: int, total: int, start: float) -> float:
    """DINO's teacher momentum: ``start`` at step 0 rising along a cosine to 1 at ``total``."""
    return 1 - (1 - start) * (math.cos(math.pi * step / max(1, total)) + 1) / 2


@dataclass
class MSDResult:
    """The pre-trained body (SplitBody state dict: what is published) and the loss curve."""

    body_state: dict[str, torch.Tensor]
    losses: list[float] = field(default_factory=list)
    config: dict = field(default_factory=dict)


class MSDTrainer:
    """Server-side MSD over stored (permuted) embeddings; no labels involved."""

    def __init__(self, mcfg: ModelConfig, cfg: MSDConfig = MSDConfig(), *, device: torch.device | str = "cpu") -> None:
        """``device`` runs the distillation (initialisation and sampling are drawn on the CPU,
        so they do not depend on it); the published body comes back on the CPU."""
        self.mcfg, self.cfg, self.device = mcfg, cfg, torch.device(device)
        self.student = MSDNet(mcfg, cfg, seed=cfg.seed).to(self.device)
        self.teacher = copy.deepcopy(self.student)
        self.teacher.requires_grad_(False)
        self.center = torch.zeros(cfg.out_dim, device=self.device)
        self.opt = torch.optim.AdamW([p for p in self.student.parameters() if p.requires_grad],
                                     lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.gen = torch.Generator().manual_seed(cfg.seed + 1)

    def _loss(self, t_out: Sequence[torch.Tensor], s_out: Sequence[torch.Tensor]) -> torch.Tensor:
        c = self.cfg
        targets = [Fn.softmax((t - self.center) / c.teacher_temp, dim=-1) for t in t_out]
        logps = [Fn.log_softmax(s / c.student_temp, dim=-1) for s in s_out]
        terms = [-(tq * lp).sum(-1).mean() for i, tq in enumerate(targets) for j, lp in enumerate(logps) if i != j]
        return torch.stack(terms).mean()

    def train(self, features: torch.Tensor) -> MSDResult:
        """Distil on ``features`` (M, N, D) for ``cfg.steps`` steps; returns the student's body."""
        c = self.cfg
        if features.dim() != 3 or features.shape[0] < 2 or features.shape[2] != self.mcfg.embed_dim:
            raise ValueError(f"features must be (M>=2, N, {self.mcfg.embed_dim}), got {tuple(features.shape)}")
        sampler = BatchSampler(features.shape[0], min(c.batch_size, features.shape[0]), seed=c.seed + 2)
        lr_sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=c.steps)
        losses = []
        self.student.train()
        for step in range(c.steps):
            x = features[sampler.next()].to(self.device)  # (b, N, D)
            big = [sample_view(x, c.teacher_keep, self.gen) for _ in range(c.teacher_views)]
            small = [sample_view(x, c.student_keep, self.gen) for _ in range(c.student_views)]
            with torch.no_grad():
                t_out = [self.teacher(v) for v in big]
            s_out = [self.student(v) for v in big + small]
            loss = self._loss(t_out, s_out)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.student.parameters(), 3.0)
            self.opt.step()
            lr_sched.step()
            with torch.no_grad():
                m = cosine_momentum(step, c.steps, c.momentum_start)
                for pt, ps in zip(self.teacher.parameters(), self.student.parameters()):
                    pt.mul_(m).add_(ps.detach(), alpha=1 - m)
                batch_center = torch.cat(t_out).mean(0)
                self.center.mul_(c.center_momentum).add_(batch_center, alpha=1 - c.center_momentum)
            losses.append(loss.detach())  # read once at the end: no host sync per step
        # DINO publishes the teacher: the EMA is the smoother, better representation
        body = {k: v.detach().cpu().clone() for k, v in self.teacher.body.state_dict().items()}
        return MSDResult(body_state=body, losses=torch.stack(losses).tolist() if losses else [], config=asdict(c))


def run_msd_inprocess(mcfg: ModelConfig, uploads: Mapping[str, torch.Tensor], cfg: MSDConfig = MSDConfig(),
                      *, channel: InProcessChannel | None = None, chunk: int = 256) -> tuple[MSDResult, InProcessChannel]:
    """One round of MSD communication through ``channel``: every client's permuted embeddings
    up (``upload``) in chunks, server distils, body weights down (``weights``) to each client."""
    ch = channel or InProcessChannel()
    stored = []
    for cid, feats in sorted(uploads.items()):
        for start in range(0, feats.shape[0], chunk):
            stored.append(ch.send(cid, "up", "upload", {"x": feats[start:start + chunk]}, {"start": start}).tensors["x"])
    result = MSDTrainer(mcfg, cfg).train(torch.cat(stored))
    for cid in sorted(uploads):
        got = ch.send(cid, "down", "weights", result.body_state, {"bytes": tensor_bytes(result.body_state)})
        assert got.tensors.keys() == result.body_state.keys()
    return result, ch


def fine_tune(embedder: TimmStem, mcfg: ModelConfig, task: TaskSpec, images: torch.Tensor,
              targets: torch.Tensor, *, body_state: Mapping[str, torch.Tensor] | None = None,
              steps: int = 200, batch_size: int = 32, lr: float = 1e-3, body_lr_scale: float = 1.0,
              seed: int = 0, device: torch.device | str = "cpu",
              after_step: Callable[[int, SplitBody, TaskTail], None] | None = None) -> tuple[SplitBody, TaskTail]:
    """A client's local training of body + tail on its labelled data, from the MSD body
    (``body_state``) or from scratch (None) — same seed, steps and learning rate either way.
    The steps run on ``device``; body and tail come back on the CPU. ``after_step(k, body,
    tail)``, if given, runs after step k (1-based; e.g. to evaluate along the curve: the first
    k steps do not depend on ``steps``, so one run gives what k separate runs would); the two
    are back in training mode after it."""
    dev = torch.device(device)
    body = SplitBody(mcfg, seed=seed)
    if body_state is not None:
        body.load_state_dict(dict(body_state), strict=True)
    tail = TaskTail(mcfg, task, pool="avg", seed=seed + 1)
    body.to(dev)
    tail.to(dev)
    opt = torch.optim.AdamW([{"params": body.parameters(), "lr": lr * body_lr_scale},
                             {"params": tail.parameters(), "lr": lr}], weight_decay=0.05)
    sampler = BatchSampler(images.shape[0], min(batch_size, images.shape[0]), seed=seed + 2)
    with torch.no_grad():
        tokens = embedder(images).to(dev)  # (M, N, D): the embedder is frozen, embed once (on its device)
    targets = targets.to(dev)
    body.train()
    tail.train()
    for k in range(1, steps + 1):
        idx = sampler.next()
        loss = task_loss(task, tail(body(tokens[idx])), targets[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(k, body, tail)
            body.train()
            tail.train()
    return body.cpu(), tail.cpu()


@torch.no_grad()
def evaluate_local(embedder: TimmStem, body: SplitBody, tail: TaskTail, task: TaskSpec,
                   images: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Task metric of embedder -> body -> tail on held-out data (eval mode)."""
    body.eval()
    tail.eval()
    return task_metric(task, tail(body(embedder(images))), targets)
