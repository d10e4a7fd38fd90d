"""In-process learning steps of the baselines (centralized, FedAvg, swarm, local) and helpers
the VGS-ATD runner shares (model config, label mapping, scores); VGS-ATD itself trains
through `atd train`'s library function (`netsim.vgs_ops`).

Everything goes through the node's own code: `atdnode.learning.model` builds and splits the timm
ViT, `atdnode.learning.training.Trainer` runs the epochs (AdamW, warmup + cosine, seeded order),
`atdnode.learning.features.extract_features` gives CLS features. Nothing here touches a network.
Training and prediction run on the node's device (`atdnode.learning.device.resolve_device`: $ATD_DEVICE,
set by `atd netsim run --device`, else CUDA when present); the trained model comes back on
the CPU, so every average and every byte counted is computed there, as on the wire.

Metrics (`score`) are the node's (`atdnode.learning.metrics.classification_metrics`): macro-averaged
over the classes present in the test set, so a node whose test data holds 3 classes is not
penalised for the 7 it never sees; predictions of other classes count as errors. Accuracy and
balanced accuracy come with the scorer's 95 % intervals (`accuracy_ci95`: Wilson;
`balanced_accuracy_ci95`: a seeded percentile bootstrap); given the predicted probabilities,
`auroc` with its `auroc_ci95` (`atdnode.learning.metrics.auroc_summary`: two classes, the
positive class's; more, the one-vs-rest macro over the classes present, each over the global
label space).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from atdnode.learning import ddp
from atdnode.data import LabeledImages
from atdnode.learning import (ModelConfig, TrainOptions, Trainer, auroc_summary, build_model, classification_metrics,
                              freeze_blocks, load_part, predict_classes, probe_head, resolve_config, resolve_device,
                              softmax_probabilities)
from protocols.aggregation import HEAD_PREFIXES
from protocols.rounds import LAST_LAYER

METRICS = ("accuracy", "balanced_accuracy", "precision", "sensitivity", "f1")


def model_config(spec: ModelConfig, num_classes: int) -> ModelConfig:
    return resolve_config(spec.name, img_size=spec.img_size, patch_size=spec.patch_size,
                           embed_dim=spec.embed_dim, depth=spec.depth, num_heads=spec.num_heads,
                           in_chans=spec.in_chans, num_classes=num_classes, mlp_ratio=spec.mlp_ratio, stem=spec.stem)


@dataclass
class Trained:
    model: nn.Module
    seconds: float  # wall-clock compute time of this step


def train_model(cfg: ModelConfig, data: LabeledImages, spec: TrainOptions, *, seed: int, epochs: int | None = None,
                init: dict[str, torch.Tensor] | None = None, init_part: str = "extractor", freeze: int = 0,
                prox_mu: float = 0.0, warmup_epochs: float | None = None) -> Trained:
    """Train a fresh model of `cfg` on `data`, optionally initialised from `init` (a part's
    tensors), with the first `freeze` blocks frozen and an optional FedProx term
    `mu/2 * ||w - w_init||^2` (added to each parameter's gradient by a hook). `spec` is the
    scenario's [train] (`TrainOptions`: epochs, batch size, rate, weight decay, warmup, augment);
    `epochs`, `warmup_epochs` and `freeze` override it for this step."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = build_model(cfg)
    if init is not None:
        load_part(model, init, init_part)
    dev = resolve_device(None)
    model.to(dev)
    opts = replace(spec, epochs=epochs or spec.epochs, seed=seed, freeze_blocks=freeze, init_from=None,
                   warmup_epochs=spec.warmup_epochs if warmup_epochs is None else warmup_epochs)
    ctx = ddp.DistContext(device=dev)
    if init is not None and init_part == "extractor":  # a fresh head: LP-FT's probe first (atdnode.learning.probe)
        probe_head(model, data, opts, ctx)
    freeze_blocks(model, freeze)
    hooks = []
    if prox_mu > 0:
        ref = {k: v.detach().clone() for k, v in model.named_parameters()}
        for name, p in model.named_parameters():
            if p.requires_grad:
                hooks.append(p.register_hook(lambda g, p=p, r=ref[name]: g + prox_mu * (p.detach() - r)))
    trainer = Trainer(model, data, opts, ctx)
    for e in range(opts.epochs):
        trainer.train_epoch(e)
    model.cpu()
    for h in hooks:
        h.remove()
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return Trained(model, time.perf_counter() - t0)


@torch.no_grad()
def predict(model: nn.Module, images: torch.Tensor, batch_size: int = 512) -> np.ndarray:
    """Arg-max class indices (into the model's own label space), computed on the node's device;
    the model is left on the CPU."""
    model.eval()
    try:
        return predict_classes(model, images, batch_size, device=resolve_device(None)).numpy().astype(np.int64)
    finally:
        model.cpu()


@torch.no_grad()
def predict_proba(model: nn.Module, images: torch.Tensor, batch_size: int = 512) -> np.ndarray:
    """(N, K) softmax probabilities over the model's own label space, computed on the node's
    device; the model is left on the CPU."""
    try:
        return softmax_probabilities(model, images, batch_size, device=resolve_device(None))
    finally:
        model.cpu()


def to_global(pred: np.ndarray, own: list[str], space: list[str]) -> np.ndarray:
    """Map indices into `own` to indices into `space` (a superset)."""
    pos = {c: i for i, c in enumerate(space)}
    table = np.asarray([pos[c] for c in own], dtype=np.int64)
    return table[pred]


def global_probs(probs: np.ndarray, own: list[str], space: list[str]) -> np.ndarray:
    """(N, len(space)): the columns of `probs` (N, len(own)) placed at their classes' positions
    in `space` (a superset); classes the predictor does not know get probability 0."""
    out = np.zeros((len(probs), len(space)), dtype=np.float64)
    if len(probs):  # (an empty batch may come back as (0, 0))
        out[:, to_global(np.arange(len(own)), own, space)] = probs
    return out


def score(y_true: np.ndarray, y_pred: np.ndarray, probs: np.ndarray | None = None) -> dict[str, float]:
    """Accuracy and macro precision / sensitivity (recall) / F1 over the classes in `y_true`:
    `atdnode.learning.metrics.classification_metrics` (the scorer of `atd train` and `atd classify`),
    rounded to 6 places, without the confusion matrix; given `probs` (N, classes of the label
    space `y_true` indexes), AUROC with its interval (`auroc_summary`)."""
    y_true = np.asarray(y_true, dtype=np.int64)
    y_pred = np.asarray(y_pred, dtype=np.int64)
    m = classification_metrics(y_true, y_pred, labels=np.union1d(y_true, y_pred))
    ci = m.get("ci", {})  # the scorer's intervals: Wilson for accuracy, a seeded bootstrap for the rest
    out = {k: round(m[k], 6) for k in METRICS} | {"n": m["n"]} | {
        f"{k}_ci95": [round(float(x), 6) for x in ci[k]] for k in ("accuracy", "balanced_accuracy") if ci.get(k)}
    auc = None if probs is None else auroc_summary(y_true, probs)
    if auc is not None:
        out |= {"auroc": round(auc["auroc"], 6), "auroc_ci95": [round(float(x), 6) for x in auc["ci"]]}
    return out


def score_probs(y_true: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    """`score` of the arg-max of `probs` (N, classes of the label space), with AUROC."""
    return score(y_true, np.asarray(probs).argmax(1), probs)


def state_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Raw tensor bytes of a weight set (what a transfer of it costs, without headers)."""
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def expand_head(state: dict[str, torch.Tensor], old: list[str], new: list[str], cfg: ModelConfig,
                seed: int) -> dict[str, torch.Tensor]:
    """A full state for label space `new` from one over `old` (a subset): extractor and the
    head rows of known classes are kept, rows of new classes come from a fresh seeded init."""
    torch.manual_seed(seed)
    fresh = full_state(build_model(cfg))
    out = {k: v.clone() for k, v in state.items() if not k.startswith(HEAD_PREFIXES)}
    pos = {c: i for i, c in enumerate(old)}
    for k in LAST_LAYER:
        w = fresh[k].clone()
        for j, c in enumerate(new):
            if c in pos:
                w[j] = state[k][pos[c]]
        out[k] = w
    return out
