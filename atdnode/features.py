"""CLS feature extraction for a whole dataset (batched, no grad, optional progress bar)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from atdnode import progress as report
from atdnode.data import LabeledImages
from atdnode.model import cls_features


def progress_bar(enabled: bool, *fields: str):
    """A rich Progress (transient=False) with extra text fields; a no-op when disabled."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    columns += [TextColumn("{task.fields[%s]}" % f) for f in fields]
    return Progress(*columns, disable=not enabled)


@torch.no_grad()
def extract_features(model: nn.Module, data: LabeledImages, batch_size: int = 256, *,
                     device: torch.device | str | None = None, progress: bool = False,
                     amp: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """CLS (pre-logits) features of every image: (float32 (N, D), int64 labels (N,)).

    The model is put in eval mode for the pass and restored afterwards. On CUDA the
    forward runs under bf16 autocast (`amp=None` means "when on CUDA"); features are
    always returned as float32.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    use_amp = (device.type == "cuda") if amp is None else amp
    was_training = model.training
    model.eval()
    n = len(data)
    dim = int(getattr(model, "num_features", 0)) or None
    out: np.ndarray | None = np.empty((n, dim), dtype=np.float32) if dim else None
    try:
        with progress_bar(progress) as bar, report.task("CLS features", total=n) as step:
            task = bar.add_task("features", total=n)
            for s in range(0, n, batch_size):
                x = data.images[s:s + batch_size].to(device, non_blocking=True)  # (B, C, H, W)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                    f = cls_features(model, x)  # (B, D)
                f = f.float().cpu().numpy()
                if out is None:
                    out = np.empty((n, f.shape[1]), dtype=np.float32)
                out[s:s + len(f)] = f
                bar.advance(task, len(f))
                step.advance(len(f))
    finally:
        model.train(was_training)
    if out is None:
        out = np.empty((0, dim or 0), dtype=np.float32)
    return out, data.labels.numpy().astype(np.int64)
