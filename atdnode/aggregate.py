"""Node-level one-time aggregation: pick published weight sets, combine them, record it.

The math is `protocols.aggregation`; this module chooses inputs from the ledger, checks
them (blob hash, model config, part, label space), runs the streaming average, stores the
result as a safetensors blob and appends a signed `aggregate` entry naming the input
entries, the weighting, the exact weights and the result blob. Anyone holding the same
inputs recomputes the result bit for bit (`verify_aggregate`), because the average follows
a fixed arithmetic order.

When the inputs are extractors, the node's global model is the fused extractor plus its
own head (registered in the model registry, so `atd classify` and `publish-weights` can
use it). When the inputs are full models over the same label space, heads are averaged too.
"""
from __future__ import annotations

from dataclasses import dataclass

from atdnode.blobstore import BlobStore
from atdnode.errors import AtdError, ConfigError
from atdnode.home import NodeHome
from atdnode.identity import NodeIdentity
from atdnode.model import ModelConfig
from atdnode.registry import ModelRecord, ModelRegistry
from atdnode.weights import load_weights, read_meta, save_weights
from ledger import Entry, Ledger
from protocols.aggregation import (
    AggregationError,
    compute_weights,
    last_layer_key,
    load_tensor,
    safetensors_loader,
    weighted_average,
)

HORIZONTAL_WEIGHTINGS = ("uniform", "samples", "sqrt-classes", "fedwavg")


class AggregateError(AtdError):
    """Inputs cannot be aggregated (none, incompatible, missing blobs) or a result does not verify."""


@dataclass
class AggregateResult:
    entry: Entry
    blob: str
    weights: list[float]
    inputs: list[str]
    model_id: str | None


def _weights_entries(led: Ledger, ids: list[str] | None) -> list[Entry]:
    if ids:
        out = []
        for h in ids:
            try:
                e = led.get(bytes.fromhex(h))
            except ValueError:
                raise AggregateError(f"input {h!r} is not a hex entry id") from None
            if e is None:
                raise AggregateError(f"input entry {h[:16]} is not in this node's ledger")
            if e.kind != "weights":
                raise AggregateError(f"input entry {h[:16]} is a {e.kind} entry, not weights")
            out.append(e)
        return out
    return led.query(kind="weights")


def select_inputs(home: NodeHome, led: Ledger, store: BlobStore, *, ids: list[str] | None = None,
                  part: str | None = None) -> list[Entry]:
    """Published weight sets this node holds that fit its own model (default: all of them).

    Explicitly named inputs that do not fit are an error; when defaulting, misfits are skipped.
    """
    own = ModelRegistry(home).get("latest")
    cfg = ModelConfig.from_dict(own.model)
    chosen: list[Entry] = []
    for e in _weights_entries(led, ids):
        b = e.body
        problem = None
        if not store.has(str(b.get("blob"))):
            problem = "its blob has not been fetched (is the daemon running?)"
        elif part is not None and b.get("part") != part:
            problem = f"it is a {b.get('part')} set, not {part}"
        else:
            their = ModelConfig.from_dict(b.get("model") or {})
            diff = cfg.diff(their, ignore=("num_classes",) if b.get("part") == "extractor" else ())
            if diff:
                problem = "another model config: " + ", ".join(diff)
        if problem:
            if ids:
                raise AggregateError(f"input {e.id.hex()[:16]}: {problem}")
            continue
        chosen.append(e)
    if not chosen:
        raise AggregateError("no compatible published weight sets held locally (publish and fetch first)")
    parts = {e.body["part"] for e in chosen}
    if len(parts) > 1:
        raise AggregateError(f"inputs mix parts {sorted(parts)}; choose one with --inputs")
    return chosen


def horizontal_weights(store: BlobStore, inputs: list[Entry], weighting: str, *, q: float = 1.0) -> list[float]:
    """Per-input weights for a horizontal average, per the named weighting."""
    if weighting == "uniform":
        w = compute_weights("uniform", n=len(inputs))
    elif weighting == "samples":
        w = compute_weights("samples", counts=[int(e.body.get("samples", 0)) for e in inputs])
    elif weighting == "sqrt-classes":
        w = compute_weights("sqrt-classes", counts=[len(e.body.get("labels", [])) for e in inputs])
    elif weighting == "fedwavg":
        loaders = [safetensors_loader(store.path(e.body["blob"])) for e in inputs]
        same_labels = len({e.body.get("label_fp") for e in inputs}) == 1 and inputs[0].body.get("part") != "extractor"
        key = last_layer_key(read_keys(store, inputs[0].body["blob"]), heads_comparable=same_labels)
        layers = [load_tensor(ld, key) for ld in loaders]
        w = compute_weights("fedwavg", reference=layers[0], layers=layers, q=q)
    else:
        raise AggregateError(f"weighting {weighting!r} is not for horizontal mode ({', '.join(HORIZONTAL_WEIGHTINGS)})")
    return [float(x) for x in w]


