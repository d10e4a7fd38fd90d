"""LP-FT: fit the fresh classification head on the frozen start before fine-tuning everything.

When a model starts from someone else's extractor (a peer's weights, the public W_p, the
MSD base) its head is timm's random init. Fine-tuning the whole model from there lets the
random head's large early gradients reshape the extractor before the head means anything,
which wears away what the start knew ("feature distortion": Kumar et al., *Fine-Tuning can
Distort Pretrained Features and Underperform Out-of-Distribution*, ICLR 2022, §3-4, whose
remedy is this two-stage LP-FT). VGS-ATD (§3.1: new head, then fine-tune with a subset of
blocks frozen; §3.2: initialise from W_p and train) fine-tunes in one stage; atd's
`[train] probe_epochs` (`atd train --probe-epochs`) adds the linear-probe stage in front of
it and says so in the run key. On the digits-jitter consortium from W_p
(netsim/scenarios/jitter_public.toml) it lifts VGS-ATD's fused extractor in every phase
(numbers in RESULTS.md).

The probe trains only what follows the blocks (timm's final norm, `fc_norm`, the head): the
embeddings and every block are frozen for `probe_epochs` at `probe_lr` (default: five times
the fine-tuning rate), then the caller's freeze setting is restored and the usual
fine-tuning runs from the probed head.

The settings are chosen on the phase-1 founders' own 80/20 holdout of jitter_public.toml,
never on test data (`bench/jitter_recipe_bench.py --start public --choose-lr 2e-3
--probe-epochs E --probe-lr R`); the holdout accuracies are in RESULTS.md.
"""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from atdnode.learning import ddp
from atdnode.data import LabeledImages
from atdnode.errors import ConfigError
from atdnode.learning.model import freeze_blocks
from atdnode.learning.train_options import TrainOptions

PROBE_LR_FACTOR = 5.0  # probe_lr default: this times the fine-tuning rate (see the module doc)


def probe_lr(opts: TrainOptions, embed_dim: int) -> float:
    """The probe's rate: `opts.probe_lr`, else PROBE_LR_FACTOR x the fine-tuning rate."""
    if opts.probe_lr is not None and not opts.probe_lr > 0:  # NaN included
        raise ConfigError(f"--probe-lr must be a positive rate, got {opts.probe_lr}")
    return opts.probe_lr if opts.probe_lr is not None else PROBE_LR_FACTOR * opts.effective_lr(embed_dim)


def fresh_head(prov: dict, opts: TrainOptions) -> bool:
    """Whether the run starts from weights with a fresh head, where the probe applies: an
    extractor weight set (`atdnode.learning.train_start.build_start`'s provenance) or timm's
    pretrained weights. A full set of the same label space brings its head: no probe."""
    return prov.get("init_part") == "extractor" or opts.pretrained


def probe_head(model: nn.Module, data: LabeledImages, opts: TrainOptions, ctx: ddp.DistContext) -> list[dict]:
    """Train `model`'s head alone (embeddings and all blocks frozen) for `opts.probe_epochs`
    on `data`, in place; returns each probe epoch's stats. Which parameters train afterwards
    is as before the call. No-op (empty list) when `opts.probe_epochs` is 0."""
    from atdnode.learning.trainer import Trainer

    if opts.probe_epochs <= 0:
        return []
    if ctx.distributed:  # two DDP wrappers of one module in turn: not exercised, so refused
        raise ConfigError("--probe-epochs is not supported with --nproc-per-node > 1 yet: "
                          "probe on one process, or train without it")
    was = {name: p.requires_grad for name, p in model.named_parameters()}
    freeze_blocks(model, len(model.blocks))
    try:
        popts = replace(opts, epochs=opts.probe_epochs, lr=probe_lr(opts, int(model.embed_dim)), probe_epochs=0,
                        optimizer="adamw", lr_decay=0.0, epoch_offset=0)
        trainer = Trainer(model, data, popts, ctx)
        return [trainer.train_epoch(e) for e in range(popts.epochs)]
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(was[name])
