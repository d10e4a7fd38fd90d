"""Hierarchical VGS-ATD (ATD-in-ATD) on a node: groups aggregate first, then group models combine.

`aggregate_hierarchical(home, groups=[GroupSpec(name, refs)], ...)`:

* each group is either an existing aggregate entry (`NAME=AGG_ENTRY`, e.g. a group's
  horizontal aggregate made by one of its members) or a list of weights entries
  (`NAME=W1,W2,...`). For a list, a stored group model with the same name, members and
  weighting is reused as it is — its entry and blob untouched, nothing re-averaged or
  retrained; only a new group is averaged (`group` aggregate entry: name, members,
  weights, n_classes = size of the union of the members' label spaces, n_models =
  number of members);
* the group models are combined with `sqrt-classes` (VGS-ATD Eq. 11) or `model-count`
  (Eq. 12) weights by `protocols.hierarchical.combine_groups` — extractors only unless
  every group kept heads over one label list — and recorded as a `hierarchical`
  aggregate entry naming the group entries;
* the combined extractor gives CLS features of the node's data (and of features peers
  sealed to it with the same extractor) for the ensemble, as in vertical mode.

So a group that joins later costs one new group average and one combination; the groups
already there are read, never rebuilt. `recompute_hierarchical` verifies an entry:
each group entry recursively, the recorded group sizes, the weights and the result hash.
"""
from __future__ import annotations

from dataclasses import dataclass

from atdnode import bodies
from atdnode.aggregation.aggregate import (
    AVERAGE_WEIGHTINGS,
    AggregateError,
    AggregateResult,
    average_entries,
    blob_fields,
    common_base,
    entry_of,
    extractor_of,
    fedwavg_reference,
    heads_averaged,
    input_weights,
    opened,
    own_model,
    register_global,
    result_meta,
    select_inputs,
)
from atdnode.blobs import BlobStore
from atdnode.errors import BlobError
from atdnode.aggregation.candidates import judge_with
from atdnode.aggregation.lineage import group_stats, weights_leaves
from atdnode.aggregation.features_share import data_spec_of
from atdnode.node import NodeHome, NodeIdentity
from atdnode.learning import ModelConfig
from atdnode.aggregation.ensemble import EnsembleOptions, fit_node_ensemble
from atdnode.models import save_weights
from ledger import Entry, Ledger
from protocols.aggregation import AggregationError, part_filter, safetensors_loader
from protocols.hierarchical import GROUP_WEIGHTINGS, Combination, GroupModel, combine_groups
from protocols.vgs import heads_comparable


@dataclass(frozen=True)
class GroupSpec:
    name: str
    refs: tuple[str, ...]  # one aggregate entry id, or weights entry ids

    @classmethod
    def parse(cls, text: str) -> "GroupSpec":
        """`NAME=ID,ID,...` (the `--group` option)."""
        name, sep, rest = text.partition("=")
        refs = tuple(r.strip() for r in rest.split(",") if r.strip())
        if not sep or not name.strip() or not refs:
            raise AggregateError(f"--group {text!r}: expected NAME=ENTRY_ID[,ENTRY_ID...]")
        return cls(name.strip(), refs)


@dataclass
class GroupOutcome:
    name: str
    entry: Entry  # the group's aggregate entry
    n_classes: int
    n_models: int
    labels: list[str]
    reused: bool

    def record(self) -> dict:
        return {"name": self.name, "entry": self.entry.id.hex(), "n_classes": self.n_classes,
                "n_models": self.n_models}


def _group_labels(led: Ledger, entry: Entry) -> list[str] | None:
    """The ordered label list of a group's heads, when its result is a full set."""
    if entry.body.get("part") != "full":
        return None
    first = entry_of(led, (entry.body.get("inputs") or [""])[0], ("weights", "aggregate"))
    return list(first.body.get("labels") or []) if first.kind == "weights" else _group_labels(led, first)


def _find_group(led: Ledger, store: BlobStore, name: str, ids: list[str], weighting: str) -> Entry | None:
    for e in reversed(led.query(kind="aggregate")):
        b = e.body
        if (b.get("mode") == "group" and b.get("name") == name and list(b.get("inputs") or []) == ids
                and b.get("weighting") == weighting and isinstance(b.get("blob"), str) and store.has(b["blob"])):
            return e
    return None