def read_keys(store: BlobStore, blob: str) -> list[str]:
    src = safetensors_loader(store.path(blob))()
    try:
        return list(src.keys())
    finally:
        src.close()


def _average(store: BlobStore, inputs: list[Entry], weights: list[float]) -> dict:
    for e in inputs:
        store.verify(e.body["blob"])  # the bytes are what the signed entry names
    loaders = [safetensors_loader(store.path(e.body["blob"])) for e in inputs]
    names = [f"entry {e.id.hex()[:12]}" for e in inputs]
    try:
        return weighted_average(loaders, weights, names=names)
    except AggregationError as exc:
        raise AggregateError(str(exc)) from None


def aggregate_horizontal(home: NodeHome, *, weighting: str = "uniform", inputs: list[str] | None = None,
                         q: float = 1.0) -> AggregateResult:
    """Average compatible published weight sets; record an `aggregate` entry; register the global model."""
    ident = NodeIdentity.load(home)
    store = BlobStore(home.blobs_dir)
    led = Ledger.open(home.ledger_db)
    try:
        chosen = select_inputs(home, led, store, ids=inputs)
        weights = horizontal_weights(store, chosen, weighting, q=q)
        result = _average(store, chosen, weights)
        part = chosen[0].body["part"]
        first_meta = read_meta(store, chosen[0].body["blob"])
        meta = {**first_meta, "part": part, "aggregate": {"mode": "horizontal", "weighting": weighting}}
        blob = save_weights(store, result, meta)
        ids = [e.id.hex() for e in chosen]
        body = {
            "mode": "horizontal",
            "weighting": weighting,
            "q": q,
            "weights": weights,
            "inputs": ids,
            "part": part,
            "blob": blob,
            "size": store.size(blob),
            "manifest": store.manifest(blob).hash,
            "model": chosen[0].body.get("model"),
        }
        entry = led.append(ident.signer, "aggregate", body)
    finally:
        led.close()
    model_id = _register_global(home, store, blob, part, ids, entry)
    return AggregateResult(entry=entry, blob=blob, weights=weights, inputs=ids, model_id=model_id)


def _register_global(home: NodeHome, store: BlobStore, blob: str, part: str, ids: list[str], entry: Entry) -> str | None:
    """Global model = fused extractor + this node's own head (or the fused full model)."""
    reg = ModelRegistry(home)
    own = reg.get("latest")
    if part == "extractor":
        fused, _ = load_weights(store, blob)
        head_blob = own.blobs.get("full")
        if not head_blob:
            return None
        full, meta = load_weights(store, head_blob)
        full.update(fused)
        full_blob = save_weights(store, full, {**meta, "part": "full", "aggregate": entry.id.hex()})
    elif part == "full":
        full_blob = blob
    else:
        return None
    rec = ModelRecord(
        model=own.model, labels=own.labels, label_fp=own.label_fp, samples=own.samples, metrics={},
        blobs={"full": full_blob, "extractor": blob if part == "extractor" else ""},
        provenance={"aggregate": entry.id.hex(), "entries": ids, "kind": "global-horizontal"},
    )
    return reg.add(rec)


def verify_aggregate(home: NodeHome, entry_id: str) -> str:
    """Recompute an `aggregate` entry from its inputs; return the result hash or raise AggregateError."""
    store = BlobStore(home.blobs_dir)
    led = Ledger.open(home.ledger_db)
    try:
        try:
            e = led.get(bytes.fromhex(entry_id))
        except ValueError:
            raise AggregateError(f"{entry_id!r} is not a hex entry id") from None
        if e is None or e.kind != "aggregate":
            raise AggregateError(f"no aggregate entry {entry_id[:16]} in this ledger")
        body = e.body
        if body.get("mode") != "horizontal":
            raise ConfigError(f"verification of {body.get('mode')} aggregates is done with its own command")
        inputs = _weights_entries(led, list(body["inputs"]))
    finally:
        led.close()
    for i in inputs:
        if not store.has(i.body["blob"]):
            raise AggregateError(f"input blob {i.body['blob'][:12]} is not held here (fetch it first)")
    result = _average(store, inputs, [float(x) for x in body["weights"]])
    meta = {**read_meta(store, inputs[0].body["blob"]), "part": body["part"],
            "aggregate": {"mode": "horizontal", "weighting": body["weighting"]}}
    blob = save_weights(store, result, meta)
    if blob != body["blob"]:
        raise AggregateError(f"aggregate {entry_id[:16]} does not verify: recomputed {blob[:16]}, recorded {body['blob'][:16]}")
    return blob
