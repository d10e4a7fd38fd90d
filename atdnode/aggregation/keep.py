"""Collaboration never silently makes a hospital worse (issue 23).

After every aggregation the node scores each candidate — its own current model (what it
predicted with before: `own`) and the consortium's aggregate (`consortium`) — on its own
validation data, with `atd classify`'s predictor (`atdnode.learning.classify.judge_candidates`,
which applies `choose` below):

* the data spec's `val` split when it has one; else its `test` split, and the record says
  so ("test (no val split)") — with no held-out data of its own the node has nothing else;
* the scores go into the new model's record (`provenance["candidates"]`, shown by
  `atd models` and printed by `atd aggregate`) and into each model's evaluations;
* the policy `[aggregate] keep` in config.toml decides which model `atd classify` uses by
  default (`default_model`): `best` (default) keeps the consortium's model only where it
  scores at least the node's own (accuracy, ties to the consortium), `consortium` always
  takes it. `provenance["kept"]` / `["kept_why"]` say what was kept and why.
"""
from __future__ import annotations

from atdnode.errors import AtdError, ConfigError
from atdnode.node import NodeHome
from atdnode.models import ModelRecord, ModelRegistry

KEEP_POLICIES = ("best", "consortium")
DEFAULT_KEEP = "best"


def keep_policy(home: NodeHome) -> str:
    """`[aggregate] keep` of the node's config.toml (default best)."""
    from atdnode.node import NodeConfig

    try:
        table = NodeConfig.load(home).extra.get("aggregate", {})
    except ConfigError:
        return DEFAULT_KEEP
    keep = table.get("keep", DEFAULT_KEEP) if isinstance(table, dict) else None
    if keep not in KEEP_POLICIES:
        raise ConfigError(f"config: aggregate.keep must be one of {', '.join(KEEP_POLICIES)}, got {keep!r}")
    return keep


def choose(policy: str, scores: dict) -> tuple[str, str]:
    """(kept candidate, why) under `policy`."""
    own, cons = scores["own"]["accuracy"], scores["consortium"]["accuracy"]
    where = f"on its {scores['scored_on']} data"
    if policy == "consortium":
        return "consortium", f"policy consortium (consortium {cons:.3f}, own {own:.3f} {where})"
    if cons >= own:
        return "consortium", f"the consortium's model scores {cons:.3f} >= its own {own:.3f} {where}"
    return "own", f"its own model scores {own:.3f} > the consortium's {cons:.3f} {where}; keeps its own"


def default_model(home: NodeHome) -> ModelRecord:
    """The model `atd classify` uses by default: the newest record, or — when the newest is
    an aggregate whose node kept its own model — that own model."""
    reg = ModelRegistry(home)
    rec = reg.get("latest")
    if rec.provenance.get("kept") == "own":
        own = (rec.provenance.get("candidates") or {}).get("own", {}).get("model")
        if isinstance(own, str):
            try:
                return reg.get(own)
            except AtdError:
                return rec
    return rec


def kept_details(home: NodeHome, model_id: str | None) -> dict:
    """The keep fields of a registered aggregate (for `atd aggregate`'s output)."""
    if not model_id:
        return {}
    prov = ModelRegistry(home).get(model_id).provenance
    return {k: prov[k] for k in ("candidates", "kept", "kept_why", "keep_policy") if k in prov}
