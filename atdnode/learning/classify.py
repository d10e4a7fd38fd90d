"""Predict with the node's model on a data spec and score it (`atd classify`).

A registry record with an ensemble (`blobs["ensemble"]`, from vertical or hierarchical
aggregation) predicts with CLS features of its extractor -> the ensemble, over the
ensemble's classes (`provenance["ensemble_classes"]`); any other record predicts with its
own head over its `labels`.

The classifier's classes and the data's are matched by name. Test samples of a class the
classifier does not know count as errors (and are listed as `unknown_classes`). Accuracy is
over all samples; precision, sensitivity (recall) and F1 are macro averages over the
classes present in the data; the confusion matrix (rows true, columns predicted) spans
the data's classes followed by any other class the classifier predicted, and is written
as a PNG. Optionally, accuracy under a PGD attack (protocols.adversarial; head models only).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from atdnode.blobs import BlobStore
from atdnode.data import load_dataset
from atdnode.data import caution_for
from atdnode.node import NodeHome
from atdnode.learning.metrics import classification_metrics, save_confusion_png
from atdnode.learning.model import ModelConfig
from atdnode.learning.predict import ClassifyError, class_probabilities, load_full_model  # noqa: F401 (re-exported)
from atdnode.models import ModelRecord, ModelRegistry


@dataclass
class ClassifyResult:
    model_id: str
    kind: str  # "ensemble" | "model"
    classes: list[str]  # rows / columns of the confusion matrix
    unknown_classes: list[str]  # data classes the classifier cannot predict
    metrics: dict
    png: Path

    def to_json(self) -> dict:
        m = self.metrics
        return {"model": self.model_id, "kind": self.kind, "n": m["n"], "accuracy": m["accuracy"],
                "precision": m["precision"], "sensitivity": m["sensitivity"], "recall": m["recall"], "f1": m["f1"],
                "classes": self.classes, "unknown_classes": self.unknown_classes, "confusion": m["confusion"],
                "png": str(self.png), **{k: m[k] for k in ("robust_accuracy", "caution") if k in m}}


def predict_names(store: BlobStore, record: ModelRecord, images: torch.Tensor, *, batch_size: int = 256,
                  device: torch.device | str | None = None) -> tuple[list[str], np.ndarray, str]:
    """(classifier classes, predicted index per image into them, kind): the argmax of
    `atdnode.learning.predict.class_probabilities`, the one place a record's model predicts; it runs
    on `device` (atdnode.learning.device rule; None: CUDA when present)."""
    from atdnode.learning.device import resolve_device

    names, probs, kind = class_probabilities(store, record, images, device=resolve_device(device),
                                             batch_size=batch_size)
    return names, probs.argmax(1).astype(np.int64), kind


def robust_accuracy_on(store: BlobStore, record: ModelRecord, data, *, pgd,
                       device: torch.device | str | None = None) -> float:
    """Accuracy under PGD (`pgd`: protocols.adversarial.PGDConfig) of a model predicting with
    its head; samples of classes it does not know count as errors, as in the clean metrics."""
    from protocols.adversarial import AdversarialError, robust_accuracy

    if record.blobs.get("ensemble"):
        raise ClassifyError(f"model {record.id} predicts with an ensemble (PCA, trees): PGD needs gradients "
                            f"through the classifier, so robust accuracy is for head models only")
    from atdnode.learning.device import resolve_device

    dev = resolve_device(device)
    model = load_full_model(store, record).to(dev)
    index = {c: i for i, c in enumerate(record.labels)}
    names = [data.classes[int(t)] for t in data.labels]
    known = torch.tensor([c in index for c in names], dtype=torch.bool)
    if not bool(known.any()):
        return 0.0
    y = torch.tensor([index[c] for c, k in zip(names, known.tolist()) if k], dtype=torch.int64)
    try:
        rep = robust_accuracy(model, (data.images[known].to(dev), y.to(dev)), generator=torch.Generator().manual_seed(0),
                              **pgd.attack_kwargs())
    except AdversarialError as exc:
        raise ClassifyError(f"robust accuracy: {exc}") from None
    return rep.robust * rep.n / len(names)


def score_record(store: BlobStore, record: ModelRecord, data, *, batch_size: int = 256,
                 device: torch.device | str | None = None) -> tuple[dict, list[str], str, list[str]]:
    """(metrics, confusion-matrix classes, kind, the classifier's classes) of `record` on
    labelled images `data` (the model runs on `device`, atdnode.learning.device rule)."""
    names, pred, kind = predict_names(store, record, data.images, batch_size=batch_size, device=device)
    if not set(names) & set(data.classes):
        raise ClassifyError(f"model {record.id} knows classes {names[:12]}, none of the data's {data.classes[:12]}")
    space = list(data.classes) + [c for c in names if c not in data.classes]
    index = {c: i for i, c in enumerate(space)}
    y_true = np.asarray([index[data.classes[int(t)]] for t in data.labels], dtype=np.int64)
    y_pred = np.asarray([index[names[int(p)]] for p in pred], dtype=np.int64)
    metrics = classification_metrics(y_true, y_pred, labels=range(len(space)))
    return metrics, space, kind, names


def classify(home: NodeHome, data_spec: str, *, model: str = "latest", split: str = "test",
             out: str | Path | None = None, batch_size: int = 256, pgd=None,
             device: str | None = None) -> ClassifyResult:
    """Classify `split` of `data_spec` with model `model`; metrics + confusion-matrix PNG.
    `model="latest"` is the model the node keeps by default (`atdnode.aggregation.keep.default_model`:
    the newest, or the node's own model where the `[aggregate] keep` policy kept it).
    With `pgd` (a protocols.adversarial.PGDConfig), also `metrics["robust_accuracy"]`.
    The model runs on `device` (atdnode.learning.device: else HOME's [compute] device, else CUDA if present)."""
    from atdnode.learning.device import resolve_device
    from atdnode.aggregation import default_model

    dev = resolve_device(device, home=home)  # a bad choice fails before any data loads
    record = default_model(home) if model == "latest" else ModelRegistry(home).get(model)
    cfg = ModelConfig.from_dict(record.model)
    data = load_dataset(data_spec, cfg.img_size, cfg.in_chans, split)
    store = BlobStore(home.blobs_dir)
    metrics, space, kind, names = score_record(store, record, data, batch_size=batch_size, device=dev)
    if pgd is not None:
        metrics["robust_accuracy"] = robust_accuracy_on(store, record, data, pgd=pgd, device=dev)
    caution = caution_for(dict(zip(data.classes, data.class_counts())))
    if caution is not None:  # a small split: every metric it affects carries the warning
        metrics["caution"] = caution.to_json()
    tag = hashlib.sha256(f"{data_spec}|{split}".encode()).hexdigest()[:8]
    png = Path(out) if out else home.root / "classify" / f"{record.id}-{tag}.png"
    from atdnode.data import public_data_spec as public_spec  # figure titles name no local path

    save_confusion_png(metrics["confusion"], space, png,
                       title=f"{kind} {record.id[:8]} on {public_spec(data_spec)} {split} "
                             f"(acc {metrics['accuracy']:.3f})")
    ModelRegistry(home).add_evaluation(record.id, {
        "data": data_spec, "split": split, "kind": kind, "png": str(png),
        "confusion": metrics["confusion"], "classes": list(space),  # the model card redraws it
        **{k: metrics[k] for k in ("n", "accuracy", "precision", "recall", "sensitivity", "f1", "robust_accuracy",
                                   "caution") if k in metrics}})
    return ClassifyResult(model_id=record.id, kind=kind, classes=space,
                          unknown_classes=[c for c in data.classes if c not in names], metrics=metrics, png=png)
