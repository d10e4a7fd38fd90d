"""The VGS-ATD protocol steps of one node, run in-process against its real home.

Every step is exactly the library call the CLI makes for the same command, and nothing
else: `atd train` (`atdnode.learning.training.train`), `atd publish-weights`
(`atdnode.models.publish.publish_weights`), `atd share-features`
(`atdnode.aggregation.features_share.share_features`), `atd aggregate --mode horizontal | vertical |
hierarchical` (`atdnode.aggregation.modes.aggregate`, the CLI's own dispatch onto the modes),
`atd aggregate --verify` (`atdnode.aggregation.verify.verify_aggregate`) and `atd classify`'s
predictor (`atdnode.learning.classify.predict_names`). netsim keeps no fusion, combining, ensemble
or entry-writing code of its own. The bytes move between nodes only through the daemons
(gossip of the signed entries, the blob protocol for weights, features and aggregates), so
what the network counted is what the protocol cost.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning

from atdnode.blobs import BlobStore
from atdnode.node import NodeHome
from atdnode.learning import ModelConfig, TrainOptions, train
from atdnode.aggregation import EnsembleOptions
from atdnode.models import ModelRegistry
from ledger import Ledger
from netsim.fit_share import replayed_s
from netsim.homes import node_seed


@dataclass(frozen=True)
class Pub:
    """Something a node published: a signed entry naming a blob."""

    node: str
    entry: str  # hex entry id
    blob: str
    manifest: str  # hash of the blob's chunk manifest, as the signed entry names it
    kind: str  # weights | features | aggregate
    part: str  # full | extractor | features | the aggregate's mode
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

    def __init__(self, name: str, home: NodeHome, *, seed: int, spec: str, cfg: ModelConfig,
                 ensemble: EnsembleOptions) -> None:
        from ledger import Signer

        self.name, self.home, self.seed, self.spec, self.cfg = name, home, seed, spec, cfg
        self.ensemble = ensemble
        self.peer_id = Signer.from_seed(node_seed(seed, name)).peer_id
        self.store = BlobStore(home.blobs_dir)
        self.registry = ModelRegistry(home)

    # -- training and publishing -------------------------------------------------------

    def train(self, opts: TrainOptions) -> Step:
        t0 = time.perf_counter()
        rec = train(self.home, self.spec, self.cfg, opts)
        return Step(time.perf_counter() - t0, model_id=rec.id)

    def publish(self, model_id: str, part: str) -> Step:
        from atdnode.models import publish_weights

        t0 = time.perf_counter()
        p = publish_weights(self.home, model=model_id, part=part)
        b = p.entry.body
        pub = Pub(self.name, p.entry.id.hex(), p.blob, b["manifest"], "weights", part, tuple(b["labels"]),
                  int(b["samples"]))
        return Step(time.perf_counter() - t0, model_id=model_id, pub=pub)

    def share_features(self, model_id: str, to: list[str]) -> Step:
        """`atd share-features --model M --to PEER...`: seal CLS features to peers."""
        from atdnode.aggregation import share_features

        t0 = time.perf_counter()
        s = share_features(self.home, to=to, model=model_id, data_spec=self.spec)
        b = s.entry.body
        pub = Pub(self.name, s.entry.id.hex(), s.blob, b["manifest"], "features", "features", tuple(b["classes"]),
                  int(b["samples"]))
        return Step(time.perf_counter() - t0, pub=pub)

    # -- aggregation -------------------------------------------------------------------

    def aggregate(self, mode: str, inputs: list[Pub], weighting: str, *, classifier: str = "ensemble") -> Step:
        """`atd aggregate --mode MODE --inputs ...` (hierarchical: `--group NAME=AGG_ENTRY` per
        input, named by the pub's node group in `part`): `atdnode.aggregation.modes.aggregate`, the
        CLI's dispatch."""
        from atdnode.aggregation import GroupSpec, run_aggregate as aggregate

        t0, r0 = time.perf_counter(), replayed_s()
        with warnings.catch_warnings():  # a capped MLP epoch count is a setting, not news
            warnings.simplefilter("ignore", ConvergenceWarning)
            hier = mode == "hierarchical"
            res = aggregate(self.home, mode, weighting=weighting, classifier=classifier, data_spec=self.spec,
                            options=self.ensemble, inputs=None if hier else [p.entry for p in inputs],
                            groups=[GroupSpec(p.part, (p.entry,)) for p in inputs] if hier else ())
        b = res.entry.body
        pub = Pub(self.name, res.entry.id.hex(), res.blob, b["manifest"], "aggregate", mode,
                  tuple(res.details.get("classes") or ()), int(res.details.get("samples") or 0))
        # a fit shared with another simulated node (netsim.fit_share) is charged as if refitted
        return Step(time.perf_counter() - t0 + replayed_s() - r0, model_id=res.model_id, pub=pub,
                    detail={"weights": [round(w, 6) for w in res.weights], "entry": res.entry.id.hex(),
                            "groups": res.details.get("groups", []), "kept": res.details.get("kept"),
                            "kept_why": res.details.get("kept_why"), "warnings": res.details.get("warnings", [])})

    def verify(self, entry: str) -> str:
        """`atd aggregate --verify ENTRY`: the verified result hash, or AggregateError."""
        from atdnode.aggregation import verify_aggregate

        return verify_aggregate(self.home, entry)

    # -- ledger and prediction ---------------------------------------------------------

    def has_entry(self, pub: Pub) -> bool:
        with Ledger.open(self.home.ledger_db) as led:
            return led.get(pub.entry) is not None

    def knows_keys(self, peers: list[str]) -> bool:
        """Whether this node's ledger holds an X25519 key announced by each of `peers`."""
        from atdnode.aggregation import FeaturesError, recipient_keys

        with Ledger.open(self.home.ledger_db) as led:
            try:
                recipient_keys(led, peers)
            except FeaturesError:
                return False
        return True

    def predict(self, model_id: str, images: torch.Tensor) -> tuple[list[str], np.ndarray]:
        """What `atd classify` predicts with the model (its ensemble when it has one)."""
        from atdnode.learning import predict_names

        names, pred, _ = predict_names(self.store, self.registry.get(model_id), images)
        return names, pred

    def probabilities(self, model_id: str, images: torch.Tensor) -> tuple[list[str], np.ndarray]:
        """(classes, (N, K) probabilities over them): what `atd classify`'s prediction is the arg-max of."""
        from atdnode.learning import class_probabilities, resolve_device

        names, probs, _ = class_probabilities(self.store, self.registry.get(model_id), images,
                                              device=resolve_device(None))
        return names, probs