def resolve_group(home: NodeHome, ident: NodeIdentity, store: BlobStore, led: Ledger, spec: GroupSpec, *,
                  weighting: str, q: float) -> GroupOutcome:
    """The stored model of group `spec`: reused when it exists, else averaged and recorded."""
    first = entry_of(led, spec.refs[0], ("weights", "aggregate"), f"group {spec.name}")
    if first.kind == "aggregate":
        if len(spec.refs) != 1:
            raise AggregateError(f"group {spec.name}: name one aggregate entry, or weights entries only")
        if first.body.get("mode") not in ("horizontal", "vertical", "group", "hierarchical"):
            raise AggregateError(f"group {spec.name}: a {first.body.get('mode')} aggregate cannot be a group model")
        if not store.has(str(first.body.get("blob"))):
            raise AggregateError(f"group {spec.name}: the blob of aggregate {spec.refs[0][:16]} is not held here")
        n_classes, n_models, labels = group_stats(led, first)
        return GroupOutcome(spec.name, first, n_classes, n_models, labels, reused=True)
    members = select_inputs(home, led, store, ids=list(spec.refs))
    ids = [e.id.hex() for e in members]
    found = _find_group(led, store, spec.name, ids, weighting)
    if found is not None:
        n_classes, n_models, labels = group_stats(led, found)
        return GroupOutcome(spec.name, found, n_classes, n_models, labels, reused=True)
    head = heads_averaged(members)
    reference = fedwavg_reference(store, own_model(home), weighting)
    weights = input_weights(store, members, weighting, q=q, head=head, reference=reference)
    blob, part = average_entries(store, members, weights, head=head, mode="group", weighting=weighting)
    labels = sorted({str(c) for e in members for c in e.body.get("labels") or []})
    body = {"mode": "group", "name": spec.name, "weighting": weighting, "q": float(q), "weights": weights,
            "inputs": ids, "head": head, "part": part, **blob_fields(store, blob),
            **({"reference": reference} if reference else {}),
            "model": members[0].body.get("model"), "n_classes": max(1, len(labels)),
            "n_models": len(set().union(*(weights_leaves(led, i) for i in ids))),
            **({"base": common_base(members)} if common_base(members) else {})}
    entry = bodies.append(led, ident.signer, "aggregate", body)
    return GroupOutcome(spec.name, entry, body["n_classes"], body["n_models"], labels, reused=False)


def group_base(led: Ledger, entry: Entry) -> str | None:
    """The `base` fingerprint a group model descends from: its aggregate entry's, else the
    one its weights inputs share; None when unknown or mixed."""
    b = entry.body.get("base")
    if isinstance(b, str) and b:
        return b
    try:
        members = [entry_of(led, h, ("weights",)) for h in entry.body.get("inputs") or []]
    except AggregateError:
        return None
    return common_base(members) if members else None


def spec_base(led: Ledger, spec: GroupSpec) -> str | None:
    """The base of a group as named on the command line (before anything is built)."""
    first = entry_of(led, spec.refs[0], ("weights", "aggregate"), f"group {spec.name}")
    if first.kind == "aggregate":
        return group_base(led, first)
    return common_base([entry_of(led, h, ("weights",), f"group {spec.name}") for h in spec.refs])


def group_base_warning(led: Ledger, groups: list[GroupSpec]) -> str | None:
    """A warning when the groups do not descend from one shared base (README, "One shared
    base"): averaging group models from different random starts gives a random body."""
    bases = {g.name: spec_base(led, g) for g in groups}
    known = {b for b in bases.values() if b}
    if len(known) <= 1 and all(bases.values()):
        return None
    return ("the groups do not descend from one shared base (" + ", ".join(
        f"{n}: {b[:17] if b else 'unknown'}" for n, b in bases.items()) + "); combining models trained from "
            "different starts is meaningless — start every group from the consortium's shared base")


def combine_stored_groups(led: Ledger, store: BlobStore, groups: list[tuple[str, Entry, int, int]], weighting: str
             ) -> tuple[Combination, bool]:
    """protocols.hierarchical.combine_groups over stored group blobs (hash-checked first)."""
    for name, e, _, _ in groups:
        try:
            store.verify(str(e.body.get("blob")))
        except BlobError as exc:
            raise AggregateError(f"group {name}: {exc}") from None
    label_lists = [_group_labels(led, e) for _, e, _, _ in groups]
    head = all(ls is not None for ls in label_lists) and heads_comparable(label_lists)
    models = [GroupModel(name, safetensors_loader(store.path(e.body["blob"])), n_classes, n_models)
              for name, e, n_classes, n_models in groups]
    try:
        comb = combine_groups(models, weighting=weighting, key_filter=None if head else part_filter(include_head=False))
    except AggregationError as exc:
        raise AggregateError(str(exc)) from None
    return comb, head


