"""Carrying out one step of a plan: each step kind calls the library function its CLI command calls.

train -> `atdnode.learning.training.train` (`atd train`), publish ->
`atdnode.models.publish.publish_weights` (`atd publish-weights`), aggregate ->
`atdnode.aggregation.modes.aggregate` (`atd aggregate`), share_features ->
`atdnode.aggregation.features_share.share_features` (`atd share-features`), classify ->
`atdnode.learning.classify.classify` (`atd classify`), rounds ->
`atdnode.rounds.RoundRunner` (`atd rounds`), split -> `atdnode.split.join` (`atd split
join`); wait only passes on what arrived.

`run_step` gets the step's inputs (`Inputs`: per referenced step, the result entry ids that
arrived, in plan order) and returns what the member's `plan_step` entry records. Steps that
sign an entry first look for one this node already signed for the same thing (a run killed
between the library call and its `plan_step`), so a resumed plan never signs twice; an
aggregate found so has its model registered if the killed run had not (`_signed_model`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from atdnode.node import NodeHandle, NodeHome
from atdnode.plans.policy import PlanPolicy
from atdnode.plans.spec import PlanError
from ledger import Ledger


@dataclass
class Inputs:
    entries: dict[str, list[str]]  # referenced step id -> result entry ids (plan order)
    own: dict[str, dict]  # referenced step id -> this member's own plan_step body (train: its model)
    missing: list[str] = field(default_factory=list)  # peer ids left out (declined, failed, late)
    declined: list[str] = field(default_factory=list)  # the step's members that declined the plan


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
    from atdnode.learning import TrainOptions, train
    from atdnode.blobs import BlobStore

    cfg = _model_config(plan)
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
    if mode != "hierarchical" and not ids:
        raise PlanError("no inputs arrived")
    hidden = tuple(int(x) for x in step.get("mlp_hidden", "256").split(",") if x.strip())
    opts = EnsembleOptions(**{k: step[k] for k in ("pca_components", "mlp_max_iter", "rf_trees", "seed", "prior")
                              if k in step}, mlp_hidden=hidden)
    found = _signed_aggregate(home, mode, ids, groups, features)
    if found is not None:  # aggregated before a kill: the same entry, not a second one, and its model
        return StepOutcome(results=[found], model=_signed_model(home, found, step, policy, opts))
    res = aggregate(home, mode, weighting=step.get("weighting"), inputs=ids or None, groups=groups,
                    group_weighting=step.get("group_weighting", "uniform"), q=float(step.get("q", 1.0)),
                    classifier=step.get("classifier", "ensemble"),
                    data_spec=policy.data_spec(step["data"]) if "data" in step else None,
                    features=features, options=opts)
    return StepOutcome(results=[res.entry.id.hex()], model=res.model_id)


def _signed_aggregate(home: NodeHome, mode: str, ids: list[str], groups: list, features: list[str] | None) -> str | None:
    """The id of an `aggregate` this node signed for the same mode, inputs (hierarchical: the same
    groups of the same inputs) and named features, or None."""
    with Ledger.open(home.ledger_db) as led:
        for e in _own_entries(home, "aggregate"):
            b = e.body
            if b.get("mode") != mode:
                continue
            if features is not None and sorted((b.get("ensemble") or {}).get("features") or []) != sorted(features):
                continue
            if mode != "hierarchical":
                if b.get("inputs") == ids:
                    return e.id.hex()
                continue
            recorded = b.get("groups") or []
            if [g.get("name") for g in recorded] == [g.name for g in groups] and all(
                    _same_group(led, g.get("entry"), list(spec.refs)) for g, spec in zip(recorded, groups)):
                return e.id.hex()
    return None


def _signed_model(home: NodeHome, entry: str, step: dict, policy: PlanPolicy, options) -> str:
    """The registered model of aggregate `entry` this node signed: the one registered for it, or
    (a run killed between the entry and registering its model) registered now as `atd aggregate`
    registers it (`register_global`: the fused extractor on the node's own model, the ensemble
    the entry records, the keep decision judged on the same data with the step's ensemble `options`)."""
    from atdnode.aggregation import judge_with, own_model, register_global
    from atdnode.blobs import BlobStore
    from atdnode.models import ModelRegistry

    reg = ModelRegistry.of(home)
    done = [r.id for r in reg.list() if r.provenance.get("aggregate") == entry]
    if done:
        return done[-1]
    e = NodeHandle.of(home).ledger.get(entry)
    b, base, store = e.body, own_model(home), BlobStore.of(home)  # the node's own model, as `atd aggregate` takes it
    spec = policy.data_spec(step["data"]) if "data" in step else base.provenance.get("data")
    ens = b.get("ensemble") or {}
    prov = {"data": spec, **({"ensemble_classes": ens.get("classes"), "features": ens.get("features")} if ens else {}),
            **({"groups": b.get("groups")} if b["mode"] == "hierarchical" else {})}
    return register_global(home, store, base=base, blob=b["blob"], part=b["part"], entry=e, kind=f"global-{b['mode']}",
                           extra_blobs={"ensemble": ens["blob"]} if ens else None, extra_provenance=prov,
                           judge=judge_with(home, store, spec, options) if spec else None)


def _same_group(led: Ledger, entry: str | None, refs: list[str]) -> bool:
    """Whether the group model `entry` of a hierarchical aggregate is the one `refs` make: that
    aggregate itself (one aggregate named), or the group average of exactly those weights."""
    if not isinstance(entry, str):
        return False
    if refs == [entry]:
        return True
    try:
        e = led.get(entry)
    except ValueError:
        return False
    return e is not None and e.body.get("mode") == "group" and list(e.body.get("inputs") or []) == refs


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


def _model_config(plan: dict):
    from atdnode.learning import resolve_config

    m = dict(plan.get("model") or {})
    return resolve_config(m.pop("name", DEFAULT_MODEL), num_heads=m.pop("heads", None), **m)


def _rounds(home: NodeHome, plan: dict, step: dict, inputs: Inputs, policy: PlanPolicy) -> StepOutcome:
    """`atd rounds` with the step's options; resumes at the campaign's current round (RoundRunner),
    so a step carried out again after a kill trains no finished round again. Each round waits
    for the step's members that did not decline the plan (`RoundsConfig.members`): a member
    outside the step, or one that declined but stays online, is named missing at once."""
    import trio

    from atdnode.rounds import RoundRunner, RoundsConfig, round_candidates

    names = {"local_epochs": "local_epochs", "batch_size": "batch_size", "lr": "lr", "seed": "seed", "q": "q",
             "round_deadline": "deadline", "min_peers": "min_peers", "absent_grace": "absent_grace", "name": "name",
             "byzantine": "byzantine"}
    conf = RoundsConfig(data=policy.data_spec(step["data"]), cfg=_model_config(plan), rounds=step["rounds"],
                        weighting=step.get("aggregator", "fedwavg"),
                        members=frozenset(step["members"]) - set(inputs.declined),
                        **{names[k]: step[k] for k in names if k in step})
    runner = RoundRunner(home, conf)
    reports = trio.run(runner.run)
    if reports:
        return StepOutcome(results=[reports[-1].entry], metrics={"rounds": len(reports), **{
            k: v for k, v in reports[-1].metrics.items() if isinstance(v, (int, float))}})
    blob = trio.run(runner.global_blob, step["rounds"])  # every round was over before this run (a kill)
    with Ledger.open(home.ledger_db) as led:
        last = next(e for e in round_candidates(led, runner.campaign, step["rounds"] - 1) if e.body.get("blob") == blob)
    return StepOutcome(results=[last.id.hex()], metrics={"rounds": 0})


def _split(home: NodeHome, plan: dict, step: dict, inputs: Inputs, policy: PlanPolicy) -> StepOutcome:
    """`atd split join` for the step's task; the session's task metrics are the step's metrics."""
    from atdnode.split import JoinOptions, join

    opts = JoinOptions(server=step["server"], task=step["task"], data=policy.data_spec(step["data"]),
                       test_data=policy.data_spec(step["test_data"]) if "test_data" in step else None,
                       **{k: step[k] for k in ("rounds", "seed", "lr") if k in step})
    res = join(home, opts)
    return StepOutcome(results=[], metrics={k: v for k, v in res.metrics.items() if isinstance(v, (int, float))})


RUNNERS = {"rounds": _rounds, "split": _split, "train": _train, "publish": _publish, "aggregate": _aggregate, "share_features": _share,
           "classify": _classify, "wait": _wait}


def run_step(home: NodeHome, plan: dict, step: dict, inputs: Inputs, policy: PlanPolicy) -> StepOutcome:
    """Carry out `step` of `plan` on this node with `inputs`; errors propagate (the caller records them).
    The node is opened once for the step (`NodeHandle`) and passed to the library calls."""
    with NodeHandle.using(home) as node:
        return RUNNERS[step["kind"]](node, plan, step, inputs, policy)
