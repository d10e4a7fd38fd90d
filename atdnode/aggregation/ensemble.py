"""The node's downstream classifier for VGS-ATD (Eq. 7-8), shared by every mode.

`fit_node_ensemble` gathers CLS features of the node's own data under an extractor plus
the features peers sealed to it *with the same extractor* (`features` entries naming it;
`atd share-features`), and fits one `protocols.ensemble.EnsembleClassifier` (PCA -> MLP +
RF + SVM soft vote) over the union of their label spaces, on the parts in a canonical
order (by sender peer id) so nodes holding the same features fit the same classifier. It
is saved pickle-free (safetensors) as a blob. Horizontal (the paper's default, §3.1),
vertical and hierarchical aggregation all call it; `atdnode.models.load_ensemble` reads one back.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from atdnode import progress
from atdnode.aggregation.aggregate import AggregateError, blob_fields, entry_of
from atdnode.blobs import BlobStore
from atdnode.models import save_ensemble
from atdnode.aggregation.features_share import FeaturesError, addressed_to, node_features, open_features
from atdnode.node import NodeHome, NodeIdentity
from atdnode.learning import ModelConfig
from ledger import Entry, Ledger
from protocols.ensemble import EnsembleError
from protocols.vgs import fit_vertical_ensemble
from protocols.weightings import CLASSIFIERS  # horizontal: fused extractor + ensemble (paper), or averaged heads

DEFAULT_PRIOR = "balanced"  # class-prior correction, chosen by measurement (bench/prior_bench.py)


@dataclass(frozen=True)
class EnsembleOptions:
    """Ensemble hyper-parameters (VGS-ATD defaults; PCA is capped by feature width and samples)."""

    pca_components: int = 500
    mlp_hidden: tuple[int, ...] = (256,)
    mlp_max_iter: int = 300
    rf_trees: int = 100
    seed: int = 0
    # class-prior correction (protocols.ensemble, step 5); default chosen by measurement:
    # bench/prior_bench.py (numbers in its docstring)
    prior: str = DEFAULT_PRIOR

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
                 ) -> tuple[list[tuple[np.ndarray, np.ndarray, list[str]]], list[str], list[dict], int, int]:
    """Own features plus the peers' features made with `extractor`; returns
    (parts ordered by sender peer id, features entries used, skipped, own sample count,
    index of the own part).
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
    return [by_sender[s][0] for s in order], used, skipped, int(len(y)), order.index(ident.peer_id)


def fit_node_ensemble(home: NodeHome, ident: NodeIdentity, store: BlobStore, led: Ledger, *, cfg: ModelConfig,
                      extractor: str, data_spec: str, features: list[str] | None = None,
                      options: EnsembleOptions = EnsembleOptions()) -> EnsembleFit:
    """Fit the node's ensemble on its own and the shared features under `extractor`; store it."""
    with progress.task("features of the node's own data, and the shared feature sets", total=None):
        parts, used, skipped, own_n, own = gather_parts(home, ident, store, led, cfg=cfg, extractor=extractor,
                                                        data_spec=data_spec, features=features)

    n = int(sum(len(p[1]) for p in parts))
    with progress.task(f"fitting PCA + MLP + RF + SVM on {n} samples", total=1) as step:
        try:
            ens, classes = fit_vertical_ensemble(parts, own=own, **options.kwargs())
        except EnsembleError as exc:
            raise AggregateError(f"cannot fit the ensemble: {exc}") from None
        step.advance()
    return EnsembleFit(blob=save_ensemble(store, ens), classes=list(classes), features=used, skipped=skipped,
                       samples=int(sum(len(p[1]) for p in parts)), own_samples=own_n)
