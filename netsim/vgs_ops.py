"""The VGS-ATD protocol steps of one node, run in-process against its real home.

Every step is the library call the CLI makes for the same command — `atd train`
(`atdnode.training.train`), `atd publish-weights` (`atdnode.publish.publish_weights`),
`atd aggregate --mode horizontal` (`atdnode.aggregate.aggregate_horizontal`) — or, for
the steps the CLI reaches through `protocols` (hierarchical combination, sealed feature
sharing, the ensemble), the same `protocols` functions with the results written to the
node's blob store, registry and ledger. The bytes move between nodes only through the
daemons (gossip of the signed entries, the blob protocol for weights and features), so
what the network counted is what the protocol cost.
"""
from __future__ import annotations

import hashlib
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from sklearn.exceptions import ConvergenceWarning

from atdnode.blobstore import BlobStore
from atdnode.data import LabeledImages
from atdnode.features import extract_features
from atdnode.home import NodeHome
from atdnode.model import ModelConfig, build_model, load_part
from atdnode.registry import ModelRecord, ModelRegistry
from atdnode.training import TrainOptions, train
from atdnode.weights import load_weights, save_weights
from ledger import Ledger, Signer
from netsim.homes import node_seed
from protocols.ensemble import EnsembleClassifier
from protocols.feature_crypto import open_sealed, public_bytes, seal
from protocols.hierarchical import GroupModel, combine_groups
from protocols.vgs import fit_vertical_ensemble


@dataclass(frozen=True)
class Pub:
    """Something a node published: a signed entry naming a blob."""

    node: str
    entry: str  # hex entry id
    blob: str
    manifest: str  # hash of the blob's chunk manifest, as the signed entry names it
    kind: str  # weights | features
    part: str  # full | extractor | features
    labels: tuple[str, ...]
    samples: int


@dataclass
class Step:
    """What one node did in one step: the result and its compute time (wall clock)."""

    seconds: float
    model_id: str | None = None
    pub: Pub | None = None
    detail: dict = field(default_factory=dict)


