"""The node's local model registry (HOME/models) and its in-progress training runs (HOME/runs).

Models: one JSON file per trained model.

A record names everything needed to rebuild, compare or publish the model: its config,
label space (+ fingerprint), training sample count, test metrics, the blob hashes of the
full / extractor / head weight sets, provenance (data spec, init-from blob, run key) and
its creation time. The id is a hash of the record's content, so the same record written
twice is one file. Files are written atomically (tmp + fsync + rename).

Runs: `RunCheckpoint` keeps the last finished epoch of a run as our own files, without
pickle: model state as safetensors, the optimizer's tensors flattened into a second
safetensors file, and its scalar parts plus the run's history in `state.json`, which is
replaced atomically last — so a kill at any moment leaves the previous epoch intact.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atdnode.blobs import fsync
from atdnode.errors import ConfigError
from atdnode.node import NodeHome

if TYPE_CHECKING:  # torch is imported lazily: `atd models` should not pay for it
    import torch

    from ledger import Ledger


@dataclass
class ModelRecord:
    """A registered model: its config, label space, metrics, weight-set blobs and provenance;
    the id is the hash of its content, so a record never changes (evaluations are kept beside it)."""

    model: dict  # ModelConfig.to_dict()
    labels: list[str]
    label_fp: str
    samples: int
    metrics: dict
    blobs: dict  # {"full": hex, "extractor": hex, "head": hex}
    provenance: dict = field(default_factory=dict)  # data, init_from, run_key, seed, ...
    files: dict = field(default_factory=dict)  # e.g. {"confusion_png": path relative to home}
    created: float = field(default_factory=time.time)
    id: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelRecord":
        try:
            return cls(**d)
        except TypeError as exc:
            raise ConfigError(f"bad model record: {exc}") from None

    def content_id(self) -> str:
        body = {k: v for k, v in self.to_dict().items() if k != "id"}
        raw = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(raw.encode()).hexdigest()[:16]


RAW_PIXELS = "raw-pixels"  # provenance kind of a node's raw-pixel ensemble: no weights, it reads flattened pixels


def is_raw_pixels(record: "ModelRecord") -> bool:
    """Whether `record` is a raw-pixel ensemble (`atdnode.aggregation.keep`: what a node has alone)."""
    return (record.provenance or {}).get("kind") == RAW_PIXELS


def answer_classes(record: "ModelRecord") -> list[str]:
    """The classes `record`'s model answers: its ensemble's (`provenance["ensemble_classes"]`,
    the union of the consortium's label spaces for an aggregate) where it predicts with one,
    else its head's, `labels` (for an aggregate, the node's own label space)."""
    if record.blobs.get("ensemble"):
        return list((record.provenance or {}).get("ensemble_classes") or [])
    return list(record.labels)


MADE_BY = {"global-horizontal": "horizontal", "global-vertical": "vertical", "global-hierarchical": "hierarchical"}


def made_by(record: "ModelRecord") -> str:
    """How the model was made: trained | horizontal | vertical | hierarchical | split | <other kind>."""
    kind = record.provenance.get("kind")
    if not kind:
        return "trained"
    if kind in MADE_BY:
        return MADE_BY[kind]
    return "split" if str(kind).startswith("split") else str(kind)


class ModelRegistry:
    """`add(record) -> id`, `get(id | prefix | "latest")`, `list()` (oldest first),
    `add_evaluation(id, metrics)` / `evaluations(id)` (later scores, e.g. `atd classify`,
    kept in models/evals/<id>.json: the record's id is a hash of its content, so the record
    itself never changes), `remove(id)`. Writers of new models go through
    `atdnode.models.gc.register_model`, which adds the record and applies `[models] max_bytes`."""

    def __init__(self, home: NodeHome) -> None:
        self.dir = home.models_dir
        self.evals_dir = home.models_dir / "evals"

    @classmethod
    def of(cls, home: NodeHome) -> "ModelRegistry":
        """The model registry of node `home`, opened once per `NodeHandle` (atdnode.node.handle)."""
        from atdnode.node import NodeHandle

        return NodeHandle.of(home).part(cls)

    def add(self, record: ModelRecord) -> str:
        record.id = record.content_id()
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{record.id}.json"
        _write_json(path, record.to_dict())
        return record.id

    def _load(self, path: Path) -> ModelRecord:
        try:
            return ModelRecord.from_dict(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: unreadable model record ({exc})") from None

    def list(self) -> list[ModelRecord]:
        if not self.dir.is_dir():
            return []
        recs = [self._load(p) for p in self.dir.glob("*.json")]
        return sorted(recs, key=lambda r: (r.created, r.id))

    def get(self, ref: str = "latest") -> ModelRecord:
        if ref == "latest":
            recs = self.list()
            if not recs:
                raise ConfigError(f"no trained models in {self.dir} (run `atd train` first)")
            return recs[-1]
        from atdnode.ids import unique  # the one prefix rule for every kind of id

        ids = [p.stem for p in self.dir.glob("*.json")] if self.dir.is_dir() else []
        found = unique(ref, ids, what="model", hexadecimal=False, where=f"in {self.dir} (see `atd models`)")
        return self._load(self.dir / f"{found}.json")

    def path(self, model_id: str) -> Path:
        return self.dir / f"{model_id}.json"

    def add_evaluation(self, model_id: str, evaluation: dict) -> None:
        """Append one scoring of the model (JSON-able dict; a "time" is added)."""
        self.evals_dir.mkdir(parents=True, exist_ok=True)
        path = self.evals_dir / f"{model_id}.json"
        _write_json(path, [*self.evaluations(model_id), {"time": time.time(), **evaluation}])

    def evaluations(self, model_id: str) -> list[dict]:
        path = self.evals_dir / f"{model_id}.json"
        if not path.is_file():
            return []
        try:
            evals = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: unreadable evaluations ({exc})") from None
        return evals if isinstance(evals, list) else []

    def latest_metrics(self, record: ModelRecord) -> tuple[dict, str]:
        """(metrics, where from): the newest evaluation, else the record's own test metrics."""
        evals = self.evaluations(record.id)
        if evals:
            e = evals[-1]
            return e, f"{e.get('data', '?')} [{e.get('split', '?')}]"
        return record.metrics, ("training test split" if record.metrics else "")

    def add_recorded(self, record: ModelRecord, entry_id: bytes, led: "Ledger") -> str:
        """`add(record)` for a model an aggregate entry describes, only once ledger `led` holds
        that entry (own appends are durable when `append` returns), so a crash can never
        leave a record without its entry. ConfigError when it does not."""
        if led.state(entry_id) is None:
            raise ConfigError(f"aggregate entry {entry_id.hex()[:16]} is not in the ledger: its model is not registered")
        return self.add(record)

    def drop_unrecorded(self, led) -> list[str]:
        """Remove the records of global models whose aggregate entry `led` does not hold (left by
        an `atd aggregate` killed between registering and appending, in versions that did it in
        that order); returns their ids. Run when a node starts."""
        gone = []
        for rec in self.list():
            agg = rec.provenance.get("aggregate")
            if not str(rec.provenance.get("kind", "")).startswith("global") or not isinstance(agg, str):
                continue
            try:
                held = led.state(agg) is not None
            except ValueError:
                held = False
            if not held:
                self.remove(rec.id)
                gone.append(rec.id)
        return gone

    def remove(self, model_id: str) -> None:
        """Delete the record and its evaluations (blobs are the caller's business: atdnode.models.gc)."""
        self.path(model_id).unlink(missing_ok=True)
        (self.evals_dir / f"{model_id}.json").unlink(missing_ok=True)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        fsync(f.fileno())
    os.replace(tmp, path)


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
    with open(tmp, "rb") as f:
        fsync(f.fileno())
    os.replace(tmp, path)


