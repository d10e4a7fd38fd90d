"""Scoring the candidates of an aggregation on the node's own data (policy in
`atdnode.aggregation.keep`): the node's own current model, the consortium's new one and the node's
own raw-pixel ensemble (`raw_pixel_candidate`: fitted on its own training split only), each with `atd
classify`'s predictor (`atdnode.learning.classify.score_record`), on the data spec's `val` split —
the source's, or the one the loader carves from the training split when the source has none
(`atdnode.data.loader`; `val_from` in the scores says which). Never on test data, unless the
spec forces it with `val=test`: then the scores carry `TEST_WARNING`, and so does every output
that shows a number of the model chosen (`atd aggregate`, `atd models`, `atd classify`). With no val
split at all (`val=train`) the node makes no choice and takes the consortium's model.
`judge_candidates` is what the aggregation modes hand to `atdnode.aggregation.aggregate.register_global`.
"""
from __future__ import annotations

import collections

import numpy as np

from atdnode import progress
from atdnode.blobs import BlobStore
from atdnode.learning import ModelConfig, paired_balanced_accuracy_se, score_record
from atdnode.data import DataSource, DataSpec, label_fingerprint, load_dataset, resolve_data
from atdnode.errors import AtdError
from atdnode.node import NodeHandle, NodeHome
from atdnode.aggregation.aggregate import AggregateError, entry_of
from atdnode.aggregation.keep import choose, keep_policy
from atdnode.aggregation.lineage import group_stats
from atdnode.models import RAW_PIXELS, ModelRecord, answer_classes, learned_model_in_use, register_model
from ledger import Ledger


TEST_WARNING = ("chosen on the test split (val=test): its test numbers are optimistic, "
                "not an estimate of accuracy on new data")


class NoValSplit(AtdError):
    """The data spec has no val split to judge on (`val=train`)."""


def val_spec(spec: str) -> DataSpec:
    """`spec` parsed; NoValSplit where it has no val split (`val=train`)."""
    ds = DataSpec.parse(spec)
    if ds.val == "train":
        raise NoValSplit(f"{spec}: no val split (val=train merges it into training)")
    return ds


def validation_data(source: DataSource, img_size: int, in_chans: int):
    """(labelled images, split name) the node scores candidates on, from the resolved spec
    (`judged_source`): `val` (the source's or the carved one); `test` only where the spec
    forces it (`val=test`)."""
    if source.ds.val == "test":
        return load_dataset(source, img_size, in_chans, "test"), "test (val=test)"
    return load_dataset(source, img_size, in_chans, "val"), "val"


def judged_source(spec: str) -> DataSource:
    """`spec` parsed and resolved once for a keep decision; NoValSplit with `val=train`."""
    return resolve_data(spec, parsed=val_spec(spec))


def consortium_classes(led: Ledger, record: ModelRecord) -> list[str]:
    """The consortium's label space for aggregate `record`: the classes its model answers
    (`answer_classes`) and the union of the label spaces of the weight sets behind its aggregate
    entry (`provenance["aggregate"]`; `atdnode.aggregation.lineage.group_stats`, which
    follows hierarchical groups). A pass that fused the peers' extractors before their features
    arrived answers only the node's own classes, yet its consortium holds every input's; where
    the entries behind it cannot be read from this ledger, the answered classes alone."""
    out = dict.fromkeys(answer_classes(record))
    try:
        entry = entry_of(led, record.provenance.get("aggregate"), ("aggregate",), "aggregate")
        out.update(dict.fromkeys(group_stats(led, entry)[2]))
    except AggregateError:
        pass
    return list(out)


def score_candidates(store: BlobStore, candidates: dict[str, ModelRecord], source: DataSource, *,
                     seed: int = 0, space: list[str] | None = None) -> dict:
    """{"scored_on": split, "val_from", "data": spec, name: {"model", "balanced_accuracy", "accuracy",
    "f1", "n"}} for each candidate (plus "warning" when scored on test), and, when the node's data holds
    every class of the consortium's model, "val_class_counts": {class: images} over the classes
    of the node's data (0 for a class the split lacks); beside the consortium's,
    each other candidate's "se": the standard error of its balanced accuracy minus the
    consortium's on the same images (`paired_balanced_accuracy_se`, seeded by `seed`), which the
    one-standard-error rule of `choose` weighs. `space`: the consortium's label space
    (`consortium_classes`; default: the classes its model answers)."""
    cfg = ModelConfig.from_dict(next(iter(candidates.values())).model)
    data, split = validation_data(source, cfg.img_size, cfg.in_chans)
    out: dict = {"scored_on": split, "val_from": data.report.val_origin if data.report else "", "data": source.spec}
    if split.startswith("test"):
        out["warning"] = TEST_WARNING
    with progress.task(f"scoring {' and '.join(candidates)} on {len(data.labels)} {split.split()[0]} images",
                       total=len(candidates)) as t:
        preds = {}
        for name, rec in candidates.items():
            m, _, kind, _, preds[name] = score_record(store, rec, data)
            out[name] = {"model": rec.id, "kind": kind,
                         "balanced_accuracy": round(float(m["balanced_accuracy"]), 6),
                         "accuracy": round(float(m["accuracy"]), 6), "f1": round(float(m["f1"]), 6), "n": int(m["n"])}
            t.advance()
    y = np.asarray(data.labels, dtype=np.int64)  # indices into the classes every y_pred indexes (theirs first)
    if "consortium" in candidates and set(space or answer_classes(candidates["consortium"])) <= set(data.classes):
        # per class of the node's data (absent: 0); only where the node's data covers the
        # consortium's label space, the case the rule was measured on (`keep.MIN_VAL_PER_CLASS`)
        counts = collections.Counter(data.classes[int(i)] for i in y)
        out["val_class_counts"] = {str(c): int(counts.get(c, 0)) for c in data.classes}
    for name in [n for n in preds if n != "consortium" and "consortium" in preds]:
        out[name]["se"] = round(paired_balanced_accuracy_se(y, preds[name], preds["consortium"], seed=seed), 6)
    return out


