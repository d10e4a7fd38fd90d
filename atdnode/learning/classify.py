"""Predict with the node's model on a data spec and score it (`atd classify`).

A registry record with an ensemble (`blobs["ensemble"]`, from vertical or hierarchical
aggregation) predicts with CLS features of its extractor -> the ensemble, over the
ensemble's classes (`provenance["ensemble_classes"]`); any other record predicts with its
own head over its `labels`.

Which images are scored (`split`, default `auto`): every image of a source that declares
no splits (a plain class-folder tree), the test split of one that does (train / val / test
folders, npz, a `split` column) -- and the test split of the very source the model was
trained on, whose other images it has seen. `all`, `train`, `val`, `test` choose explicitly.

The classifier's classes and the data's are matched by name. Test samples of a class the
classifier does not know count as errors (and are listed as `unknown_classes`). The metrics
are `atdnode.learning.metrics.classification_metrics` over the probabilities: accuracy,
macro precision / sensitivity (recall) / F1 over the classes present, n per class, 95 %
intervals, sensitivity / specificity / AUROC for two classes, and calibration; the
confusion matrix (rows true, columns predicted) spans the data's classes followed by any
other class the classifier predicted. Both the confusion matrix and the reliability plot
are written as PNGs. Optionally, accuracy under a PGD attack (protocols.adversarial; head
models only).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from atdnode import progress
from atdnode.blobs import BlobStore
from atdnode.data import DataSource, load_dataset, resolve_data
from atdnode.data import caution_for
from atdnode.node import NodeHandle, NodeHome
from atdnode.learning.metrics import STORED, named_metrics, save_confusion_png, save_reliability_png
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
    split: str = "test"  # the split scored: train | val | test | all
    why: str = ""  # why that split, in words
    reliability_png: Path | None = None

    def to_json(self) -> dict:
        m = self.metrics
        return {"model": self.model_id, "kind": self.kind, "split": self.split, "split_reason": self.why,
                **{k: m[k] for k in STORED if k in m},
                "classes": self.classes, "unknown_classes": self.unknown_classes, "confusion": m["confusion"],
                "png": str(self.png), "reliability_png": str(self.reliability_png) if self.reliability_png else None}


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
                 device: torch.device | str | None = None) -> tuple[dict, list[str], str, list[str], np.ndarray]:
    """(metrics, confusion-matrix classes, kind, the classifier's classes, the predicted index
    into the confusion-matrix classes per image) of `record` on labelled images `data` (whose
    label indices are the same indices: its classes come first); the model runs on `device`
    (atdnode.learning.device rule)."""
    from atdnode.learning.device import resolve_device

    names, probs, kind = class_probabilities(store, record, data.images, device=resolve_device(device),
                                             batch_size=batch_size)
    if not set(names) & set(data.classes):
        raise ClassifyError(f"model {record.id} knows classes {names[:12]}, none of the data's {data.classes[:12]}")
    space = list(data.classes) + [c for c in names if c not in data.classes]
    index = {c: i for i, c in enumerate(space)}
    y_true = np.asarray([index[data.classes[int(t)]] for t in data.labels], dtype=np.int64)
    y_pred = np.asarray([index[names[int(p)]] for p in probs.argmax(1)], dtype=np.int64)
    p_space = np.zeros((len(y_true), len(space)), dtype=np.float64)  # a class it does not know: probability 0
    p_space[:, [index[c] for c in names]] = probs
    return named_metrics(y_true, y_pred, classes=space, probs=p_space), space, kind, names, y_pred


def choose_split(record: ModelRecord, data_spec: "str | DataSource", split: str) -> tuple[str, str]:
    """(split to score, why, in words) for `split` = auto | all | train | val | test (see the
    module docstring); `data_spec` may be the `DataSource` the caller resolved."""
    from atdnode.data import declared_splits
    from atdnode.data import DataSpec

    if split != "auto":
        return split, "as asked"
    declared = declared_splits(data_spec)
    if declared:
        pick = "test" if "test" in declared else declared[-1]
        return pick, f"the data declares its splits ({', '.join(declared)})"
    trained = (record.provenance or {}).get("data")
    spec = data_spec.spec if isinstance(data_spec, DataSource) else data_spec
    if isinstance(trained, str) and _same_source(trained, spec, DataSpec):
        return "test", "the model was trained on this data's seeded 80 % train split; its 20 % test split is unseen"
    return "all", "the data declares no splits: every image is scored"


def _same_source(a: str, b: str, spec_type) -> bool:
    try:
        x, y = spec_type.parse(a), spec_type.parse(b)
    except Exception:  # noqa: BLE001 - an old record's spec that no longer parses is not this data
        return False
    if x.source != y.source:
        return False
    if x.path is None or y.path is None:
        return x.path == y.path
    return Path(x.path).expanduser().resolve() == Path(y.path).expanduser().resolve()


def classify(home: NodeHome, data_spec: str, *, model: str = "latest", split: str = "auto",
             out: str | Path | None = None, batch_size: int = 256, pgd=None,
             device: str | None = None) -> ClassifyResult:
    """Classify `split` of `data_spec` (`auto`: see `choose_split`) with model `model`;
    metrics + confusion-matrix and reliability PNGs, stored as one evaluation of the model.
    `model="latest"` is the model the node uses (`atdnode.models.model_in_use`:
    the newest, or the node's own model where the `[aggregate] keep` policy kept it).
    With `pgd` (a protocols.adversarial.PGDConfig), also `metrics["robust_accuracy"]`.
    The model runs on `device` (atdnode.learning.device: else HOME's [compute] device, else CUDA if present)."""
    from atdnode.learning.device import resolve_device
    from atdnode.models import chosen_on_test, resolve_model

    home = NodeHandle.of(home)  # its config and registry: opened once for the steps below
    dev = resolve_device(device, home=home)  # a bad choice fails before any data loads
    record = resolve_model(home, model)
    cfg = ModelConfig.from_dict(record.model)
    from atdnode.data import public_data_spec as public_spec  # progress and figure titles name no local path

    source = resolve_data(data_spec)  # parsed and listed once for the split's choice and its reading
    split, why = choose_split(record, source, split)
    with progress.task(f"reading {public_spec(data_spec)} [{split}]", total=None):
        data = load_dataset(source, cfg.img_size, cfg.in_chans, split)
    store = BlobStore.of(home)
    with progress.task(f"classifying {len(data.labels)} images with model {record.id[:12]}", total=len(data.labels)) as t:
        metrics, space, kind, names, _ = score_record(store, record, data, batch_size=batch_size, device=dev)
        t.update(len(data.labels))
    if pgd is not None:
        with progress.task(f"PGD attack on {len(data.labels)} images", total=None):
            metrics["robust_accuracy"] = robust_accuracy_on(store, record, data, pgd=pgd, device=dev)
    caution = caution_for(dict(zip(data.classes, data.class_counts())))
    if caution is not None:  # a small split: every metric it affects carries the warning
        metrics["caution"] = caution.to_json()
    chosen = chosen_on_test(record) or (chosen_on_test(ModelRegistry.of(home).get("latest")) if model == "latest" else None)
    if chosen and split == "test":  # the model was picked on this very split (val=test), kept or not
        metrics["warning"] = chosen
    tag = hashlib.sha256(f"{data_spec}|{split}".encode()).hexdigest()[:8]
    png = Path(out) if out else home.root / "classify" / f"{record.id}-{tag}.png"

    save_confusion_png(metrics["confusion"], space, png,
                       title=f"{kind} {record.id[:8]} on {public_spec(data_spec)} {split} "
                             f"(acc {metrics['accuracy']:.3f}, n={metrics['n']})")
    rel = save_reliability_png(metrics["calibration"], png.with_name(png.stem + "-reliability.png"),
                               title=f"{kind} {record.id[:8]} on {public_spec(data_spec)} {split}: reliability")
    ModelRegistry.of(home).add_evaluation(record.id, {
        "data": data_spec, "split": split, "kind": kind, "png": str(png), "reliability_png": str(rel),
        "confusion": metrics["confusion"], "classes": list(space),  # the model card redraws it
        **{k: metrics[k] for k in STORED if k in metrics}})
    return ClassifyResult(model_id=record.id, kind=kind, classes=space,
                          unknown_classes=[c for c in data.classes if c not in names], metrics=metrics, png=png,
                          split=split, why=why, reliability_png=rel)
