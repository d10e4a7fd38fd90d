"""Sharing is an explicit, signed act: turn a trained model into a `weights` ledger entry.

`publish_weights` stores the requested part of a registered model as its own safetensors
blob (an extractor set holds only extractor tensors — the head never leaves the node),
computes its chunk manifest, and appends a signed `weights` entry naming blob, size,
manifest hash, part, model config, label space, sample count, metrics and provenance.
It only touches the local ledger and blob store, so it works with or without a running
daemon: the daemon gossips the entry when it next looks at the ledger, and serves the blob.
"""
from __future__ import annotations

from dataclasses import dataclass

from atdnode import bodies
from atdnode.blobs import BlobStore
from atdnode.errors import ConfigError
from atdnode.node import NodeHandle, NodeHome, NodeIdentity
from atdnode.models.registry import ModelRecord, ModelRegistry
from atdnode.models.weights import PARTS, load_weights, read_meta, save_weights
from ledger import Entry



@dataclass
class Published:
    entry: Entry
    blob: str
    size: int


def weights_body(store: BlobStore, blob: str, *, part: str, record: ModelRecord, provenance: list[str] | None = None) -> dict:
    """The body of a `weights` entry for `blob` (already in `store`)."""
    manifest = store.manifest(blob)
    return {
        "blob": blob,
        "size": store.size(blob),
        "manifest": manifest.hash,
        "part": part,
        "model": record.model,
        "labels": list(record.labels),
        "label_fp": record.label_fp,
        "samples": int(record.samples),
        "metrics": {k: v for k, v in record.metrics.items() if isinstance(v, (int, float, str))},
        "provenance": list(provenance or []),
        "model_id": record.id,
        **({"base": record.provenance["base"]} if isinstance(record.provenance.get("base"), str) else {}),
        # what it was trained on, for model cards (atdnode.report.card): counts and a hash, no file or image
        **({"class_counts": record.provenance["class_counts"]}
           if isinstance(record.provenance.get("class_counts"), dict) else {}),
        **({"data_fp": record.provenance["data_fp"]} if isinstance(record.provenance.get("data_fp"), str) else {}),
    }


def part_blob(store: BlobStore, record: ModelRecord, part: str) -> str:
    """The blob holding `part` of `record`, made from its full weight set if needed."""
    if part not in PARTS:
        raise ConfigError(f"unknown part {part!r} (choose from {', '.join(PARTS)})")
    blob = record.blobs.get(part)
    if blob and store.has(blob):
        return blob
    full = record.blobs.get("full")
    if not full or not store.has(full):
        raise ConfigError(f"model {record.id} has no stored weights to publish")
    from protocols.aggregation import HEAD_PREFIXES  # torch: only when a part is cut from the full set

    tensors, meta = load_weights(store, full)
    head = {k for k in tensors if k.startswith(HEAD_PREFIXES)}
    keep = {k: v for k, v in tensors.items() if (k in head) == (part == "head")} if part != "full" else tensors
    return save_weights(store, keep, {**meta, "part": part})


def publish_weights(home: NodeHome, *, model: str = "latest", part: str = "extractor") -> Published:
    """Sign and record a `weights` entry for `part` of model `model` (id, prefix or latest)."""
    home = NodeHandle.of(home)
    ident = NodeIdentity.load(home)
    record = ModelRegistry.of(home).get(model)
    store = BlobStore.of(home)
    blob = part_blob(store, record, part)
    meta_part = read_meta(store, blob).get("part")
    if meta_part != part:
        raise ConfigError(f"blob {blob[:12]} holds {meta_part} weights, not {part}")
    provenance = [p for p in record.provenance.get("entries", []) if isinstance(p, str)]
    body = weights_body(store, blob, part=part, record=record, provenance=provenance)
    entry = bodies.append(home.ledger, ident.signer, "weights", body)
    return Published(entry=entry, blob=blob, size=body["size"])
