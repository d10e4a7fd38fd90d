"""Vertical VGS-ATD on a node: fused extractor -> CLS features -> PCA -> MLP + RF + SVM soft vote.

`aggregate_vertical` runs the node's side of vertical mode:

1. fuse: a weighted average of the chosen published extractors (heads never take part),
   stored as a blob (bit-reproducible: nodes fusing the same inputs get the same hash);
2. CLS features of the node's own training data under the fused extractor (cached);
3. the features peers sealed to this node *with the same fused extractor* (`features`
   entries naming it; `atd share-features`): others are skipped, or refused when named;
4. one `protocols.ensemble.EnsembleClassifier` over the union of the label spaces, fitted
   on the parts in a canonical order (by sender peer id) — so nodes holding the same
   features fit the same classifier — and saved pickle-free (safetensors) as a blob;
5. a signed `aggregate` entry (mode vertical; `ensemble`: blob, classes, the features
   entries used, sample count) and a registry record whose `blobs["ensemble"]` makes
   `atd classify` predict with the ensemble.

The typical run is twice: fuse (own features only), `atd share-features` with the fused
model, then fuse again once peers' features arrived (same fused blob, richer ensemble).
`fit_node_ensemble` is shared with hierarchical mode.
"""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from atdnode.aggregate import (
    AggregateError,
    AggregateResult,
    average_entries,
    blob_fields,
    entry_of,
    input_weights,
    opened,
    own_model,
    register_global,
    select_inputs,
)
from atdnode.blobstore import BlobStore
from atdnode.errors import BlobError
from atdnode.features_share import FeaturesError, addressed_to, data_spec_of, node_features, open_features
from atdnode.home import NodeHome
from atdnode.identity import NodeIdentity
from atdnode.model import ModelConfig
from ledger import Entry, Ledger
from protocols.ensemble import EnsembleClassifier, EnsembleError
from protocols.vgs import fit_vertical_ensemble


@dataclass(frozen=True)
class EnsembleOptions:
    """Ensemble hyper-parameters (VGS-ATD defaults; PCA is capped by feature width and samples)."""

    pca_components: int = 500
    mlp_hidden: tuple[int, ...] = (256,)
    mlp_max_iter: int = 300
    rf_trees: int = 100
    seed: int = 0

    def kwargs(self) -> dict:
        return {**asdict(self), "mlp_hidden": list(self.mlp_hidden)}


@dataclass
class EnsembleFit:
    blob: str
    classes: list[str]
    features: list[str]  # features entries whose contents were used
    skipped: list[dict] = field(default_factory=list)  # {"entry", "why"} for those left out
    samples: int = 0
    own_samples: int = 0

    def record(self, store: BlobStore) -> dict:
        """For the `aggregate` entry body."""
        return {**blob_fields(store, self.blob), "classes": self.classes, "features": self.features,
                "samples": self.samples, "own_samples": self.own_samples}


def _candidate_features(led: Ledger, ident: NodeIdentity, named: list[str] | None) -> list[Entry]:
    if named:
        return [entry_of(led, h, ("features",), "features") for h in named]
    return [e for e in addressed_to(led, ident.peer_id) if e.author != ident.public_key]


def gather_parts(home: NodeHome, ident: NodeIdentity, store: BlobStore, led: Ledger, *, cfg: ModelConfig,
                 extractor: str, data_spec: str, features: list[str] | None = None
                 ) -> tuple[list[tuple[np.ndarray, np.ndarray, list[str]]], list[str], list[dict], int]:
    """Own features plus the peers' features made with `extractor`; returns
    (parts ordered by sender peer id, features entries used, skipped, own sample count).
    Named features (`features`) that cannot be used are an error."""
    X, y, classes = node_features(home, store, cfg, extractor, data_spec)
    by_sender: dict[str, tuple[tuple[np.ndarray, np.ndarray, list[str]], str | None]] = {
        ident.peer_id: ((X, y, classes), None)}
    skipped: list[dict] = []
    for e in _candidate_features(led, ident, features):
        eid = e.id.hex()
        why = None
        recipient = ident.peer_id in (e.body.get("recipients") or [])
        if e.author == ident.public_key:
            why = "this node's own features (its data is used directly)"
        elif recipient and e.body.get("extractor") != extractor:  # not worth decrypting
            why = (f"made with extractor {str(e.body.get('extractor'))[:12]}, not this node's "
                   f"{extractor[:12]} (the sender fused other inputs, or has not re-shared)")
        else:  # a non-recipient gets the envelope's own refusal
            try:
                op = open_features(ident, store, led, e)
            except FeaturesError as exc:
                if features:
                    raise
                why = str(exc)
            else:
                if op.X.shape[1] != X.shape[1]:
                    why = f"{op.X.shape[1]} features per sample, this extractor gives {X.shape[1]}"
                else:
                    by_sender[op.sender] = ((op.X, op.y, op.classes), eid)  # a later share replaces an earlier one
        if why is not None:
            if features:
                raise FeaturesError(f"features {eid[:16]}: {why}")
            skipped.append({"entry": eid, "why": why})
    order = sorted(by_sender)
    used = [by_sender[s][1] for s in order if by_sender[s][1] is not None]
    return [by_sender[s][0] for s in order], used, skipped, int(len(y))


