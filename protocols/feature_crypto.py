"""Seal labelled feature arrays to named recipients (X25519 + HKDF-SHA256 + ChaCha20-Poly1305).

Envelope (one msgpack map, never pickle)::

    {"v": 1, "alg": ALG, "sender": str, "sender_pub": 32 B, "eph_pub": 32 B,
     "shape": [N, D], "dtype": "<f4", "labels_dtype": "<i8", "n_classes": C,
     "recipients": [{"id": str, "pub": 32 B, "nonce": 12 B, "key": 48 B}, ...],   # sorted by id
     "nonce": 12 B, "ct": bytes}

* A random 32-byte content key encrypts the payload once with
  ChaCha20-Poly1305; the payload is msgpack ``{"features": raw little-endian
  float32 bytes, "labels": raw int64 bytes, "classes": [str]}``.
* For each recipient R the content key is wrapped with
  ``HKDF-SHA256(DH(eph, R) || DH(sender, R), info=WRAP_INFO || sender_pub ||
  eph_pub || R_pub || R_id)``. The fresh ephemeral key keeps old envelopes
  secret if the sender's key leaks later; the sender's static key means only
  its holder (or R itself) could have produced R's wrap. Publishing on the
  ledger adds the sender's Ed25519 signature on top.
* The associated data of every AEAD call is the canonical msgpack of the
  header (all fields except the wraps' nonces/keys and the ciphertext), so
  changing the sender, the recipient list, the shape or the dtype makes
  decryption fail.

:func:`open_sealed` raises :class:`DecryptionError` for a non-recipient, a key
that does not match, or any tampering; :class:`EnvelopeError` for a blob that
is not a well-formed envelope or whose decrypted contents contradict its
header. :func:`envelope_info` reads the public header without a key, so a node
can record on the ledger who may read what.

:func:`seal_bytes` / :func:`open_sealed_bytes` seal an opaque payload (e.g. a p-FESTA
campaign's secret embedder as safetensors bytes) with the same key wrapping; their
envelope is ``{"v": 1, "alg": ALG, "purpose": str, "sender", "sender_pub", "eph_pub",
"size": len(payload), "recipients", "nonce", "ct"}`` and its associated data
(domain ``atd-sealed-bytes-v1``) binds the purpose, so a features envelope never opens as
a secret or the other way round.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["seal", "open_sealed", "envelope_info", "seal_bytes", "open_sealed_bytes", "public_bytes", "Opened",
           "sealed_bytes_info",
           "FeatureCryptoError", "DecryptionError", "EnvelopeError", "ALG"]

ALG = "X25519-HKDF-SHA256-ChaCha20Poly1305"
WRAP_INFO = b"atd-feature-wrap-v1\x00"
_FEATURES_DTYPE, _LABELS_DTYPE = "<f4", "<i8"
_MAX_ENVELOPE = 1 << 34  # 16 GiB: refuse absurd sizes before unpacking


class FeatureCryptoError(ValueError):
    """Base class: sealing or opening feature envelopes failed."""


class DecryptionError(FeatureCryptoError):
    """Not a recipient, the wrong key, or a tampered envelope."""


class EnvelopeError(FeatureCryptoError):
    """Malformed envelope, or bad arrays to seal / found inside."""


class Opened(NamedTuple):
    features: np.ndarray  # (N, D) float32
    labels: np.ndarray  # (N,) int64, indices into class_names
    class_names: list[str]


def public_bytes(key: X25519PrivateKey | X25519PublicKey) -> bytes:
    """The raw 32-byte X25519 public key (as announced in a ``hello`` entry)."""
    pub = key.public_key() if isinstance(key, X25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def seal(features: np.ndarray, labels: np.ndarray, class_names: Sequence[str],
         recipients: Mapping[str, bytes | X25519PublicKey], sender_private: X25519PrivateKey, *,
         sender_id: str = "") -> bytes:
    """Encrypt ``features`` (N, D) float32 and ``labels`` (N,) (indices into
    ``class_names``) so that only ``recipients`` (id -> X25519 public key) can
    read them. Raises :class:`EnvelopeError` for bad arrays or keys."""
    feats = _check_features(features)
    labs = _check_labels(labels, len(feats), class_names)
    pubs = _recipient_keys(recipients)
    eph = X25519PrivateKey.generate()
    header = {"v": 1, "alg": ALG, "sender": str(sender_id), "sender_pub": public_bytes(sender_private),
              "eph_pub": public_bytes(eph), "shape": list(feats.shape), "dtype": _FEATURES_DTYPE,
              "labels_dtype": _LABELS_DTYPE, "n_classes": len(class_names),
              "recipients": [{"id": rid, "pub": public_bytes(pubs[rid])} for rid in sorted(pubs)]}
    payload = msgpack.packb({"features": feats.astype(_FEATURES_DTYPE, copy=False).tobytes(),
                             "labels": labs.astype(_LABELS_DTYPE, copy=False).tobytes(),
                             "classes": list(class_names)}, use_bin_type=True)
    return _encrypt(header, _associated_data(header), payload, eph, sender_private, pubs)


def _recipient_keys(recipients: Mapping[str, bytes | X25519PublicKey]) -> dict[str, X25519PublicKey]:
    if not recipients:
        raise EnvelopeError("need at least one recipient")
    pubs = {}
    for rid, pub in recipients.items():
        if not isinstance(rid, str) or not rid:
            raise EnvelopeError(f"recipient ids must be non-empty strings, got {rid!r}")
        pubs[rid] = _load_public(pub, f"recipient {rid!r}")
    return pubs


def _encrypt(header: dict[str, Any], ad: bytes, payload: bytes, eph: X25519PrivateKey,
             sender_private: X25519PrivateKey, pubs: Mapping[str, X25519PublicKey]) -> bytes:
    """Wrap a fresh content key for every recipient of ``header`` and encrypt ``payload``."""
    content_key = ChaCha20Poly1305.generate_key()
    for entry in header["recipients"]:
        wrap = _wrap_key(eph, sender_private, header, entry, pubs[entry["id"]])
        entry["nonce"] = os.urandom(12)
        entry["key"] = ChaCha20Poly1305(wrap).encrypt(entry["nonce"], content_key, ad)
    nonce = os.urandom(12)
    return msgpack.packb({**header, "nonce": nonce, "ct": ChaCha20Poly1305(content_key).encrypt(nonce, payload, ad)},
                         use_bin_type=True)


def _decrypt(env: Mapping[str, Any], ad: bytes, my_private: X25519PrivateKey, my_id: str) -> bytes:
    """The payload of a parsed envelope addressed to ``my_id`` (DecryptionError otherwise)."""
    entry = next((r for r in env["recipients"] if r["id"] == my_id), None)
    if entry is None:
        raise DecryptionError(f"{my_id!r} is not a recipient of this envelope "
                              f"(recipients: {', '.join(r['id'] for r in env['recipients'])})")
    if entry["pub"] != public_bytes(my_private):
        raise DecryptionError(f"the envelope was sealed to another key for {my_id!r}")
    eph_pub = _load_public(env["eph_pub"], "eph_pub", EnvelopeError)
    sender_pub = _load_public(env["sender_pub"], "sender_pub", EnvelopeError)
    wrap = _unwrap_key(my_private, eph_pub, sender_pub, env, entry)
    try:
        content_key = ChaCha20Poly1305(wrap).decrypt(entry["nonce"], entry["key"], ad)
        return ChaCha20Poly1305(content_key).decrypt(env["nonce"], env["ct"], ad)
    except (InvalidTag, ValueError):
        raise DecryptionError("envelope was tampered with (authentication failed)") from None


def seal_bytes(payload: bytes, recipients: Mapping[str, bytes | X25519PublicKey],
               sender_private: X25519PrivateKey, *, purpose: str, sender_id: str = "") -> bytes:
    """Encrypt an opaque ``payload`` for ``recipients`` (id -> X25519 public key); ``purpose``
    names what it is and must match on opening. EnvelopeError for bad keys or arguments."""
    if not isinstance(payload, (bytes, bytearray)):
        raise EnvelopeError("payload must be bytes")
    if not isinstance(purpose, str) or not purpose:
        raise EnvelopeError("purpose must be a non-empty string")
    pubs = _recipient_keys(recipients)
    eph = X25519PrivateKey.generate()
    header = {"v": 1, "alg": ALG, "purpose": purpose, "sender": str(sender_id),
              "sender_pub": public_bytes(sender_private), "eph_pub": public_bytes(eph), "size": len(payload),
              "recipients": [{"id": rid, "pub": public_bytes(pubs[rid])} for rid in sorted(pubs)]}
    return _encrypt(header, _bytes_ad(header), bytes(payload), eph, sender_private, pubs)


def open_sealed_bytes(blob: bytes, my_private: X25519PrivateKey, my_id: str, *, purpose: str) -> bytes:
    """The payload of a :func:`seal_bytes` envelope addressed to ``my_id`` for ``purpose``."""
    env = _parse(blob, _BYTES_SCHEMA)
    if env["purpose"] != purpose:
        raise EnvelopeError(f"envelope is for {env['purpose']!r}, not {purpose!r}")
    payload = _decrypt(env, _bytes_ad(env), my_private, my_id)
    if len(payload) != env["size"]:
        raise EnvelopeError(f"payload holds {len(payload)} bytes, header says {env['size']}")
    return payload


def sealed_bytes_info(blob: bytes) -> dict[str, Any]:
    """The public header of a :func:`seal_bytes` envelope (not authenticated until opened)."""
    env = _parse(blob, _BYTES_SCHEMA)
    return {"purpose": env["purpose"], "sender": env["sender"], "sender_pub": env["sender_pub"].hex(),
            "recipients": [r["id"] for r in env["recipients"]], "size": env["size"]}


def _bytes_ad(env: Mapping[str, Any]) -> bytes:
    fields = ("v", "alg", "purpose", "sender", "sender_pub", "eph_pub", "size")
    return msgpack.packb([b"atd-sealed-bytes-v1"] + [env[f] for f in fields]
                         + [[(r["id"], r["pub"]) for r in env["recipients"]]], use_bin_type=True)


def open_sealed(blob: bytes, my_private: X25519PrivateKey, my_id: str) -> Opened:
    """Decrypt an envelope addressed to ``my_id``; see the module doc for errors."""
    env = _parse(blob)
    return _decode_payload(_decrypt(env, _associated_data(env), my_private, my_id), env)


def envelope_info(blob: bytes) -> dict[str, Any]:
    """The public header: ``sender``, ``sender_pub`` (hex), ``recipients`` (ids),
    ``shape``, ``dtype``, ``n_classes``. Not authenticated until opened."""
    env = _parse(blob)
    return {"sender": env["sender"], "sender_pub": env["sender_pub"].hex(),
            "recipients": [r["id"] for r in env["recipients"]], "shape": list(env["shape"]),
            "dtype": env["dtype"], "n_classes": env["n_classes"]}


# ---------------------------------------------------------------- internals

def _check_features(features: np.ndarray) -> np.ndarray:
    arr = np.asarray(features)
    if arr.dtype != np.float32:
        raise EnvelopeError(f"features must be float32, got {arr.dtype}")
    if arr.ndim != 2:
        raise EnvelopeError(f"features must be 2-D (N, D), got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise EnvelopeError("features contain NaN or infinity")
    return arr


def _check_labels(labels: np.ndarray, n: int, class_names: Sequence[str]) -> np.ndarray:
    if isinstance(class_names, (str, bytes)) or not all(isinstance(c, str) for c in class_names) \
            or len(set(class_names)) != len(class_names):
        raise EnvelopeError("class_names must be distinct strings")
    arr = np.asarray(labels)
    if arr.shape != (n,) or not np.issubdtype(arr.dtype, np.integer):
        raise EnvelopeError(f"labels must be {n} integers, got {arr.dtype} {arr.shape}")
    if n and (arr.min() < 0 or arr.max() >= len(class_names)):
        raise EnvelopeError(f"labels must index the {len(class_names)} class names")
    return arr


def _load_public(pub: Any, what: str, error: type[FeatureCryptoError] = EnvelopeError) -> X25519PublicKey:
    if isinstance(pub, X25519PublicKey):
        return pub
    if not isinstance(pub, (bytes, bytearray)) or len(pub) != 32:
        raise error(f"{what}: X25519 public key must be 32 bytes")
    return X25519PublicKey.from_public_bytes(bytes(pub))


def _associated_data(env: Mapping[str, Any]) -> bytes:
    fields = ("v", "alg", "sender", "sender_pub", "eph_pub", "shape", "dtype", "labels_dtype", "n_classes")
    return msgpack.packb([b"atd-features-v1"] + [env[f] for f in fields]
                         + [[(r["id"], r["pub"]) for r in env["recipients"]]], use_bin_type=True)


def _kdf(shared: bytes, env: Mapping[str, Any], entry: Mapping[str, Any]) -> bytes:
    info = WRAP_INFO + env["sender_pub"] + env["eph_pub"] + entry["pub"] + entry["id"].encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def _wrap_key(eph: X25519PrivateKey, sender: X25519PrivateKey, env: Mapping[str, Any],
              entry: Mapping[str, Any], pub: X25519PublicKey) -> bytes:
    return _kdf(eph.exchange(pub) + sender.exchange(pub), env, entry)


def _unwrap_key(mine: X25519PrivateKey, eph_pub: X25519PublicKey, sender_pub: X25519PublicKey,
                env: Mapping[str, Any], entry: Mapping[str, Any]) -> bytes:
    try:
        shared = mine.exchange(eph_pub) + mine.exchange(sender_pub)
    except ValueError:  # low-order point: all-zero shared secret
        raise DecryptionError("envelope carries an invalid public key") from None
    return _kdf(shared, env, entry)


_SCHEMA = {"v": int, "alg": str, "sender": str, "sender_pub": bytes, "eph_pub": bytes, "shape": list,
           "dtype": str, "labels_dtype": str, "n_classes": int, "recipients": list, "nonce": bytes, "ct": bytes}
_RECIPIENT = {"id": str, "pub": bytes, "nonce": bytes, "key": bytes}


_BYTES_SCHEMA = {"v": int, "alg": str, "purpose": str, "sender": str, "sender_pub": bytes, "eph_pub": bytes,
                 "size": int, "recipients": list, "nonce": bytes, "ct": bytes}


def _parse(blob: bytes, schema: Mapping[str, type] = _SCHEMA) -> dict[str, Any]:
    if not isinstance(blob, (bytes, bytearray, memoryview)) or len(blob) > _MAX_ENVELOPE:
        raise EnvelopeError("envelope must be bytes of a sane size")
    try:
        env = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for junk
        raise EnvelopeError(f"not a msgpack envelope: {e}") from None
    if not isinstance(env, dict) or env.get("v") != 1 or env.get("alg") != ALG:
        raise EnvelopeError(f"not a version-1 {ALG} envelope")
    for field, kind in schema.items():
        if type(env.get(field)) is not kind:
            raise EnvelopeError(f"envelope field {field!r} missing or not {kind.__name__}")
    if schema is _SCHEMA:
        shape = env["shape"]
        if len(shape) != 2 or not all(type(d) is int and d >= 0 for d in shape):
            raise EnvelopeError(f"envelope shape must be [N, D], got {shape!r}")
        if env["dtype"] != _FEATURES_DTYPE or env["labels_dtype"] != _LABELS_DTYPE:
            raise EnvelopeError(f"unsupported dtypes {env['dtype']!r}/{env['labels_dtype']!r}")
    ids = []
    for r in env["recipients"]:
        if not isinstance(r, dict) or any(type(r.get(f)) is not k for f, k in _RECIPIENT.items()):
            raise EnvelopeError("malformed recipient entry")
        ids.append(r["id"])
    if not ids or ids != sorted(set(ids)):
        raise EnvelopeError("recipients must be non-empty, distinct and sorted")
    return env


def _decode_payload(payload: bytes, env: Mapping[str, Any]) -> Opened:
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        feats, labs, classes = body["features"], body["labels"], body["classes"]
    except Exception as e:
        raise EnvelopeError(f"decrypted payload is malformed: {e}") from None
    n, d = env["shape"]
    if not isinstance(feats, bytes) or len(feats) != n * d * 4:
        raise EnvelopeError(f"features hold {len(feats) if isinstance(feats, bytes) else '?'} bytes, "
                            f"header says shape {[n, d]} float32 ({n * d * 4} bytes)")
    if not isinstance(labs, bytes) or len(labs) != n * 8:
        raise EnvelopeError(f"labels hold the wrong number of bytes for {n} int64 labels")
    if not isinstance(classes, list) or len(classes) != env["n_classes"]:
        raise EnvelopeError("class list does not match the header")
    features = np.frombuffer(feats, dtype=_FEATURES_DTYPE).reshape(n, d).astype(np.float32)
    labels = np.frombuffer(labs, dtype=_LABELS_DTYPE).astype(np.int64)
    _check_features(features)
    _check_labels(labels, n, classes)
    return Opened(features, labels, list(classes))