class NodeOps:
    """Protocol steps for the node `name` whose home is `home` (its daemon runs elsewhere)."""

    def __init__(self, name: str, home: NodeHome, *, seed: int, spec: str, cfg: ModelConfig) -> None:
        self.name, self.home, self.seed, self.spec, self.cfg = name, home, seed, spec, cfg
        self.signer = Signer.from_seed(node_seed(seed, name))
        self.x25519 = X25519PrivateKey.from_private_bytes(node_seed(seed, name, "x25519"))
        self.store = BlobStore(home.blobs_dir)
        self.registry = ModelRegistry(home)

    @property
    def peer_id(self) -> str:
        return self.signer.peer_id

    @property
    def x25519_public(self) -> bytes:
        return public_bytes(self.x25519)

    def _append(self, kind: str, body: dict):
        with Ledger.open(self.home.ledger_db) as led:  # what a CLI command does
            return led.append(self.signer, kind, body)

    # -- training and publishing -------------------------------------------------------

    def train(self, opts: TrainOptions) -> Step:
        t0 = time.perf_counter()
        rec = train(self.home, self.spec, self.cfg, opts)
        return Step(time.perf_counter() - t0, model_id=rec.id, detail={"test": _metrics(rec.metrics)})

    def publish(self, model_id: str, part: str) -> Step:
        from atdnode.publish import publish_weights

        t0 = time.perf_counter()
        p = publish_weights(self.home, model=model_id, part=part)
        rec = self.registry.get(model_id)
        pub = Pub(self.name, p.entry.id.hex(), p.blob, p.entry.body["manifest"], "weights", part, tuple(rec.labels),
                  int(rec.samples))
        return Step(time.perf_counter() - t0, model_id=model_id, pub=pub)

    def aggregate(self, inputs: list[Pub], weighting: str) -> Step:
        from atdnode.aggregate import aggregate_horizontal

        t0 = time.perf_counter()
        res = aggregate_horizontal(self.home, weighting=weighting, inputs=[p.entry for p in inputs])
        return Step(time.perf_counter() - t0, model_id=res.model_id,
                    detail={"weights": [round(w, 6) for w in res.weights], "entry": res.entry.id.hex()})

    def combine_groups(self, groups: list[tuple[str, Pub, int, int]], weighting: str) -> Step:
        """Hierarchical step: combine group extractors (name, published extractor, classes,
        base models) with `protocols.hierarchical`; the node's model becomes the combined
        extractor plus its own head; an `aggregate` entry records how."""
        t0 = time.perf_counter()
        models = []
        for gname, pub, n_classes, n_models in groups:
            tensors, _ = load_weights(self.store, pub.blob)
            models.append(GroupModel(gname, lambda t=tensors: t, n_classes=n_classes, n_models=n_models))
        comb = combine_groups(models, weighting=weighting)
        own = self.registry.get("latest")
        full, meta = load_weights(self.store, own.blobs["full"])
        ext_meta = {**meta, "part": "extractor", "aggregate": {"mode": "hierarchical", "weighting": weighting}}
        ext_blob = save_weights(self.store, comb.tensors, ext_meta)
        body = {"mode": "hierarchical", "weighting": weighting, "weights": [float(w) for w in comb.weights],
                "groups": [g.record() for g in models], "inputs": [pub.entry for _, pub, _, _ in groups],
                "part": "extractor", "blob": ext_blob, "size": self.store.size(ext_blob),
                "manifest": self.store.manifest(ext_blob).hash, "model": own.model}
        entry = self._append("aggregate", body)
        full.update(comb.tensors)
        full_blob = save_weights(self.store, full, {**meta, "part": "full", "aggregate": entry.id.hex()})
        rec = ModelRecord(model=own.model, labels=own.labels, label_fp=own.label_fp, samples=own.samples,
                          metrics={}, blobs={"full": full_blob, "extractor": ext_blob},
                          provenance={"aggregate": entry.id.hex(), "entries": body["inputs"],
                                      "kind": "global-hierarchical"})
        model_id = self.registry.add(rec)
        return Step(time.perf_counter() - t0, model_id=model_id,
                    detail={"weights": [round(float(w), 6) for w in comb.weights], "entry": entry.id.hex()})

    # -- models and features -----------------------------------------------------------

    def load_model(self, model_id: str) -> torch.nn.Module:
        rec = self.registry.get(model_id)
        cfg = ModelConfig.from_dict(rec.model)
        model = build_model(cfg)
        tensors, _ = load_weights(self.store, rec.blobs["full"])
        load_part(model, tensors, "full")
        model.eval()
        return model

    def share_features(self, model_id: str, data: LabeledImages, recipients: dict[str, tuple[str, bytes]]) -> Step:
        """Extract CLS features of `data` with the model's extractor, seal them (with labels)
        to `recipients` (node -> (peer id, X25519 public key)) and publish a `features` entry."""
        t0 = time.perf_counter()
        X, y = extract_features(self.load_model(model_id), data)
        sealed = seal(X, y, data.classes, {pid: pub for pid, pub in recipients.values()}, self.x25519,
                      sender_id=self.peer_id)
        blob = self.store.put_bytes(sealed)
        body = {"blob": blob, "size": len(sealed), "manifest": self.store.manifest(blob).hash,
                "recipients": sorted(pid for pid, _ in recipients.values()), "labels": list(data.classes),
                "samples": int(len(y)), "dim": int(X.shape[1]), "model_id": model_id}
        entry = self._append("features", body)
        pub = Pub(self.name, entry.id.hex(), blob, body["manifest"], "features", "features", tuple(data.classes),
                  int(len(y)))
        return Step(time.perf_counter() - t0, pub=pub, detail={"X": X, "y": y})

    def open_features(self, pub: Pub) -> tuple[np.ndarray, np.ndarray, list[str]]:
        opened = open_sealed(self.store.get_bytes(pub.blob), self.x25519, self.peer_id)
        return opened.features, opened.labels, opened.class_names

    def has_entry(self, pub: Pub) -> bool:
        with Ledger.open(self.home.ledger_db) as led:
            return led.get(bytes.fromhex(pub.entry)) is not None

    def has(self, pub: Pub) -> bool:
        return self.store.has(pub.blob) and self.has_entry(pub)


# ------------------------------------------------------------------ ensembles

class EnsembleCache:
    """Ensembles by the exact data they were fitted on. Nodes that hold the same shared
    features fit the same ensemble (fixed seed, canonical order), so it is fitted once and
    each node is charged the measured fitting time, as if it had fitted it itself."""

    def __init__(self, *, seed: int, pca_components: int, mlp_max_iter: int) -> None:
        self.params = dict(seed=seed, pca_components=pca_components, mlp_max_iter=mlp_max_iter)
        self._cache: dict[str, tuple[EnsembleClassifier, list[str], float]] = {}

    def fit(self, parts: list[tuple[np.ndarray, np.ndarray, list[str]]], classes: list[str]) -> tuple[EnsembleClassifier, list[str], float]:
        h = hashlib.sha256(repr(sorted(self.params.items())).encode() + "|".join(classes).encode())
        for X, y, names in parts:
            h.update(np.ascontiguousarray(X).tobytes())
            h.update(np.ascontiguousarray(y).tobytes())
            h.update("|".join(names).encode())
        key = h.hexdigest()
        if key not in self._cache:
            t0 = time.perf_counter()
            with warnings.catch_warnings():  # a capped MLP epoch count is a setting, not news
                warnings.simplefilter("ignore", ConvergenceWarning)
                ens, names = fit_vertical_ensemble(parts, classes=classes, **self.params)
            self._cache[key] = (ens, names, time.perf_counter() - t0)
        return self._cache[key]


def _metrics(m: dict) -> dict:
    return {k: round(float(m[k]), 6) for k in ("accuracy", "f1") if k in m}

