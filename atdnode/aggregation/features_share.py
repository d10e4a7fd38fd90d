"""Share CLS features (with labels) sealed to named peers; open the ones sealed to this node.

`share_features` extracts the CLS features of the node's own data with a model's extractor,
seals them (protocols.feature_crypto: X25519 + HKDF + ChaCha20-Poly1305) to the recipients'
X25519 keys as announced in their signed `hello` entries, stores the envelope as a blob and
appends a signed `features` entry::

    {"blob", "size", "manifest", "recipients": [peer ids, sorted], "shape": [N, D],
     "classes": [names], "label_fp", "samples": N, "model": {config}, "model_id",
     "extractor": hex blob of the extractor that made them, "provenance": [entry ids],
     "alg": feature_crypto.ALG}

The ledger thus records who may read what; the daemon fetches the blob only on nodes named
in `recipients`. `open_features` checks the envelope against the signed entry (sender,
recipients, shape, the sender's announced X25519 key) before decrypting; a non-recipient
gets a `FeaturesError` (from feature_crypto's DecryptionError), never the plaintext.

Own features are cached per (extractor blob, data) under HOME/features as safetensors,
so sharing and the vertical ensemble extract them once.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from atdnode import bodies
from atdnode.blobs import BlobStore
from atdnode.data import DataSpec, label_fingerprint, load_dataset
from atdnode.errors import AtdError, BlobError
from atdnode.learning import ModelConfig, build_model, extract_features, load_part, part_spec
from atdnode.node import NodeHandle, NodeHome, NodeIdentity
from atdnode.models import ModelRecord, ModelRegistry, load_weights
from ledger import Entry, Ledger, LedgerError, peer_id_from_public_key, public_key_from_peer_id
from protocols.feature_crypto import ALG, FeatureCryptoError, envelope_info, open_sealed, seal


class FeaturesError(AtdError):
    """Features cannot be shared or opened: unknown recipient key, not a recipient, bad envelope."""


@dataclass
class SharedFeatures:
    entry: Entry
    blob: str
    size: int
    recipients: list[str]
    shape: list[int]


@dataclass
class OpenedFeatures:
    entry: str  # hex id of the features entry
    sender: str  # peer id of its author
    X: np.ndarray  # (N, D) float32
    y: np.ndarray  # (N,) int64 indices into classes
    classes: list[str]
    extractor: str  # hex blob of the extractor that made them


# ---------------------------------------------------------------- own features

def extractor_blob(store: BlobStore, record: ModelRecord) -> str:
    """The blob of `record`'s extractor weights (made from its full set if not stored yet)."""
    from atdnode.models import part_blob

    return part_blob(store, record, "extractor")


def model_with_extractor(store: BlobStore, cfg: ModelConfig, blob: str) -> nn.Module:
    """A model of `cfg` whose extractor is the (checked) weight set `blob`; the head is unused."""
    torch.manual_seed(0)
    model = build_model(cfg)
    tensors, _ = load_weights(store, blob, expect=part_spec(model, "extractor"))
    load_part(model, tensors, "extractor")
    return model.eval()


def _cache_key(spec: str, cfg: ModelConfig, split: str) -> str:
    ds = DataSpec.parse(spec)
    stamp = ""
    if ds.path is not None:  # a changed data file must not hit a stale cache
        try:
            st = Path(ds.path).expanduser().stat()
            stamp = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            pass
    raw = json.dumps([spec, stamp, cfg.img_size, cfg.in_chans, split])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def node_features(home: NodeHome, store: BlobStore, cfg: ModelConfig, extractor: str, data_spec: str, *,
                  split: str = "train", batch_size: int = 256, device: str | None = None
                  ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """CLS features of this node's data under `extractor`: (X float32 (N, D), y int64, classes),
    extracted on `device` (atdnode.learning.device rule: else $ATD_DEVICE, HOME's [compute] device, CUDA
    when present; bf16 autocast on CUDA) and cached under HOME/features."""
    from atdnode.learning import resolve_device

    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import save_file

    path = home.features_dir / f"{extractor[:24]}-{_cache_key(data_spec, cfg, split)}.safetensors"
    if path.is_file():
        try:
            with safe_open(str(path), framework="np") as f:
                classes = json.loads((f.metadata() or {})["classes"])
                return f.get_tensor("X"), f.get_tensor("y"), list(classes)
        except (OSError, KeyError, ValueError, SafetensorError):
            path.unlink(missing_ok=True)  # a damaged cache file is simply rebuilt
    dev = resolve_device(device, home=home)  # a bad choice fails before the data loads
    data = load_dataset(data_spec, cfg.img_size, cfg.in_chans, split)
    X, y = extract_features(model_with_extractor(store, cfg, extractor), data, batch_size, device=dev)
    home.features_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"X": X, "y": y}, str(tmp), metadata={"classes": json.dumps(data.classes), "spec": data_spec})
    tmp.replace(path)
    return X, y, list(data.classes)


def data_spec_of(record: ModelRecord, given: str | None) -> str:
    spec = given or record.provenance.get("data")
    if not spec:
        raise FeaturesError(f"model {record.id} does not name its training data; pass --data SPEC")
    return str(spec)


# ---------------------------------------------------------------- keys

def announced_key(led: Ledger, author: bytes) -> bytes | None:
    """The X25519 key in `author`'s latest `hello` entry, if any."""
    hellos = led.query(kind="hello", author=author)
    for e in reversed(hellos):
        if not bodies.fits(e):
            continue
        key = e.body.get("x25519")
        if isinstance(key, bytes) and len(key) == 32:
            return key
    return None


