"""What a training run is: `TrainOptions`, the batch-transform hook, and the run key.

`TrainOptions` is the one training-options type: `atd train` fills it from its flags, `atd
rounds` (`atdnode.rounds.runner`) and netsim's `[train]` (`netsim.scenario_spec.NETSIM_TRAIN`) from
theirs. `run_key(data_spec, cfg, opts)` hashes what decides a run's result
(`TrainOptions.key_fields`): two calls with the same key give the same weights, so a
finished run is returned instead of trained again and a killed one resumes.

Hook for adversarial training: `TrainOptions.batch_transform` is called on every
training batch as `transform(model, images, labels, generator) -> images` after augmentation
(with the bare model, not the DDP wrapper); its `describe()` dict enters the run key and the
provenance. `AdversarialTransform` is the PGD one (FedWAvg's federated adversarial training).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from protocols.vit_config import ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn


class BatchTransform(Protocol):
    """`transform(model, images, labels, generator) -> images`; `generator` is seeded from
    (seed, epoch, batch, rank) by the loop, so a resumed run draws the same randomness."""

    def __call__(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                 generator: torch.Generator) -> torch.Tensor: ...

    def describe(self) -> dict: ...


class AdversarialTransform:
    """Federated adversarial training (FedWAvg): a share `pgd.ratio` of each batch is
    replaced by PGD examples (protocols.adversarial); `robust()` is the eval-time attack."""

    def __init__(self, pgd) -> None:  # pgd: protocols.adversarial.PGDConfig
        self.pgd = pgd

    def __call__(self, model, images, labels, generator):
        from protocols.adversarial import adversarial_batch

        return adversarial_batch(model, images, labels, ratio=self.pgd.ratio, generator=generator,
                                 **self.pgd.attack_kwargs())

    def robust(self) -> "BatchTransform":
        from protocols.adversarial import pgd_attack

        pgd = self.pgd

        class _Attack:
            def __call__(self, model, images, labels, generator):
                return pgd_attack(model, images, labels, generator=generator, **pgd.attack_kwargs())

            def describe(self):
                return {"attack": "pgd"}

        return _Attack()

    def describe(self) -> dict:
        from dataclasses import asdict

        return {"adversarial": "pgd", **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.pgd).items()}}


# VGS-ATD's AdamW rate, meant for fine-tuning from existing weights. From random init a ViT
# needs less, and less the wider it is (Adam's rate ~ 1/width): SCRATCH_LR_192 * 192 / embed_dim.
# Measured on digits, 3 epochs, batch 16, augmentation on: vit_tiny (d=192, depth 12, img 32,
# patch 8) reached 0.14 test accuracy at 3e-3, 0.18 at 5e-4, 0.42 at 3e-4, 0.43 at 1e-4;
# d=48 depth 12 did best at 5e-4 of {3e-3, 1e-3, 5e-4}.
FINETUNE_LR = 3e-3
OPTIMIZERS = ("adamw", "sgd")
SGD_MOMENTUM = 0.9  # the FedWAvg paper's local SGD (Sec. 4)
SCRATCH_LR_192 = 1e-4


@dataclass
class TrainOptions:
    """How a model is trained; `key_fields` (what decides the result) enter the run key, display
    and device options do not. `lr` None: FINETUNE_LR from weights, width-scaled from scratch."""

    epochs: int = 3
    batch_size: int = 16
    lr: float | None = None  # None: FINETUNE_LR when starting from weights, else SCRATCH_LR
    weight_decay: float = 0.05
    warmup_epochs: float = 0.2  # linear warmup, then cosine decay to 0 (per step)
    init_from: str | None = None  # blob hash in the node's store, a checkpoint file, or a model id
    freeze_blocks: int = 0
    # LP-FT (atdnode.learning.probe): epochs of the fresh head alone on the frozen start, before the
    # fine-tuning epochs; only when the run starts from weights with a fresh head
    probe_epochs: int = 0
    probe_lr: float | None = None  # None: atdnode.learning.probe.PROBE_LR_FACTOR x the fine-tuning rate
    seed: int = 0
    augment: bool = True
    augment_threshold: int = 1000
    augment_prob: float = 0.5
    augment_mode: str = "enlarge"  # paper §4.2: extra samples for small classes; "inplace": replace
    pretrained: bool = False  # timm pretrained-by-name (needs a reachable hub)
    device: str | None = None  # atdnode.learning.device rule: cpu / cuda / cuda:N, else [compute] device, else CUDA if present
    compile: bool = False  # torch.compile the model (not in the run key: same math, other kernels)
    log: Callable[[str], None] | None = None
    batch_transform: BatchTransform | None = None
    extra_provenance: dict = field(default_factory=dict)
    epoch_eval: bool = True  # held-out loss/accuracy after each epoch (history.csv, curves.png)
    plots: bool = True  # confusion.png and curves.png in the run folder (display only; the metrics keep both)
    tensorboard: str | None = None  # log dir (atdnode.learning.trainlog); display only, not in the run key
    mlflow: str | None = None  # tracking URI (atdnode.learning.trainlog); display only
    # "adamw" (default: warmup + cosine per step) or "sgd": SGD with momentum 0.9 at a rate
    # that drops by `lr_decay` each epoch (lr * (1 - lr_decay)^(epoch_offset + epoch)), no
    # warmup -- the local optimiser of the FedWAvg paper (Sec. 4, "Training configuration":
    # 5 % per epoch in AT); `epoch_offset` counts the epochs of earlier rounds
    optimizer: str = "adamw"
    lr_decay: float = 0.0
    epoch_offset: int = 0

    def effective_lr(self, embed_dim: int) -> float:
        """`lr`, or the default: FINETUNE_LR from weights, width-scaled SCRATCH_LR_192 from scratch."""
        if self.lr is not None:
            return self.lr
        if self.init_from or self.pretrained:
            return FINETUNE_LR
        return min(FINETUNE_LR, SCRATCH_LR_192 * 192 / embed_dim)

    def key_fields(self, embed_dim: int) -> dict:
        """What decides the result (and so the run key); excludes display and device."""
        return {"epochs": self.epochs, "batch_size": self.batch_size, "lr": self.effective_lr(embed_dim), "wd": self.weight_decay,
                "warmup": self.warmup_epochs, "init_from": self.init_from, "freeze": self.freeze_blocks,
                "seed": self.seed, "augment": [self.augment, self.augment_threshold, self.augment_prob, self.augment_mode],
                "pretrained": self.pretrained,
                "transform": self.batch_transform.describe() if self.batch_transform else None,
                **({"optimizer": [self.optimizer, self.lr_decay, self.epoch_offset]} if self.optimizer != "adamw" else {}),
                **({"probe": [self.probe_epochs, self.probe_lr]} if self.probe_epochs else {})}


def run_key(data_spec: str, cfg: ModelConfig, opts: TrainOptions) -> str:
    """20 hex digits naming the run `(data_spec, cfg, opts)` defines (its HOME/runs/<key>)."""
    raw = json.dumps({"data": data_spec, "model": cfg.to_dict(), **opts.key_fields(cfg.embed_dim)}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:20]