def raw_pixel_candidate(store: BlobStore, own: ModelRecord, source: DataSource, options=None, *,
                        before: float | None = None, home: NodeHome | None = None) -> ModelRecord:
    """The node's raw-pixel ensemble as an unregistered record: `fit_own_raw` (the same PCA ->
    MLP + RF + SVM ensemble, the same class-prior correction, `options`: the aggregation's
    `EnsembleOptions`) on the raw pixels of the training split of `source` (the resolved spec) alone, at `own`'s
    input size; its ensemble saved as a blob, provenance kind `RAW_PIXELS`; created before time
    `before` where given (the record of the decision it is judged in). With `home`, an ensemble
    fitted before on the same inputs is taken from its index (`atdnode.aggregation.own_raw_index`)."""
    from atdnode.aggregation.ensemble import EnsembleOptions
    from atdnode.aggregation.own_raw_index import own_raw_blob

    opts = options or EnsembleOptions()
    cfg = ModelConfig.from_dict(own.model)
    train, spec = load_dataset(source, cfg.img_size, cfg.in_chans, "train"), source.spec
    with progress.task(f"its raw-pixel ensemble on {len(train.labels)} own training images", total=None):
        got = own_raw_blob(home, store, train, cfg, **opts.kwargs())
    rec = ModelRecord(model=own.model, labels=list(got.classes), label_fp=label_fingerprint(list(got.classes)),
                      samples=int(len(train.labels)), metrics={}, blobs={"ensemble": got.blob},
                      provenance={"kind": RAW_PIXELS, "data": spec, "ensemble_classes": list(got.classes),
                                  "ensemble_options": opts.kwargs(), "beside": own.id,
                                  "what": "PCA -> MLP + RF + SVM on the raw pixels of this node's own training "
                                          f"images alone (no learned features), class-prior correction {opts.prior}"})
    if before is not None:  # registered before the decision's own record, which stays the newest
        rec.created = min(rec.created, before - 1e-3)
    rec.id = rec.content_id()
    return rec


def judge_candidates(home: NodeHome, store: BlobStore, own: ModelRecord, consortium: ModelRecord, spec: str | None,
                     options=None) -> dict:
    """Score the candidates (own, consortium and, under policy best, the node's raw-pixel
    ensemble) and apply the policy; the fields for the new record's provenance (`candidates`,
    `kept`, `kept_why`), or {"kept_why": reason} when it cannot score. A kept raw-pixel ensemble
    is registered here (before the consortium's record, which stays the newest)."""
    policy = keep_policy(home)
    if not spec:
        return {"kept": "consortium", "kept_why": "no data spec to score on; takes the consortium's model"}
    try:
        cands = {"own": own, "consortium": consortium}
        source = judged_source(spec)  # NoValSplit before fitting anything
        if policy == "best":
            cands[RAW_PIXELS] = raw_pixel_candidate(store, own, source, options, before=consortium.created,
                                                   home=home)
        with NodeHandle.using(home) as node:
            space = consortium_classes(node.ledger, consortium)
        scores = score_candidates(store, cands, source, space=space)
    except NoValSplit as exc:
        return {"kept": "consortium", "kept_why": f"{exc}: makes no choice; takes the consortium's model"}
    except (AtdError, ValueError) as exc:
        return {"kept": "consortium", "kept_why": f"could not score the candidates ({str(exc)[:200]}); "
                                                  "takes the consortium's model"}
    kept, why = choose(policy, scores)
    if kept == RAW_PIXELS:
        raw = cands[RAW_PIXELS]
        same = _registered_like(home, raw)
        if same is not None:  # the same ensemble, registered by a run killed before its decision's record
            scores[RAW_PIXELS]["model"] = same.id
        else:
            register_model(home, raw)
    out = {"candidates": scores, "kept": kept, "kept_why": why, "keep_policy": policy}
    if "warning" in scores:
        out["warning"] = scores["warning"]
    return out


def _registered_like(home: NodeHome, raw: ModelRecord) -> ModelRecord | None:
    """A registered raw-pixel record with `raw`'s ensemble, data and learned model beside it."""
    from atdnode.models import ModelRegistry, is_raw_pixels

    key = (raw.blobs.get("ensemble"), raw.provenance.get("data"), raw.provenance.get("beside"))
    return next((r for r in ModelRegistry.of(home).list() if is_raw_pixels(r) and
                 (r.blobs.get("ensemble"), r.provenance.get("data"), r.provenance.get("beside")) == key), None)


def judge_with(home: NodeHome, store: BlobStore, spec: str | None, options=None):
    """`register_global`'s `judge`: the new record against the learned model the node uses now
    (`atdnode.models.learned_model_in_use`, read when the judge runs, before the new record is
    added: an earlier aggregate the node did not keep is not its "own") and its raw-pixel
    ensemble under the aggregation's ensemble `options`."""
    return lambda consortium: judge_candidates(home, store, learned_model_in_use(home), consortium, spec, options)
