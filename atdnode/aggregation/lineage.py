"""What stands behind an aggregate entry, read from the signed entries alone (so a verifier
recomputes it): the union of the label spaces of its weight sets and the base models it
averaged, following hierarchical groups (`atdnode.aggregation.hierarchical`, VGS-ATD Eq. 11/12)
and weight sets published from global models. The keep decision reads the same union as the
consortium's label space (`atdnode.aggregation.candidates.consortium_classes`)."""
from __future__ import annotations

from atdnode.aggregation.aggregate import AggregateError, entry_of, typed_body
from ledger import Entry, Ledger

_MAX_DEPTH = 8  # nested hierarchical groups


def group_stats(led: Ledger, entry: Entry, depth: int = 0) -> tuple[int, int, list[str]]:
    """(C_i, n_i, union of label spaces) of an aggregate entry used as a group, read from the
    signed entries (so a verifier recomputes them): C_i is the size of the union of the label
    spaces of the weight sets behind it, n_i the number of base models behind it — a weight
    set published from a global model counts the models that global model averaged
    (its `provenance`), recursively, each base model once (Eq. 11/12)."""
    if depth > _MAX_DEPTH:
        raise AggregateError(f"aggregate {entry.id.hex()[:16]}: groups nested deeper than {_MAX_DEPTH}")
    if typed_body(entry, "group").get("mode") == "hierarchical":
        leaves, labels = set(), set()
        for h in entry.body.get("inputs") or []:
            group = entry_of(led, h, ("aggregate",), "group")
            labels |= set(group_stats(led, group, depth + 1)[2])
            leaves |= _group_leaves(led, group, depth + 1)
        return max(1, len(labels)), len(leaves), sorted(labels)
    members = [entry_of(led, h, ("weights",)) for h in entry.body.get("inputs") or []]
    if not members:
        raise AggregateError(f"aggregate {entry.id.hex()[:16]} names no inputs")
    labels = sorted({str(c) for e in members for c in e.body.get("labels") or []})
    return max(1, len(labels)), len(_group_leaves(led, entry, depth)), labels


def _group_leaves(led: Ledger, entry: Entry, depth: int = 0) -> set[str]:
    """The base models (weights entry ids) behind an aggregate entry."""
    if entry.body.get("mode") == "hierarchical":
        out: set[str] = set()
        for h in entry.body.get("inputs") or []:
            out |= _group_leaves(led, entry_of(led, h, ("aggregate",), "group"), depth + 1)
        return out
    return set().union(*(weights_leaves(led, h) for h in entry.body.get("inputs") or []))


def weights_leaves(led: Ledger, ref: str, depth: int = 0) -> set[str]:
    """A weights entry stands for itself, or — when it was published from a global model —
    for the base models that model averaged (the weights entries in its provenance)."""
    e = entry_of(led, ref, ("weights",))
    prov = [p for p in e.body.get("provenance") or [] if isinstance(p, str)]
    if depth >= _MAX_DEPTH or not prov:
        return {ref}
    out: set[str] = set()
    for p in prov:
        try:
            raw = bytes.fromhex(p)
        except ValueError:
            continue
        pe = led.get(raw) if len(raw) == 32 else None
        if pe is not None and pe.kind == "weights":
            out |= weights_leaves(led, p, depth + 1)
    return out or {ref}
