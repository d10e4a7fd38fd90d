"""Node-level one-time aggregation: pick published weight sets, combine them, record it.

Every aggregation is an `aggregate` ledger entry whose body names the input entries, the
weighting, the exact weights and the result blob, so a peer holding the inputs can
recompute it bit for bit (`verify_aggregate`): the average follows a fixed arithmetic
order (protocols.aggregation) and the result's safetensors metadata is a function of the
inputs (`result_meta`). The recorded weights are recomputed from the weighting rule too,
so an entry cannot claim "uniform" and use other weights.

This module holds what every mode shares (input selection, weightings, the average,
registration); each mode is one small module, and verification is another:

horizontal    `atdnode.aggregation.horizontal`: weighted average of compatible weight sets (heads too
              when every input is a full set over the same label list), then by default
              the downstream ensemble on the fused extractor (paper §3.1)
vertical      `atdnode.aggregation.vertical`: weighted average of extractors only, then the ensemble
group         one group model of a hierarchical aggregation (`atdnode.aggregation.hierarchical`)
hierarchical  group models combined with sqrt-classes / model-count weights (same module)
verify        `atdnode.aggregation.verify` (`atd aggregate --verify`)

Common body fields: mode, weighting, q, weights, inputs (hex entry ids), head (bool: were
heads averaged), part (of the result), blob, size, manifest, model (config dict).

The node's global model is the result plus its own head (or the result itself when heads
were averaged); it is registered in the model registry, so `atd classify`,
`atd share-features` and `atd publish-weights` can use it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from atdnode import bodies
from atdnode.blobs import BlobStore
from atdnode.errors import AtdError, BlobError
from atdnode.node import NodeHandle, NodeHome, NodeIdentity
from atdnode.learning import ModelConfig, ModelConfigError
from atdnode.models import ModelRecord, ModelRegistry, load_weights, read_meta, register_model, save_weights
from ledger import Entry, Ledger
from protocols.aggregation import (
    HEAD_PREFIXES,
    AggregationError,
    compute_weights,
    counted_quantity,
    last_layer_keys,
    load_tensor,
    part_filter,
    safetensors_loader,
    weighted_average,
)
from protocols.rounds import LAST_LAYER
from protocols.vgs import heads_comparable
from protocols.weightings import weightings

AVERAGE_WEIGHTINGS = weightings("average")
# what a weights entry's body says of each quantity a weighting counts (protocols.aggregation.COUNTED)
ENTRY_COUNTS: dict[str, Callable[[Entry], int]] = {
    "samples": lambda e: int(e.body.get("samples", 0)),
    "classes": lambda e: len(e.body.get("labels") or []),
}


class AggregateError(AtdError):
    """Inputs cannot be aggregated (none, incompatible, missing blobs) or a result does not verify."""


@dataclass
class AggregateResult:
    entry: Entry
    blob: str
    weights: list[float]
    inputs: list[str]
    model_id: str | None
    head: bool = False
    details: dict = field(default_factory=dict)  # mode-specific: ensemble, groups, skipped features

    def to_json(self) -> dict:
        return {"entry": self.entry.id.hex(), "blob": self.blob, "weights": self.weights, "inputs": self.inputs,
                "model": self.model_id, "head": self.head, **self.details}


@contextmanager
def opened(home: NodeHome) -> Iterator[tuple[NodeIdentity, BlobStore, Ledger]]:
    """The node's identity, blob store and ledger, from its handle (`NodeHandle.using`)."""
    with NodeHandle.using(home) as node:
        yield NodeIdentity.load(node), BlobStore.of(node), node.ledger