def save_ensemble(store: BlobStore, ens: EnsembleClassifier) -> str:
    """Store the fitted ensemble as a safetensors blob (no pickle); returns its hash."""
    with tempfile.TemporaryDirectory(prefix="atd-ensemble-") as tmp:
        path = Path(tmp) / "ensemble.safetensors"
        ens.save(path)
        return store.put_file(path)


def load_ensemble(store: BlobStore, blob: str) -> EnsembleClassifier:
    """A stored ensemble, hash-checked and shape-validated (EnsembleClassifier.load)."""
    try:
        store.verify(blob)
        return EnsembleClassifier.load(store.path(blob))
    except (BlobError, EnsembleError) as exc:
        raise AggregateError(f"ensemble {blob[:16]}: {exc}") from None


def fit_node_ensemble(home: NodeHome, ident: NodeIdentity, store: BlobStore, led: Ledger, *, cfg: ModelConfig,
                      extractor: str, data_spec: str, features: list[str] | None = None,
                      options: EnsembleOptions = EnsembleOptions()) -> EnsembleFit:
    """Fit the node's ensemble on its own and the shared features under `extractor`; store it."""
    parts, used, skipped, own_n = gather_parts(home, ident, store, led, cfg=cfg, extractor=extractor,
                                               data_spec=data_spec, features=features)
    try:
        ens, classes = fit_vertical_ensemble(parts, **options.kwargs())
    except EnsembleError as exc:
        raise AggregateError(f"cannot fit the ensemble: {exc}") from None
    return EnsembleFit(blob=save_ensemble(store, ens), classes=list(classes), features=used, skipped=skipped,
                       samples=int(sum(len(p[1]) for p in parts)), own_samples=own_n)


def aggregate_vertical(home: NodeHome, *, weighting: str = "uniform", inputs: list[str] | None = None,
                       q: float = 1.0, data_spec: str | None = None, features: list[str] | None = None,
                       options: EnsembleOptions = EnsembleOptions()) -> AggregateResult:
    """Fuse published extractors, fit the ensemble, record an `aggregate` entry, register the model."""
    with opened(home) as (ident, store, led):
        base = own_model(home)
        spec = data_spec_of(base, data_spec)
        chosen = select_inputs(home, led, store, ids=inputs, parts=("extractor", "full") if inputs else ("extractor",))
        weights = input_weights(store, chosen, weighting, q=q, head=False)
        blob, part = average_entries(store, chosen, weights, head=False, mode="vertical", weighting=weighting)
        fit = fit_node_ensemble(home, ident, store, led, cfg=ModelConfig.from_dict(base.model), extractor=blob,
                                data_spec=spec, features=features, options=options)
        ids = [e.id.hex() for e in chosen]
        body = {"mode": "vertical", "weighting": weighting, "q": float(q), "weights": weights, "inputs": ids,
                "head": False, "part": part, **blob_fields(store, blob), "model": base.model,
                "ensemble": fit.record(store)}
        entry = led.append(ident.signer, "aggregate", body)
    model_id = register_global(home, store, base=base, blob=blob, part=part, entry=entry, kind="global-vertical",
                               extra_blobs={"ensemble": fit.blob},
                               extra_provenance={"data": spec, "ensemble_classes": fit.classes,
                                                 "features": fit.features})
    details = {"ensemble": fit.blob, "classes": fit.classes, "features": fit.features, "skipped": fit.skipped,
               "samples": fit.samples}
    return AggregateResult(entry=entry, blob=blob, weights=weights, inputs=ids, model_id=model_id, head=False,
                           details=details)
