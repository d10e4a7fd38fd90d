"""Scoring the candidates of an aggregation on the node's own data (policy in
`atdnode.aggregation.keep`): the node's own current model and the consortium's new one, each with `atd
classify`'s predictor (`atdnode.learning.classify.score_record`), on the data spec's `val` split —
the source's, or the one the loader carves from the training split when the source has none
(`atdnode.data.loader`; `val_from` in the scores says which). Never on test data, unless the
spec forces it with `val=test`: then the scores carry `TEST_WARNING`, and so does every output
that shows a number of the model chosen (`atd aggregate`, `atd models`, `atd classify`). With no val
split at all (`val=train`) the node makes no choice and takes the consortium's model.
`judge_candidates` is what the aggregation modes hand to `atdnode.aggregation.aggregate.register_global`.
"""
from __future__ import annotations

from atdnode import progress
from atdnode.blobs import BlobStore
from atdnode.learning import ModelConfig, score_record
from atdnode.data import DataSpec, load_dataset, resolve_data
from atdnode.errors import AtdError, DataError
from atdnode.node import NodeHome
from atdnode.aggregation.keep import choose, keep_policy
from atdnode.models import ModelRecord, default_model


TEST_WARNING = ("chosen on the test split (val=test): its test numbers are optimistic, "
                "not an estimate of accuracy on new data")


class NoValSplit(AtdError):
    """The data spec has no val split to judge on (`val=train`)."""


def validation_data(spec: str, img_size: int, in_chans: int):
    """(labelled images, split name) the node scores candidates on: `val` (the source's or the
    carved one); `test` only where the spec forces it (`val=test`); NoValSplit with `val=train`."""
    ds = DataSpec.parse(spec)
    if ds.val == "train":
        raise NoValSplit(f"{spec}: no val split (val=train merges it into training)")
    source = resolve_data(spec, parsed=ds)
    if ds.val == "test":
        return load_dataset(source, img_size, in_chans, "test"), "test (val=test)"
    return load_dataset(source, img_size, in_chans, "val"), "val"


def score_candidates(store: BlobStore, candidates: dict[str, ModelRecord], spec: str) -> dict:
    """{"scored_on": split, "val_from", "data": spec, name: {"model", "balanced_accuracy", "accuracy",
    "f1", "n"}} for each candidate (plus "warning" when scored on test)."""
    cfg = ModelConfig.from_dict(next(iter(candidates.values())).model)
    data, split = validation_data(spec, cfg.img_size, cfg.in_chans)
    out: dict = {"scored_on": split, "val_from": data.report.val_origin if data.report else "", "data": spec}
    if split.startswith("test"):
        out["warning"] = TEST_WARNING
    with progress.task(f"scoring {' and '.join(candidates)} on {len(data.labels)} {split.split()[0]} images",
                       total=len(candidates)) as t:
        for name, rec in candidates.items():
            m, _, kind, _ = score_record(store, rec, data)
            out[name] = {"model": rec.id, "kind": kind,
                         "balanced_accuracy": round(float(m["balanced_accuracy"]), 6),
                         "accuracy": round(float(m["accuracy"]), 6), "f1": round(float(m["f1"]), 6), "n": int(m["n"])}
            t.advance()
    return out


def judge_candidates(home: NodeHome, store: BlobStore, own: ModelRecord, consortium: ModelRecord, spec: str | None) -> dict:
    """Score both candidates and apply the policy; the fields for the new record's provenance
    (`candidates`, `kept`, `kept_why`), or {"kept_why": reason} when it cannot score."""
    policy = keep_policy(home)
    if not spec:
        return {"kept": "consortium", "kept_why": "no data spec to score on; takes the consortium's model"}
    try:
        scores = score_candidates(store, {"own": own, "consortium": consortium}, spec)
    except NoValSplit as exc:
        return {"kept": "consortium", "kept_why": f"{exc}: makes no choice; takes the consortium's model"}
    except (AtdError, ValueError) as exc:
        return {"kept": "consortium", "kept_why": f"could not score the candidates ({str(exc)[:200]}); "
                                                  "takes the consortium's model"}
    kept, why = choose(policy, scores)
    out = {"candidates": scores, "kept": kept, "kept_why": why, "keep_policy": policy}
    if "warning" in scores:
        out["warning"] = scores["warning"]
    return out


def judge_with(home: NodeHome, store: BlobStore, spec: str | None):
    """`register_global`'s `judge`: the new record against the model the node uses now
    (`atdnode.models.default_model`, read when the judge runs, before the new record is added:
    an earlier aggregate the node did not keep is not its "own")."""
    return lambda consortium: judge_candidates(home, store, default_model(home), consortium, spec)
