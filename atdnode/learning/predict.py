"""Predictions on new, unlabelled images (`atd predict`): one row per image.

The model is a registry record, chosen as `atd classify` chooses it (`--model`, default
the one `atd classify` uses). It predicts the way `atd classify` scores it
(`atdnode.learning.classify`): a record with an ensemble (vertical / hierarchical aggregation)
through CLS features of its extractor -> PCA -> the soft-voting ensemble, over the
ensemble's classes; a raw-pixel record (`atdnode.models.RAW_PIXELS`: the node's own raw-pixel ensemble, kept
by the keep decision, `atdnode.aggregation.keep`) through its flattened pixels -> the same
ensemble, with no extractor; any other record through its own head, softmax over its labels. The
predicted class is the argmax of the probabilities (the ensemble's `predict` is the same
argmax), so a prediction here equals `atd classify`'s on the same image.

Images are read by `atdnode.data.unlabelled` with the training readers and intensity rules.
The CSV has a header and one row per image:

    file, predicted, probability, p:<class 1>, ..., p:<class K>, model

(`probability` is that of the predicted class; the p: columns sum to 1.)
"""
from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from atdnode.blobs import BlobStore
from atdnode.data import UnlabelledReader
from atdnode.learning.device import use_amp
from atdnode.errors import AtdError
from atdnode.node import NodeHome
from atdnode.learning.model import ModelConfig, build_model, cls_features, load_part, part_spec
from atdnode.models import RAW_PIXELS, ModelRecord, ModelRegistry, answer_classes, is_raw_pixels, load_weights

DEFAULT_MODEL = "latest"  # what `atd classify` scores when --model is not given
Progress = Callable[[str, int, int], None]  # (stage, done, total): files read and predicted


def pixel_features(images: torch.Tensor) -> np.ndarray:
    """(N, C*H*W) float32: the flattened pixels a raw-pixel ensemble reads."""
    return images.reshape(len(images), -1).float().numpy().astype(np.float32)


class ClassifyError(AtdError):
    """The model cannot classify this data (no classes in common, malformed record)."""


def load_full_model(store: BlobStore, record: ModelRecord) -> torch.nn.Module:
    """The record's full weight set in a fresh model (keys, shapes and finiteness checked)."""
    model = build_model(ModelConfig.from_dict(record.model))
    blob = record.blobs.get("full")
    if not blob:
        raise ClassifyError(f"model {record.id} has no full weight set")
    tensors, _ = load_weights(store, blob, expect=part_spec(model, "full"))
    load_part(model, tensors, "full")
    return model.eval()


@dataclass
class PredictResult:
    model_id: str
    kind: str  # "ensemble" | "model"
    classes: list[str]  # the probability columns, in order
    files: list[str]
    probs: np.ndarray  # (N, K) float64, rows sum to 1
    device: str
    skipped: list[tuple[str, str]] = field(default_factory=list)
    scaling: dict[str, int] = field(default_factory=dict)
    out: Path | None = None

    @property
    def predicted(self) -> list[str]:
        return [self.classes[i] for i in self.probs.argmax(1)] if len(self.files) else []

    def to_json(self) -> dict:
        return {"model": self.model_id, "kind": self.kind, "classes": self.classes, "n": len(self.files),
                "device": self.device, "out": str(self.out) if self.out else None, "scaling": self.scaling,
                "skipped": [list(s) for s in self.skipped],
                "counts": {c: self.predicted.count(c) for c in self.classes}}


def resolve_device(pref: str | None, home: NodeHome | None = None) -> torch.device:
    """The device the model runs on: the node's one device rule (`atdnode.learning.device`: `pref`,
    else HOME's `[compute] device`, else CUDA when present); a device this machine lacks
    fails here, before any image is read."""
    from atdnode.learning.device import resolve_device as rule

    return rule(pref, home=home)


def model_record(home: NodeHome, model: str | None = None) -> ModelRecord:
    """The registry record `model` names; None or "latest": the model in use
    (`atdnode.models.model_in_use`, the one `atd classify` uses by default)."""
    from atdnode.models import resolve_model

    return resolve_model(home, model or DEFAULT_MODEL)


def model_window(record: ModelRecord) -> tuple[float, float] | str | None:
    """The intensity window the model was trained with (`atdnode.data.loader.training_window`
    of its training data spec), for inputs that name none: a model trained on CT with
    `window=-1000,400` sees new CT through the same window. A `window=auto` whose training
    images are not readable here falls back to percentiles over the new images."""
    from atdnode.data import DataSpec, training_window
    from atdnode.errors import DataError

    spec = (record.provenance or {}).get("data")
    try:
        window = DataSpec.parse(spec).window if isinstance(spec, str) else None
    except DataError:  # a spec this version cannot read: the defaults
        return None
    try:
        return training_window(spec) if window is not None else None  # the data seed training used: 0
    except (DataError, OSError):
        return "auto"


