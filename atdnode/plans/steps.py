"""Carrying out one step of a plan: each step kind calls the library function its CLI command calls.

train -> `atdnode.learning.training.train` (`atd train`), publish ->
`atdnode.models.publish.publish_weights` (`atd publish-weights`), aggregate ->
`atdnode.aggregation.modes.aggregate` (`atd aggregate`), share_features ->
`atdnode.aggregation.features_share.share_features` (`atd share-features`), classify ->
`atdnode.learning.classify.classify` (`atd classify`); wait only passes on what arrived.

`run_step` gets the step's inputs (`Inputs`: per referenced step, the result entry ids that
arrived, in plan order) and returns what the member's `plan_step` entry records. Steps that
sign an entry first look for one this node already signed for the same thing (a run killed
between the library call and its `plan_step`), so a resumed plan never signs twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from atdnode.node import NodeHandle, NodeHome
from atdnode.plans.policy import PlanPolicy
from atdnode.plans.spec import PlanError


@dataclass
class Inputs:
    entries: dict[str, list[str]]  # referenced step id -> result entry ids (plan order)
    own: dict[str, dict]  # referenced step id -> this member's own plan_step body (train: its model)
    missing: list[str] = field(default_factory=list)  # peer ids left out (declined, failed, late)


@dataclass
class StepOutcome:
    results: list[str]
    model: str | None = None
    metrics: dict = field(default_factory=dict)


DEFAULT_MODEL = "vit_tiny_patch16_224"


def _ids(inputs: Inputs, refs) -> list[str]:
    return [e for r in ([refs] if isinstance(refs, str) else refs or []) for e in inputs.entries.get(r, [])]


def _own_entries(home: NodeHome, kind: str):
    from atdnode.node import NodeIdentity

    me = NodeIdentity.load(home).public_key
    return NodeHandle.of(home).ledger.query(kind=kind, author=me)


def _train(home: NodeHome, plan: dict, step: dict, inputs: Inputs, policy: PlanPolicy) -> StepOutcome:
    from atdnode.learning import TrainOptions, resolve_config
    from atdnode.learning import train
    from atdnode.blobs import BlobStore

    m = dict(plan.get("model") or {})
    cfg = resolve_config(m.pop("name", DEFAULT_MODEL), num_heads=m.pop("heads", None), **m)
    start = None
    if "init_from" in step:
        starts = _ids(inputs, step["init_from"])
        if not starts:
            raise PlanError(f"no weights of step {step['init_from']!r} to start from")
        start = NodeHandle.of(home).ledger.get(starts[0]).body["blob"]
        if not BlobStore.of(home).has(start):
            raise PlanError(f"the start {start[:16]} is not in this node's store")
    keys = ("epochs", "lr", "batch_size", "seed", "augment", "weight_decay", "warmup_epochs")
    opts = TrainOptions(init_from=start, epoch_eval=False, plots=False, **{k: step[k] for k in keys if k in step})
    rec = train(home, policy.data_spec(step["data"]), cfg, opts)
    return StepOutcome(results=[], model=rec.id, metrics={k: v for k, v in rec.metrics.items()
                                                           if k in ("accuracy", "f1", "n")})


def _publish(home: NodeHome, plan: dict, step: dict, inputs: Inputs, policy: PlanPolicy) -> StepOutcome:
    from atdnode.models import publish_weights

    model = inputs.own.get(step["model"], {}).get("model")
    if not model:
        raise PlanError(f"this node has no model from step {step['model']!r}")
    part = step.get("part", "extractor")
    for e in _own_entries(home, "weights"):  # published before a kill: the same entry, not a second one
        if e.body.get("model_id") == model and e.body.get("part") == part:
            return StepOutcome(results=[e.id.hex()], model=model)
    return StepOutcome(results=[publish_weights(home, model=model, part=part).entry.id.hex()], model=model)


def _aggregate(home: NodeHome, plan: dict, step: dict, inputs: Inputs, policy: PlanPolicy) -> StepOutcome:
    from atdnode.aggregation import EnsembleOptions, GroupSpec
    from atdnode.aggregation import run_aggregate as aggregate

    mode = step["mode"]
    ids = _ids(inputs, step.get("inputs"))
    groups = [GroupSpec(name, tuple(_ids(inputs, refs))) for name, refs in (step.get("groups") or {}).items()]
    features = _ids(inputs, step["features"]) if "features" in step else None
    if mode != "hierarchical":
        if not ids:
            raise PlanError("no inputs arrived")
        for e in _own_entries(home, "aggregate"):  # aggregated before a kill
            if e.body.get("mode") == mode and e.body.get("inputs") == ids and features is None:
                return StepOutcome(results=[e.id.hex()], model=None)
    hidden = tuple(int(x) for x in step.get("mlp_hidden", "256").split(",") if x.strip())
    opts = EnsembleOptions(**{k: step[k] for k in ("pca_components", "mlp_max_iter", "rf_trees", "seed", "prior")
                              if k in step}, mlp_hidden=hidden)
    res = aggregate(home, mode, weighting=step.get("weighting"), inputs=ids or None, groups=groups,
                    group_weighting=step.get("group_weighting", "uniform"), q=float(step.get("q", 1.0)),
                    classifier=step.get("classifier", "ensemble"),
                    data_spec=policy.data_spec(step["data"]) if "data" in step else None,
                    features=features, options=opts)
    return StepOutcome(results=[res.entry.id.hex()], model=res.model_id)


def _share(home: NodeHome, plan: dict, step: dict, inputs: Inputs, policy: PlanPolicy) -> StepOutcome:
    from atdnode.aggregation import share_features
    from atdnode.models import ModelRegistry

    model = ModelRegistry.of(home).get("latest").id
    if "data" not in step:  # shared before a kill: the same entry, not a second one
        for e in _own_entries(home, "features"):
            if e.body.get("model_id") == model and sorted(e.body.get("recipients") or []) == sorted(step["to"]):
                return StepOutcome(results=[e.id.hex()], model=model)
    res = share_features(home, to=list(step["to"]),
                         data_spec=policy.data_spec(step["data"]) if "data" in step else None)
    return StepOutcome(results=[res.entry.id.hex()])


def _classify(home: NodeHome, plan: dict, step: dict, inputs: Inputs, policy: PlanPolicy) -> StepOutcome:
    from atdnode.learning import run_classify as classify

    res = classify(home, policy.data_spec(step["data"]), split=step.get("split", "test"))
    return StepOutcome(results=[], model=res.model_id,
                       metrics={k: v for k, v in res.metrics.items() if isinstance(v, (int, float))})


def _wait(home: NodeHome, plan: dict, step: dict, inputs: Inputs, policy: PlanPolicy) -> StepOutcome:
    return StepOutcome(results=_ids(inputs, step["inputs"]))


RUNNERS = {"train": _train, "publish": _publish, "aggregate": _aggregate, "share_features": _share,
           "classify": _classify, "wait": _wait}


def run_step(home: NodeHome, plan: dict, step: dict, inputs: Inputs, policy: PlanPolicy) -> StepOutcome:
    """Carry out `step` of `plan` on this node with `inputs`; errors propagate (the caller records them).
    The node is opened once for the step (`NodeHandle`) and passed to the library calls."""
    return RUNNERS[step["kind"]](NodeHandle.of(home), plan, step, inputs, policy)
