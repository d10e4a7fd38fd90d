"""The epoch loop: `Trainer(model, data, opts, ctx).train_epoch(e)` on in-memory data.

AdamW (no decay for biases, norms and timm's `no_weight_decay()` tokens: `param_groups`)
with a linear warmup then cosine decay per step (`lr_at`), or the FedWAvg paper's SGD
(`TrainOptions.optimizer = "sgd"`). Each epoch's order, augmentation, batch transform and
dropout are pure functions of (seed, epoch[, batch, rank]), so a run resumed after epoch e
ends with the same weights as an uninterrupted one (`atdnode.learning.training.train`). Under DDP
(`atdnode.learning.ddp`) every rank takes its slice of each global batch and the loss is scaled so
the gradient average equals the global batch mean.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from atdnode.learning import ddp
from atdnode.learning.augment import SmallClassAugment
from atdnode.data import LabeledImages
from atdnode.learning.devdata import DeviceImages
from atdnode.learning.device import to_device, use_amp
from atdnode.learning.model import hold_frozen_norms
from atdnode.errors import ConfigError
from atdnode.learning.train_options import OPTIMIZERS, SGD_MOMENTUM, TrainOptions


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay for biases, norms and timm's `no_weight_decay()` tokens."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _seed_of(*parts: int) -> int:
    import numpy as np

    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def lr_at(step: int, total: int, warmup: int, base: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


class LaggedStats:
    """Running (mean loss, accuracy) for a progress display without a host synchronisation.

    On CUDA the device totals are copied without blocking into pinned memory and read only
    once that copy's event has completed, so the display lags a step or a few; on the CPU
    the values are read at once.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(3, dtype=torch.float64).pin_memory() if self.cuda else None
        self.event = None
        self.last = (float("nan"), float("nan"))

    def read(self, stats: torch.Tensor) -> tuple[float, float]:
        """`stats` = (loss sum, correct, count) -> the latest (loss, accuracy) available."""
        if not self.cuda:
            loss, correct, n = stats.tolist()
            return loss / max(n, 1.0), correct / max(n, 1.0)
        if self.event is not None and self.event.query():
            loss, correct, n = self.host.tolist()
            self.last, self.event = (loss / max(n, 1.0), correct / max(n, 1.0)), None
        if self.event is None:
            self.host.copy_(stats, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        return self.last


class Trainer:
    """The epoch loop on in-memory data (no DataLoader: the tensors are already there)."""

    def __init__(self, model: nn.Module, data: LabeledImages, opts: TrainOptions, ctx: ddp.DistContext) -> None:
        self.model, self.data, self.opts, self.ctx = model, data, opts, ctx
        self.device = ctx.device
        self.amp = use_amp(self.device)
        self.net: nn.Module = model
        if ctx.distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if opts.compile:
            self.net = torch.compile(self.net)
        self.lr = opts.effective_lr(int(model.embed_dim))
        fused = {"fused": True} if self.device.type == "cuda" else {}  # one kernel for all params on CUDA
        self.optimizer = torch.optim.AdamW(param_groups(model, opts.weight_decay), lr=self.lr, **fused)
        self.augment = (SmallClassAugment(data.class_counts(), threshold=opts.augment_threshold,
                                          prob=opts.augment_prob, seed=opts.seed, mode=opts.augment_mode)
                        if opts.augment else None)
        if opts.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer {opts.optimizer!r}: choose from {', '.join(OPTIMIZERS)}")
        if opts.optimizer == "sgd":  # the FedWAvg paper's local optimiser, in AdamW's place
            self.optimizer = torch.optim.SGD(param_groups(model, opts.weight_decay), lr=self.lr, momentum=SGD_MOMENTUM)
        # sample i < N is data[i]; sample N + k is an augmented copy of data[sources[N + k]]
        extra = self.augment.extra_sources(data.labels) if self.augment is not None else torch.zeros(0, dtype=torch.int64)
        self.sources = torch.cat([torch.arange(len(data)), extra])
        self.samples_per_epoch = len(self.sources)  # with augmented extras: the progress bar's total
        self.steps_per_epoch = math.ceil(len(self.sources) / opts.batch_size)
        self.total_steps = self.steps_per_epoch * opts.epochs
        self.warmup = min(self.total_steps, round(opts.warmup_epochs * self.steps_per_epoch))
        self.images = DeviceImages(data.images, data.labels, self.device)  # on the GPU when it fits

    def epoch_order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.opts.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.sources), generator=g)

    def train_epoch(self, epoch: int, on_batch: Callable[[int, float, float], None] | None = None) -> dict:
        """One pass over the data (0-based `epoch`); returns mean loss and accuracy over all ranks."""
        opts, ctx = self.opts, self.ctx
        torch.manual_seed(opts.seed * 7919 + epoch)  # dropout / drop-path, if the model has any
        self.net.train()
        hold_frozen_norms(self.model)  # a frozen conv stem keeps its BatchNorm statistics
        order = self.epoch_order(epoch)
        stats = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, correct, count (this rank)
        shown = LaggedStats(self.device)
        for b in range(self.steps_per_epoch):
            step = epoch * self.steps_per_epoch + b
            for g in self.optimizer.param_groups:
                g["lr"] = (self.lr * (1.0 - opts.lr_decay) ** (opts.epoch_offset + epoch) if opts.optimizer == "sgd"
                           else lr_at(step, self.total_steps, self.warmup, self.lr))
            gidx = order[b * opts.batch_size:(b + 1) * opts.batch_size]  # the global batch
            lo, hi = ctx.slice(len(gidx))
            idx = gidx[lo:hi]
            src = self.sources[idx]  # (b,) on the CPU: indices never wait for the device
            x, y = self.images.gather(src), self.images.gather_labels(src)  # (b, C, H, W), (b,) on the device
            if self.augment is not None:
                x = self.augment(x, self.data.labels[src], idx, epoch)  # in place mode
                extra = torch.nonzero(idx >= len(self.data)).flatten()
                if len(extra):  # enlarge mode: the extra samples are made now, batched on the device
                    at = to_device(extra, self.device)
                    x[at] = self.augment.make_extra(x[at], idx[extra], epoch)
            if opts.batch_transform is not None:
                g = torch.Generator().manual_seed(_seed_of(opts.seed, epoch, b, ctx.rank))
                x = opts.batch_transform(self.model, x, y, g)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                logits = self.net(x)  # (b, K)
                loss_sum = F.cross_entropy(logits.float(), y, reduction="sum")
            # scaled so DDP's gradient average equals the mean over the global batch
            (loss_sum * (ctx.world / len(gidx))).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():  # stays on the device: no host sync per step
                stats[0] += loss_sum.detach().double()
                stats[1] += (logits.argmax(1) == y).sum()
                stats[2] += len(y)
            if on_batch is not None:
                on_batch(len(gidx), *shown.read(stats))
        ctx.sum_(stats)
        loss, acc = (stats[:2] / stats[2].clamp(min=1)).tolist()
        return {"epoch": epoch + 1, "loss": loss, "accuracy": acc}

