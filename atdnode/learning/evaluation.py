"""Scoring a trained model on held-out data: the per-epoch loss/accuracy and the final metrics.

`evaluate` gives `atdnode.learning.metrics.classification_metrics` (the one scorer: macro over the
classes present, confusion over the explicit label space) of a model on a labelled split,
optionally on transformed inputs (accuracy under a PGD attack); `heldout_loss_accuracy`
is the cheap per-epoch figure of `atd train`'s history.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atdnode.data import LabeledImages
from atdnode.learning.device import to_device, use_amp
from atdnode.learning.features import device_batches
from atdnode.learning.metrics import classification_metrics, named_metrics
from atdnode.learning.train_options import BatchTransform


@torch.no_grad()
def heldout_loss_accuracy(model: nn.Module, data: LabeledImages, *, batch_size: int = 256) -> dict:
    """Mean cross-entropy and accuracy of `model` on `data` (eval mode, restored afterwards);
    the sums stay on the model's device until the end."""
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, correct
    labels = to_device(data.labels, device)
    try:
        for s, x in device_batches(data.images, batch_size, device):
            y = labels[s:s + len(x)]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp(device)):
                logits = model(x)
            sums[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
            sums[1] += (logits.argmax(1) == y).sum()
    finally:
        model.train(was)
    n = max(1, len(data))
    loss, correct = sums.tolist()
    return {"val_loss": loss / n, "val_accuracy": correct / n}


@torch.no_grad()
def softmax_probabilities(model: nn.Module, images: torch.Tensor, batch_size: int = 256, *,
                          device: torch.device) -> "np.ndarray":
    """(N, K) float64 softmax of the model's logits (eval mode for the pass, restored)."""
    import numpy as np

    was = model.training
    model.eval()
    model.to(device)
    parts = []
    try:
        for _, x in device_batches(images, batch_size, device):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp(device)):
                parts.append(torch.softmax(model(x).float(), 1))
    finally:
        model.train(was)
    if not parts:
        return np.zeros((0, 0))
    return torch.cat(parts).double().cpu().numpy()


def evaluate(model: nn.Module, data: LabeledImages, *, batch_size: int = 256, device: torch.device | str | None = None,
             transform: BatchTransform | None = None) -> dict:
    """`atdnode.learning.metrics.named_metrics` of `model` on `data` over the softmax of its
    logits (intervals, calibration); on transformed inputs (e.g. adversarial examples) the
    plain `classification_metrics` of the argmax. The model's train/eval mode is restored."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if transform is None:
        probs = softmax_probabilities(model, data.images, batch_size, device=device)
        return named_metrics(data.labels.numpy(), probs.argmax(1), classes=list(data.classes), probs=probs)
    was = model.training
    model.eval()
    preds = []
    try:
        for s, x in device_batches(data.images, batch_size, device):
            y = to_device(data.labels[s:s + len(x)], device)
            g = torch.Generator().manual_seed(s)
            with torch.enable_grad():
                x = transform(model, x, y, g).detach()
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp(device)):
                preds.append(model(x).argmax(1))
    finally:
        model.train(was)
    pred = torch.cat(preds).cpu() if preds else torch.empty(0, dtype=torch.long)
    return classification_metrics(data.labels.numpy(), pred.numpy(), labels=range(len(data.classes)))

