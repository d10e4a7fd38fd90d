"""Verification of `aggregate` entries (`atd aggregate --verify`; netsim re-verifies with it).

A peer holding an aggregate's inputs recomputes it: the weights from the recorded weighting
rule (FedWAvg from the recorded `reference` blob), the average in the fixed arithmetic order
of `protocols.aggregation`, the result's metadata from its first input, and compares the
hash with the recorded blob. Hierarchical entries are verified group by group (recursively),
with C_i and n_i recomputed from the signed group entries. The ensemble of a vertical /
horizontal / hierarchical entry is not recomputed (it depends on features sealed to its
author only); its blob is named in the entry.
"""
from __future__ import annotations

from atdnode.aggregation.check import check_recorded_weights, check_result
from atdnode.aggregation.aggregate import (
    AggregateError,
    average_blobs,
    entry_of,
    typed_body,
    heads_averaged,
    input_weights,
    result_meta,
)
from atdnode.blobs import BlobStore
from atdnode.aggregation.hierarchical import combine_stored_groups
from atdnode.aggregation.lineage import _MAX_DEPTH, group_stats
from atdnode.node import NodeHandle, NodeHome
from ledger import Entry, Ledger


def recompute_average(led: Ledger, store: BlobStore, entry: Entry) -> str:
    """Verify a horizontal / vertical / group aggregate from its input weight sets."""
    body = entry.body
    mode = body.get("mode")
    inputs = [entry_of(led, h, ("weights",)) for h in body.get("inputs") or []]
    if not inputs:
        raise AggregateError(f"aggregate {entry.id.hex()[:16]} names no inputs")
    for e in inputs:
        if not store.has(str(e.body.get("blob"))):
            raise AggregateError(f"input blob {str(e.body.get('blob'))[:12]} is not held here (fetch it first)")
    head = heads_averaged(inputs) if mode != "vertical" else False
    if bool(body.get("head", head)) != head:
        raise AggregateError(f"aggregate {entry.id.hex()[:16]} does not verify: it says heads were "
                             f"{'' if body.get('head') else 'not '}averaged, its inputs say otherwise")
    weighting = str(body.get("weighting"))
    expected = input_weights(store, inputs, weighting, q=float(body.get("q", 1.0)), head=head,
                             reference=body.get("reference"))
    weights = check_recorded_weights(entry, expected)
    part = "full" if head else "extractor"
    tensors = average_blobs(store, [e.body["blob"] for e in inputs], weights,
                            names=[f"entry {e.id.hex()[:12]}" for e in inputs], head=head)
    meta = result_meta(store, inputs[0].body["blob"], part=part, mode=str(mode), weighting=weighting)
    return check_result(store, entry, tensors, meta)


def verify_entry(led: Ledger, store: BlobStore, entry: Entry) -> str:
    """Recompute any aggregate entry (dispatch by mode); returns the verified result hash
    (AggregateError for one whose body does not fit the spec, too)."""
    mode = typed_body(entry, "aggregate").get("mode")
    if mode in ("horizontal", "vertical", "group"):
        return recompute_average(led, store, entry)
    if mode == "hierarchical":
        return recompute_hierarchical(led, store, entry)
    if mode == "round":
        from atdnode.rounds import verify_round

        return verify_round(led, store, entry)
    raise AggregateError(f"aggregate {entry.id.hex()[:16]} has unknown mode {mode!r}")


def verify_aggregate(home: NodeHome, entry_id: str) -> str:
    """Recompute an `aggregate` entry from its inputs; return the result hash or raise AggregateError."""
    with NodeHandle.using(home) as node:
        led = node.ledger
        return verify_entry(led, BlobStore.of(node), entry_of(led, entry_id, ("aggregate",), "aggregate"))


def recompute_hierarchical(led: Ledger, store: BlobStore, entry: Entry, depth: int = 0) -> str:
    """Verify a hierarchical aggregate: its groups (recursively), their recorded sizes, the
    combination weights and the result hash."""
    eid, body = entry.id.hex()[:16], entry.body
    recorded = body.get("groups")
    inputs = body.get("inputs") or []
    if not isinstance(recorded, list) or len(recorded) != len(inputs) or not inputs:
        raise AggregateError(f"aggregate {eid} does not verify: its groups and inputs disagree")
    groups = []
    for h, rec in zip(inputs, recorded):
        g = entry_of(led, h, ("aggregate",), "group")
        if depth >= _MAX_DEPTH:
            raise AggregateError(f"aggregate {eid}: groups nested deeper than {_MAX_DEPTH}")
        if g.body.get("mode") == "hierarchical":
            recompute_hierarchical(led, store, g, depth + 1)
        else:
            verify_entry(led, store, g)
        n_classes, n_models, _ = group_stats(led, g)
        if not isinstance(rec, dict) or rec.get("n_classes") != n_classes or rec.get("n_models") != n_models:
            raise AggregateError(f"aggregate {eid} does not verify: group {rec!r} has {n_classes} classes and "
                                 f"{n_models} models")
        groups.append((str(rec.get("name")), g, n_classes, n_models))
    comb, head = combine_stored_groups(led, store, groups, str(body.get("weighting")))
    check_recorded_weights(entry, [float(w) for w in comb.weights])
    if bool(body.get("head")) != head:
        raise AggregateError(f"aggregate {eid} does not verify: its record of heads contradicts its groups")
    part = "full" if head else "extractor"
    meta = result_meta(store, groups[0][1].body["blob"], part=part, mode="hierarchical",
                       weighting=str(body.get("weighting")))
    return check_result(store, entry, comb.tensors, meta)