def aggregate_hierarchical(home: NodeHome, groups: list[GroupSpec], *, weighting: str = "sqrt-classes",
                           group_weighting: str = "uniform", q: float = 1.0, data_spec: str | None = None,
                           features: list[str] | None = None, options: EnsembleOptions = EnsembleOptions(),
                           ensemble: bool = True, strict: bool = False, judge: bool = True) -> AggregateResult:
    """Resolve (reuse or build) each group, combine them, fit the ensemble, record and register.
    Groups from different bases are a warning (`details["warnings"]`), or with `strict` an
    AggregateError before anything is recorded."""
    if weighting not in GROUP_WEIGHTINGS:
        raise AggregateError(f"hierarchical weighting must be one of {', '.join(GROUP_WEIGHTINGS)}, got {weighting!r}")
    if group_weighting not in AVERAGE_WEIGHTINGS:
        raise AggregateError(f"--group-weighting must be one of {', '.join(AVERAGE_WEIGHTINGS)}")
    if not groups:
        raise AggregateError("hierarchical mode needs at least one --group NAME=ENTRY_ID,...")
    if len({g.name for g in groups}) != len(groups):
        raise AggregateError(f"group names must be distinct: {[g.name for g in groups]}")
    with opened(home) as (ident, store, led):
        base = own_model(home)
        spec = data_spec_of(base, data_spec) if ensemble else None
        warning = group_base_warning(led, groups)
        if warning and strict:  # refused before any group entry is recorded
            raise AggregateError(f"--strict: {warning}")
        outs = [resolve_group(home, ident, store, led, g, weighting=group_weighting, q=q) for g in groups]
        comb, head = combine_stored_groups(led, store, [(o.name, o.entry, o.n_classes, o.n_models) for o in outs], weighting)
        part = "full" if head else "extractor"
        meta = result_meta(store, outs[0].entry.body["blob"], part=part, mode="hierarchical", weighting=weighting)
        blob = save_weights(store, comb.tensors, meta)
        fit = None
        if ensemble:
            fit = fit_node_ensemble(home, ident, store, led, cfg=ModelConfig.from_dict(base.model),
                                    extractor=extractor_of(store, blob, part), data_spec=str(spec),
                                    features=features, options=options)
        body = {"mode": "hierarchical", "weighting": weighting, "weights": [float(w) for w in comb.weights],
                "inputs": [o.entry.id.hex() for o in outs], "groups": [o.record() for o in outs], "head": head,
                "part": part, **blob_fields(store, blob), "model": base.model}
        bases = {group_base(led, o.entry) for o in outs}
        if len(bases) == 1 and None not in bases:
            body["base"] = next(iter(bases))
        if fit is not None:
            body["ensemble"] = fit.record(store)
        entry = bodies.append(led, ident.signer, "aggregate", body)
    extra = {"ensemble": fit.blob} if fit else {}
    prov = {"data": spec or base.provenance.get("data"), "groups": body["groups"]}
    if fit:
        prov.update(ensemble_classes=fit.classes, features=fit.features)
    model_id = register_global(home, store, base=base, blob=blob, part=part, entry=entry,
                               kind="global-hierarchical", extra_blobs=extra, extra_provenance=prov,
                               judge=judge_with(home, store, spec, options) if judge and spec else None)
    details = {"groups": [{**o.record(), "blob": o.entry.body["blob"], "reused": o.reused} for o in outs]}
    if warning:
        details["warnings"] = [warning]
    from atdnode.aggregation.keep import kept_details

    details.update(kept_details(home, model_id))
    if fit:
        details.update(ensemble=fit.blob, classes=fit.classes, features=fit.features, skipped=fit.skipped,
                       samples=fit.samples)
    return AggregateResult(entry=entry, blob=blob, weights=body["weights"], inputs=body["inputs"],
                           model_id=model_id, head=head, details=details)