def entry_of(led: Ledger, ref: str, kinds: tuple[str, ...], what: str = "input") -> Entry:
    """The entry with hex id `ref` (must be one of `kinds`), or AggregateError."""
    try:
        raw = bytes.fromhex(ref) if isinstance(ref, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise AggregateError(f"{what} {ref!r} is not a 64-hex-digit entry id")
    e = led.get(raw)
    if e is None:
        raise AggregateError(f"{what} entry {ref[:16]} is not in this node's ledger")
    if e.kind not in kinds:
        raise AggregateError(f"{what} entry {ref[:16]} is a {e.kind} entry, not {' or '.join(kinds)}")
    typed_body(e, what)
    return e


def typed_body(e: Entry, what: str = "input") -> dict:
    """`e`'s body if it fits its kind's spec (`atdnode.bodies`), else AggregateError."""
    try:
        return bodies.body_of(e)
    except bodies.BodyError as exc:
        raise AggregateError(f"{what} {exc}") from None


def own_model(home: NodeHome, ref: str = "latest") -> ModelRecord:
    """The node's own current model (its config, head and data spec anchor aggregation): `ref`, or
    for "latest" the newest record with weights (a raw-pixel ensemble the node kept has none)."""
    from atdnode.models import is_raw_pixels

    reg = ModelRegistry.of(home)
    learned = [r for r in reg.list() if not is_raw_pixels(r)] if ref == "latest" else []
    return learned[-1] if learned else reg.get(ref)


def select_inputs(home: NodeHome, led: Ledger, store: BlobStore, *, ids: list[str] | None = None,
                  parts: tuple[str, ...] | None = None, skipped: list[dict] | None = None) -> list[Entry]:
    """Published weight sets this node holds that fit its own model (default: all of them).

    Explicitly named inputs that do not fit are an error; when defaulting, misfits are
    skipped and a blob published twice counts once. The model config must match except
    for the class count (heads are averaged only when label spaces match). Skipped inputs
    are appended to `skipped` as {"entry", "why"}.
    """
    cfg = ModelConfig.from_dict(own_model(home).model)
    entries = [entry_of(led, h, ("weights",)) for h in ids] if ids else [
        e for e in led.query(kind="weights") if bodies.fits(e)]
    chosen: list[Entry] = []
    seen: set[str] = set()
    for e in entries:
        b = e.body
        problem = None
        if b.get("part") == "head" or (parts is not None and b.get("part") not in parts):
            problem = f"it is a {b.get('part')} set; this mode takes {' or '.join(parts or ('extractor', 'full'))}"
        elif not isinstance(b.get("blob"), str) or not store.has(b["blob"]):
            problem = "its blob has not been fetched (is the daemon running?)"
        else:
            try:
                diff = cfg.diff(ModelConfig.from_dict(b.get("model") or {}), ignore=("num_classes",))
            except (AtdError, ModelConfigError) as exc:
                diff = [str(exc)]
            if diff:
                problem = "another model config: " + ", ".join(diff)
        if problem:
            if ids:
                raise AggregateError(f"input {e.id.hex()[:16]}: {problem}")
            if skipped is not None:
                skipped.append({"entry": e.id.hex(), "why": problem})
            continue
        if b["blob"] in seen and not ids:
            continue
        seen.add(b["blob"])
        chosen.append(e)
    if not chosen:
        raise AggregateError("no compatible published weight sets held locally (publish and fetch first)")
    if len({e.body["part"] for e in chosen}) > 1 and parts is None:
        raise AggregateError(f"inputs mix parts {sorted({e.body['part'] for e in chosen})}; choose some with --inputs")
    return chosen


def screen_inputs(store: BlobStore, chosen: list[Entry], skipped: list[dict]) -> list[Entry]:
    """Default aggregation: drop weight sets that cannot be averaged with the rest --
    a blob that fails its hash, is not safetensors, holds NaN/inf, or whose extractor tensors
    differ in name, shape or dtype from the most common layout -- and say why in `skipped`,
    so one bad set published by any member no longer aborts everyone's `atd aggregate`."""
    extractor = part_filter(include_head=False)
    layouts: dict[str, tuple] = {}
    for e in chosen:
        try:
            store.verify(e.body["blob"])
            tensors, _ = load_weights(store, e.body["blob"])  # also rejects non-finite tensors
            layouts[e.id.hex()] = tuple(sorted((k, tuple(t.shape), str(t.dtype)) for k, t in tensors.items() if extractor(k)))
            del tensors
        except (BlobError, AtdError) as exc:
            skipped.append({"entry": e.id.hex(), "why": str(exc)[:300]})
    if not layouts:
        return []
    counts: dict[tuple, int] = {}
    for lay in layouts.values():
        counts[lay] = counts.get(lay, 0) + 1
    common = max(counts, key=lambda lay: counts[lay])
    keep = []
    for e in chosen:
        lay = layouts.get(e.id.hex())
        if lay is None:
            continue
        if lay != common:
            skipped.append({"entry": e.id.hex(), "why": "its extractor tensors differ in names, shapes or dtypes "
                                                       "from the other inputs'"})
            continue
        keep.append(e)
    return keep


def heads_averaged(inputs: list[Entry]) -> bool:
    """Heads take part only when every input is a full set over the same ordered label list."""
    return all(e.body.get("part") == "full" for e in inputs) and heads_comparable(
        [list(e.body.get("labels") or []) for e in inputs])


def input_weights(store: BlobStore, inputs: list[Entry], weighting: str, *, q: float = 1.0,
                  head: bool = False, reference: str | None = None) -> list[float]:
    """Per-input weights for an average of weight sets, per the named weighting.

    fedwavg (`protocols.fedwavg`) compares each input's last layer (weight and bias) with the
    same layer of `reference`, a held weight-set blob: the node's previous global model, or
    its own model when it has none (`fedwavg_reference`). Inputs are never compared with each
    other, so the weights do not depend on input order.
    """
    if weighting not in AVERAGE_WEIGHTINGS:
        raise AggregateError(f"weighting {weighting!r} does not apply to weight sets "
                             f"(choose from {', '.join(AVERAGE_WEIGHTINGS)})")
    try:
        if weighting == "fedwavg":
            if not reference or not store.has(reference):
                raise AggregateError(f"fedwavg needs its reference model's blob {str(reference)[:16]} held here")
            ref_keys = read_keys(store, reference)
            keys = last_layer_keys(read_keys(store, inputs[0].body["blob"]),
                                   heads_comparable=head and LAST_LAYER[0] in ref_keys)
            ref = [load_tensor(safetensors_loader(store.path(reference)), k) for k in keys]
            layers = [[load_tensor(safetensors_loader(store.path(e.body["blob"])), k) for k in keys] for e in inputs]
            w = compute_weights("fedwavg", reference=ref, layers=layers, q=q)
        else:  # the weighting table: what it counts per input, read off each entry
            counted = counted_quantity(weighting)
            w = compute_weights(weighting, n=len(inputs),
                                counts=[ENTRY_COUNTS[counted](e) for e in inputs] if counted else None)
    except AggregationError as exc:
        raise AggregateError(f"{weighting} weights: {exc}") from None
    return [float(x) for x in w]


def base_warning(inputs: list[Entry]) -> str | None:
    """A warning when the inputs descend from different starting points (their `base`
    fingerprints differ): averaging models trained from different random starts is
    meaningless, their units do not correspond (README, "One shared base")."""
    bases = {str(e.body.get("base")) for e in inputs if isinstance(e.body.get("base"), str)}
    if len(bases) < 2:
        return None
    return (f"the {len(inputs)} inputs descend from {len(bases)} different starts (base fingerprints "
            f"{', '.join(sorted(b[:17] for b in bases))}); averaging models trained from different random starts "
            f"is meaningless — start every node from one shared base (--init-from / --pretrained)")


def common_base(inputs: list[Entry]) -> str | None:
    bases = {e.body.get("base") for e in inputs}
    return next(iter(bases)) if len(bases) == 1 and isinstance(next(iter(bases)), str) else None


def fedwavg_reference(store: BlobStore, base: ModelRecord, weighting: str) -> str | None:
    """The FedWAvg reference of a node: its current model (its previous global model, or its
    own trained model when it has none) as a full weight-set blob; None for other weightings."""
    if weighting != "fedwavg":
        return None
    blob = base.blobs.get("full")
    if not blob or not store.has(blob):
        raise AggregateError(f"fedwavg: model {base.id} has no full weight set to use as the reference")
    return blob


def read_keys(store: BlobStore, blob: str) -> list[str]:
    src = safetensors_loader(store.path(blob))()
    try:
        return list(src.keys())
    finally:
        src.close()


def average_blobs(store: BlobStore, blobs: list[str], weights: list[float], *, names: list[str],
                  head: bool) -> dict[str, torch.Tensor]:
    """Streaming weighted average of held safetensors blobs (each verified against its hash first)."""
    from atdnode import progress

    with progress.task(f"checking {len(blobs)} input blob(s)", total=sum(store.size(b) for b in blobs),
                       unit="bytes") as step:
        for b, name in zip(blobs, names):
            try:
                store.verify(b)  # the bytes are what the signed entry names
            except BlobError as exc:
                raise AggregateError(f"{name}: {exc}") from None
            step.advance(store.size(b))
    loaders = [safetensors_loader(store.path(b)) for b in blobs]
    keep = None if head else part_filter(include_head=False)
    with progress.task(f"averaging {len(blobs)} weight set(s)", total=1) as step:
        try:
            out = weighted_average(loaders, weights, names=names, key_filter=keep)
        except AggregationError as exc:
            raise AggregateError(str(exc)) from None
        step.advance()
    return out


def result_meta(store: BlobStore, first_blob: str, *, part: str, mode: str, weighting: str) -> dict:
    """Metadata of a result blob: a function of its first input, so peers recompute the same hash."""
    return {**read_meta(store, first_blob), "part": part, "aggregate": {"mode": mode, "weighting": weighting}}


def blob_fields(store: BlobStore, blob: str) -> dict:
    return {"blob": blob, "size": store.size(blob), "manifest": store.manifest(blob).hash}


def average_entries(store: BlobStore, inputs: list[Entry], weights: list[float], *, head: bool, mode: str,
                    weighting: str) -> tuple[str, str]:
    """Average the inputs' blobs and store the result; returns (blob, part)."""
    part = "full" if head else "extractor"
    tensors = average_blobs(store, [e.body["blob"] for e in inputs], weights,
                            names=[f"entry {e.id.hex()[:12]}" for e in inputs], head=head)
    meta = result_meta(store, inputs[0].body["blob"], part=part, mode=mode, weighting=weighting)
    return save_weights(store, tensors, meta), part


def extractor_of(store: BlobStore, blob: str, part: str) -> str:
    """The extractor weight set of a result blob: itself, or its non-head tensors (deterministic)."""
    if part != "full":
        return blob
    tensors, meta = load_weights(store, blob)
    return save_weights(store, {k: v for k, v in tensors.items() if not k.startswith(HEAD_PREFIXES)},
                        {**meta, "part": "extractor"})


def register_global(home: NodeHome, store: BlobStore, *, base: ModelRecord, blob: str, part: str, entry: Entry,
                    kind: str, extra_blobs: dict | None = None, extra_provenance: dict | None = None,
                    judge: Callable[[ModelRecord], dict] | None = None) -> str:
    """Register the node's global model: `blob` (a full set) or the fused extractor + `base`'s head.
    `judge(record)` (`atdnode.aggregation.candidates.judge_candidates`: the node's own model `base` and the
    new one scored on its validation data, the `[aggregate] keep` policy applied) gives fields
    for the new record's provenance (candidates, kept, kept_why) before it is added."""
    ext_blob = extractor_of(store, blob, part)
    if part == "full":
        full_blob = blob
    else:
        full, meta = load_weights(store, base.blobs["full"])
        fused, _ = load_weights(store, blob)
        full.update(fused)
        full_blob = save_weights(store, full, {**meta, "part": "full", "aggregate": entry.id.hex()})
    inputs = list(entry.body.get("inputs", []))
    prov = {"base": entry.body.get("base"), "aggregate": entry.id.hex(), "entries": inputs, "kind": kind, "base_model": base.id,
            "data": base.provenance.get("data"), **(extra_provenance or {})}
    labels, label_fp, cfg = list(base.labels), base.label_fp, base.model
    if part == "full":  # averaged heads: the record describes them, not the base's head
        meta = read_meta(store, blob)
        labels, label_fp, cfg = list(meta.get("labels") or labels), meta.get("label_fp") or label_fp, meta.get("model") or cfg
    rec = ModelRecord(model=cfg, labels=labels, label_fp=label_fp, samples=base.samples, metrics={},
                      blobs={"full": full_blob, "extractor": ext_blob, **(extra_blobs or {})}, provenance=prov)
    if judge is not None:
        rec.provenance.update(judge(rec))
    model_id = register_model(home, rec, recorded_in=entry.id)  # only once the entry is durable; applies the size limit
    reg = ModelRegistry.of(home)
    for name, c in (rec.provenance.get("candidates") or {}).items():
        if isinstance(c, dict) and "kind" in c and reg.path(c.get("model") or model_id).is_file():  # not one the size limit removed
            reg.add_evaluation(c.get("model") or model_id, {  # each candidate's score, as `atd classify` would record it
                "data": rec.provenance["candidates"]["data"], "split": rec.provenance["candidates"]["scored_on"],
                "kind": c["kind"], "n": c["n"], "accuracy": c["accuracy"], "f1": c["f1"], "candidate": name,
                **{k: v for k, v in (("balanced_accuracy", c.get("balanced_accuracy")),
                                     ("warning", rec.provenance["candidates"].get("warning"))) if v is not None}})
    return model_id
