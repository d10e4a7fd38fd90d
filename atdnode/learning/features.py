"""CLS feature extraction for a whole dataset (batched, no grad; progress reported through `atdnode.progress`)."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from atdnode import progress as report
from atdnode.data import LabeledImages
from atdnode.learning.device import use_amp
from atdnode.learning.model import cls_features


def device_batches(images: torch.Tensor, batch_size: int, device: torch.device) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, images[start:start + batch_size] on `device`) for every batch.

    Host data bound for CUDA is copied from pinned memory without blocking, so batch k+1's
    copy overlaps batch k's compute; data already on `device` is sliced in place.
    """
    pin = device.type == "cuda" and images.device.type == "cpu" and torch.cuda.is_available()
    for s in range(0, len(images), batch_size):
        x = images[s:s + batch_size]  # (B, C, H, W)
        if pin:
            x = x.pin_memory()
        yield s, x.to(device, non_blocking=True)


def _model_on(model: nn.Module, device: torch.device | str | None) -> torch.device:
    """Resolve the pass's device (default: where the model is) and move the model there."""
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    if next(model.parameters()).device != dev:
        model.to(dev)
    return dev


@torch.no_grad()
def predict_classes(model: nn.Module, images: torch.Tensor, batch_size: int = 256, *,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """argmax of the model's logits per image, (N,) int64 on the CPU; eval mode for the pass.
    Predictions stay on the device until the end: one host synchronisation per call."""
    dev = _model_on(model, device)
    was = model.training
    model.eval()
    preds = []
    try:
        for _, x in device_batches(images, batch_size, dev):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_amp(dev)):
                preds.append(model(x).argmax(1))  # (B,)
    finally:
        model.train(was)
    return torch.cat(preds).cpu() if preds else torch.empty(0, dtype=torch.int64)


@torch.no_grad()
def extract_features(model: nn.Module, data: LabeledImages, batch_size: int = 256, *,
                     device: torch.device | str | None = None, amp: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """CLS (pre-logits) features of every image: (float32 (N, D), int64 labels (N,)).

    `device` (default: where the model is) runs the pass; the model is moved there. The model
    is put in eval mode for the pass and restored afterwards. On CUDA the forward runs under
    bf16 autocast (`amp=None` means "when on CUDA"); features are always returned as float32.
    Features stay on the device until the end (one host synchronisation per call).
    """
    device = _model_on(model, device)
    amp_on = use_amp(device) if amp is None else amp
    was_training = model.training
    model.eval()
    n = len(data)
    dim = int(getattr(model, "num_features", 0) or 0)
    parts: list[torch.Tensor] = []
    try:
        with report.task("CLS features", total=n) as step:
            for _, x in device_batches(data.images, batch_size, device):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp_on):
                    parts.append(cls_features(model, x).float())  # (B, D)
                step.advance(len(x))
    finally:
        model.train(was_training)
    out = torch.cat(parts).cpu().numpy() if parts else np.empty((0, dim), dtype=np.float32)
    return out, data.labels.numpy().astype(np.int64)