def recipient_keys(led: Ledger, peer_ids: list[str]) -> dict[str, bytes]:
    """peer id -> X25519 public key from its signed `hello`; FeaturesError names a bad recipient."""
    if not peer_ids:
        raise FeaturesError("name at least one recipient (--to PEER_ID)")
    members = led.membership()
    out: dict[str, bytes] = {}
    for pid in dict.fromkeys(p.strip() for p in peer_ids):
        try:
            pk = public_key_from_peer_id(pid)
        except (LedgerError, ValueError):
            raise FeaturesError(f"recipient {pid!r} is not a peer id (see `atd id`)") from None
        if not members.is_member(pk):
            raise FeaturesError(f"recipient {pid} is not a member of this consortium")
        key = announced_key(led, pk)
        if key is None:
            raise FeaturesError(f"recipient {pid} has announced no X25519 key (no `hello` entry from it yet; "
                                f"is its daemon running and synced?)")
        out[pid] = key
    return out


# ---------------------------------------------------------------- share / open

def share_features(home: NodeHome, *, to: list[str], data_spec: str | None = None, model: str = "latest",
                   batch_size: int = 256, device: str | None = None) -> SharedFeatures:
    """Seal the CLS features of this node's data (model `model`'s extractor) to `to`; record it.
    The features are extracted on `device` (atdnode.learning.device rule); what is sealed is CPU float32."""
    home = NodeHandle.of(home)  # its store, registry and ledger: opened once for the steps below
    ident = NodeIdentity.load(home)
    store = BlobStore.of(home)
    record = ModelRegistry.of(home).get(model)
    spec = data_spec_of(record, data_spec)
    cfg = ModelConfig.from_dict(record.model)
    keys = recipient_keys(home.ledger, to)
    ext = extractor_blob(store, record)
    X, y, classes = node_features(home, store, cfg, ext, spec, batch_size=batch_size, device=device)
    try:
        sealed = seal(X, y, classes, keys, ident.x25519_private, sender_id=ident.peer_id)
    except FeatureCryptoError as exc:
        raise FeaturesError(f"cannot seal features: {exc}") from None
    blob = store.put_bytes(sealed)
    prov = [p for p in [record.provenance.get("aggregate")] if isinstance(p, str)]
    body = {"blob": blob, "size": len(sealed), "manifest": store.manifest(blob).hash, "recipients": sorted(keys),
            "shape": [int(X.shape[0]), int(X.shape[1])], "classes": list(classes),
            "label_fp": label_fingerprint(classes), "samples": int(len(y)), "model": record.model,
            "model_id": record.id, "extractor": ext, "provenance": prov, "alg": ALG}
    entry = bodies.append(home.ledger, ident.signer, "features", body)
    return SharedFeatures(entry=entry, blob=blob, size=len(sealed), recipients=sorted(keys), shape=body["shape"])


def own_peer_ids(led: Ledger, peer_id: str) -> set[str]:
    """`peer_id` and the ids this node had before rotating its key (features sealed to those
    are still ours: the X25519 key survives a rotation)."""
    m = led.membership()
    return {peer_id_from_public_key(k) for k in m.keys_of(public_key_from_peer_id(peer_id))}


def addressed_to(led: Ledger, peer_id: str) -> list[Entry]:
    """`features` entries whose recipients include `peer_id` or its earlier ids (log order)."""
    mine = own_peer_ids(led, peer_id)
    return [e for e in led.query(kind="features") if bodies.fits(e) and mine & set(e.body["recipients"])]


def open_features(ident: NodeIdentity, store: BlobStore, led: Ledger, entry: Entry) -> OpenedFeatures:
    """Decrypt a `features` entry's envelope with this node's key, after checking it against the entry."""
    eid = entry.id.hex()[:16]
    try:
        body = bodies.body_of(entry)
    except bodies.BodyError as exc:
        raise FeaturesError(str(exc)) from None
    sender = peer_id_from_public_key(entry.author)
    where = f"features {eid} from {sender[:16]}"
    blob = body.get("blob")
    try:
        raw = store.get_bytes(str(blob))
    except BlobError:
        raise FeaturesError(f"{where}: its blob is not held here (not fetched yet, or not sealed to us)") from None
    try:
        info = envelope_info(raw)
    except FeatureCryptoError as exc:
        raise FeaturesError(f"{where}: {exc}") from None
    if info["sender"] != sender or info["recipients"] != body.get("recipients") or info["shape"] != body.get("shape"):
        raise FeaturesError(f"{where}: the envelope's sender / recipients / shape differ from the signed entry")
    announced = announced_key(led, entry.author)
    if announced is not None and info["sender_pub"] != announced.hex():
        raise FeaturesError(f"{where}: sealed with an X25519 key its author never announced")
    mine = sorted(own_peer_ids(led, ident.peer_id) & {r for r in info["recipients"] if isinstance(r, str)}) \
        or [ident.peer_id]
    try:
        opened = open_sealed(raw, ident.x25519_private, mine[0])
    except FeatureCryptoError as exc:
        raise FeaturesError(f"{where}: cannot decrypt: {exc}") from None
    if opened.class_names != body.get("classes"):
        raise FeaturesError(f"{where}: class names inside differ from the signed entry")
    return OpenedFeatures(entry=entry.id.hex(), sender=sender, X=opened.features, y=opened.labels,
                          classes=opened.class_names, extractor=str(body.get("extractor", "")))
