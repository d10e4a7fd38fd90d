"""Collaboration never silently makes a hospital worse (issue 23).

After every aggregation the node scores each candidate — its own current model (what it
predicted with before: `own`) and the consortium's aggregate (`consortium`) — on its own
validation data, with `atd classify`'s predictor (`atdnode.classify.score_record`):

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

from atdnode.blobstore import BlobStore
from atdnode.errors import AtdError, ConfigError, DataError
from atdnode.home import NodeHome
from atdnode.registry import ModelRecord, ModelRegistry

KEEP_POLICIES = ("best", "consortium")
DEFAULT_KEEP = "best"


def keep_policy(home: NodeHome) -> str:
    """`[aggregate] keep` of the node's config.toml (default best)."""
    from atdnode.config import NodeConfig

    try:
        table = NodeConfig.load(home).extra.get("aggregate", {})
    except ConfigError:
        return DEFAULT_KEEP
    keep = table.get("keep", DEFAULT_KEEP) if isinstance(table, dict) else None
    if keep not in KEEP_POLICIES:
        raise ConfigError(f"config: aggregate.keep must be one of {', '.join(KEEP_POLICIES)}, got {keep!r}")
    return keep


def validation_data(spec: str, img_size: int, in_chans: int):
    """(labelled images, split name) the node scores candidates on: `val`, else `test`."""
    from atdnode.data import load_dataset

    try:
        return load_dataset(spec, img_size, in_chans, "val"), "val"
    except DataError:
        return load_dataset(spec, img_size, in_chans, "test"), "test (no val split)"


def score_candidates(store: BlobStore, candidates: dict[str, ModelRecord], spec: str) -> dict:
    """{"scored_on": split, "data": spec, name: {"model", "accuracy", "f1", "n"}} for each candidate."""
    from atdnode.classify import score_record
    from atdnode.model import ModelConfig

    cfg = ModelConfig.from_dict(next(iter(candidates.values())).model)
    data, split = validation_data(spec, cfg.img_size, cfg.in_chans)
    out: dict = {"scored_on": split, "data": spec}
    for name, rec in candidates.items():
        m, _, kind, _ = score_record(store, rec, data)
        out[name] = {"model": rec.id, "kind": kind, "accuracy": round(float(m["accuracy"]), 6),
                     "f1": round(float(m["f1"]), 6), "n": int(m["n"])}
    return out


def choose(policy: str, scores: dict) -> tuple[str, str]:
    """(kept candidate, why) under `policy`."""
    own, cons = scores["own"]["accuracy"], scores["consortium"]["accuracy"]
    where = f"on its {scores['scored_on']} data"
    if policy == "consortium":
        return "consortium", f"policy consortium (consortium {cons:.3f}, own {own:.3f} {where})"
    if cons >= own:
        return "consortium", f"the consortium's model scores {cons:.3f} >= its own {own:.3f} {where}"
    return "own", f"its own model scores {own:.3f} > the consortium's {cons:.3f} {where}; keeps its own"


def judge(home: NodeHome, store: BlobStore, own: ModelRecord, consortium: ModelRecord, spec: str | None) -> dict:
    """Score both candidates and apply the policy; the fields for the new record's provenance
    (`candidates`, `kept`, `kept_why`), or {"kept_why": reason} when it cannot score."""
    policy = keep_policy(home)
    if not spec:
        return {"kept": "consortium", "kept_why": "no data spec to score on; takes the consortium's model"}
    try:
        scores = score_candidates(store, {"own": own, "consortium": consortium}, spec)
    except (AtdError, ValueError) as exc:
        return {"kept": "consortium", "kept_why": f"could not score the candidates ({str(exc)[:200]}); "
                                                  "takes the consortium's model"}
    kept, why = choose(policy, scores)
    return {"candidates": scores, "kept": kept, "kept_why": why, "keep_policy": policy}


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
            except ConfigError:
                return rec
    return rec


def kept_details(home: NodeHome, model_id: str | None) -> dict:
    """The keep fields of a registered aggregate (for `atd aggregate`'s output)."""
    if not model_id:
        return {}
    prov = ModelRegistry(home).get(model_id).provenance
    return {k: prov[k] for k in ("candidates", "kept", "kept_why", "keep_policy") if k in prov}