class Predictor:
    """A record's model loaded once on `device`; `probabilities(images)` -> (N, K) over `classes`."""

    def __init__(self, store: BlobStore, record: ModelRecord, device: torch.device) -> None:
        self.device = device
        self.raw = is_raw_pixels(record)
        self.model = None if self.raw else load_full_model(store, record).to(device)
        self.ensemble = None
        ens_blob = record.blobs.get("ensemble")
        if ens_blob:
            from atdnode.models import load_ensemble

            self.classes = answer_classes(record)
            self.ensemble = load_ensemble(store, ens_blob)
            if not self.classes or int(self.ensemble.classes_.max()) >= len(self.classes):
                raise ClassifyError(f"model {record.id}: its ensemble classes are not recorded correctly")
        elif self.raw:
            raise ClassifyError(f"model {record.id} is a raw-pixel model without its ensemble")
        else:
            self.classes = answer_classes(record)
        self.kind = RAW_PIXELS if self.raw else "model" if self.ensemble is None else "ensemble"

    @torch.no_grad()
    def probabilities(self, images: torch.Tensor, batch_size: int = 256) -> np.ndarray:
        """(N, K) float64 rows summing to 1; on CUDA under bf16 autocast, as training evaluates."""
        out = np.zeros((len(images), len(self.classes)), dtype=np.float64)
        dev = self.device
        for s in range(0, len(images), batch_size):
            if self.raw:
                p = np.zeros((len(images[s:s + batch_size]), len(self.classes)))
                p[:, self.ensemble.classes_.astype(np.int64)] = self.ensemble.predict_proba(
                    pixel_features(images[s:s + batch_size]))
                out[s:s + len(p)] = p
                continue
            x = images[s:s + batch_size].to(dev, non_blocking=True)  # (B, C, H, W)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_amp(dev)):
                y = self.model(x) if self.ensemble is None else cls_features(self.model, x)  # (B, K) | (B, D)
            if self.ensemble is None:
                p = torch.softmax(y.float(), dim=1).double().cpu().numpy()
            else:
                p = np.zeros((len(x), len(self.classes)))
                p[:, self.ensemble.classes_.astype(np.int64)] = self.ensemble.predict_proba(y.float().cpu().numpy())
            out[s:s + len(x)] = p
        return out / out.sum(1, keepdims=True) if len(out) else out


def class_probabilities(store: BlobStore, record: ModelRecord, images: torch.Tensor, *, device: torch.device,
                        batch_size: int = 256) -> tuple[list[str], np.ndarray, str]:
    """(classes, probabilities (N, K) over them, kind) of `record` on model-ready `images`."""
    pr = Predictor(store, record, device)
    return pr.classes, pr.probabilities(images, batch_size), pr.kind


def predict(home: NodeHome, inputs: list[str], *, model: str | None = None, out: str | Path | None = None,
            device: str | None = None, batch_size: int = 256, chunk: int = 512,
            progress: Progress | None = None) -> PredictResult:
    """Predict every image of `inputs` (see `atdnode.data.unlabelled`) with `model`, reading
    `chunk` files at a time (bounded memory for a folder of any size); write the CSV to `out`
    when given. `progress(stage, done, total)` counts the files read and predicted."""
    dev = resolve_device(device, home)  # before any image is read
    record = model_record(home, model)
    cfg = ModelConfig.from_dict(record.model)
    reader = UnlabelledReader(inputs, cfg.img_size, cfg.in_chans, window=model_window(record))
    predictor = Predictor(BlobStore.of(home), record, dev)
    report = progress or (lambda stage, done, total: None)
    files: list[str] = []
    parts: list[np.ndarray] = []
    for images, names in reader.chunks(chunk, progress=lambda d, t: report("images", d, t)):
        parts.append(predictor.probabilities(images, batch_size))
        files += names
    res = PredictResult(model_id=record.id, kind=predictor.kind, classes=predictor.classes, files=files,
                        probs=np.concatenate(parts), device=str(dev), skipped=reader.skipped, scaling=reader.scaling)
    if out is not None:
        res.out = write_csv(res, Path(out))
    return res


def write_csv(res: PredictResult, path: Path) -> Path:
    """The predictions as CSV (header + one row per image), written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["file", "predicted", "probability", *(f"p:{c}" for c in res.classes), "model"])
        for name, row, pred in zip(res.files, res.probs, res.predicted):
            w.writerow([name, pred, f"{row.max():.6f}", *(f"{v:.6f}" for v in row), res.model_id])
    tmp.replace(path)
    return path