def flatten_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """optimizer.state_dict() -> (tensors "state.<param>.<name>", JSON-able rest)."""
    import torch

    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{pid}.{name}"] = v
            else:
                scalars[f"{pid}.{name}"] = v
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"groups": groups, "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = v
    for key, v in rest["scalars"].items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in rest["groups"]]
    return {"state": state, "param_groups": groups}


class RunCheckpoint:
    """The resumable state of one training run, in `dir` (HOME/runs/<run key>)."""

    def __init__(self, dir: Path) -> None:
        self.dir = Path(dir)
        self.state_file = self.dir / "state.json"

    def read(self) -> dict:
        """{} when the run never finished an epoch; else {"epoch", "history", "done", ...}."""
        if not self.state_file.is_file():
            return {}
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{self.state_file}: unreadable run state ({exc}); delete the folder to restart") from None

    def save(self, epoch: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, history: list) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        mfile, ofile = f"model-e{epoch}.safetensors", f"optim-e{epoch}.safetensors"
        _save_tensors(model.state_dict(), self.dir / mfile)
        otensors, orest = flatten_optimizer(optimizer.state_dict())
        _save_tensors(otensors, self.dir / ofile)
        old = self.read()
        _write_json(self.state_file, {"epoch": epoch, "model": mfile, "optim": ofile, "optim_rest": orest,
                                      "history": history, "done": False})
        for name in (old.get("model"), old.get("optim")):
            if name and name not in (mfile, ofile):
                (self.dir / name).unlink(missing_ok=True)

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Load the last finished epoch into model + optimizer; returns that epoch count."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        st = self.read()
        try:
            msd = load_file(str(self.dir / st["model"]))
            otensors = load_file(str(self.dir / st["optim"]))
            model.load_state_dict(msd)
            optimizer.load_state_dict(unflatten_optimizer(otensors, st["optim_rest"]))
        except (OSError, KeyError, ValueError, RuntimeError, SafetensorError) as exc:
            raise ConfigError(f"{self.dir}: cannot resume ({exc}); delete the folder to restart") from None
        return int(st["epoch"])

    def finish(self, model_id: str) -> None:
        st = self.read()
        for name in (st.get("model"), st.get("optim")):
            if name:
                (self.dir / name).unlink(missing_ok=True)
        _write_json(self.state_file, {"epoch": st.get("epoch"), "history": st.get("history", []),
                                      "done": True, "model_id": model_id})


def extractor_blob_of(home: NodeHome, ref: str) -> str | None:
    """The extractor blob of registered model ``ref`` (id or unique prefix), or None when no
    model matches (what `atd train --init-from` tries after files and blobs; an MSD base is one such model)."""
    reg = ModelRegistry.of(home)
    ids = [p.stem for p in reg.dir.glob("*.json")] if reg.dir.is_dir() else []
    if not any(i.startswith(ref) for i in ids):
        return None
    record = reg.get(ref)  # an ambiguous or too short prefix is an IdError naming the matches
    return record.blobs.get("extractor") or record.blobs.get("full")
