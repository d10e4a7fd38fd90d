"""Canonical, domain-separated encoding of ledger entries.

    payload      = msgpack([author: bin32, seq: uint, prev: bin32, lamport: uint, kind: str, body: map])
    signed bytes = DOMAIN + payload             (what Ed25519 signs)
    entry id     = sha256(signed bytes)
    wire form    = msgpack([payload: bin, sig: bin64])   (gossip, dumps)

The body is canonicalised before packing: map keys must be str and are sorted (by code
point == UTF-8 byte order) recursively, tuples become lists, floats must be finite and
are always packed as float64, ints must fit msgpack (-2**63 .. 2**64-1). Anything else is
MalformedEntry. Decoding re-packs what it read and demands the identical bytes, so every
entry has exactly one encoding and one id.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

import msgpack

from ledger.errors import MalformedEntry

DOMAIN = b"atd-ledger-v1\0"
MAX_PAYLOAD_BYTES = 900_000  # keeps a wire entry under gossipsub's 1 MiB message cap
MAX_DEPTH = 32
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


def canonical(value: Any, _depth: int = 0) -> Any:
    """The canonical form of a body value (sorted maps, lists, bytes); MalformedEntry if unsupported."""
    if _depth > MAX_DEPTH:
        raise MalformedEntry(f"body nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, str)):
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise MalformedEntry("body string is not valid UTF-8") from None
            if type(value) is not str:  # a str subclass (enum...): the plain string msgpack decodes to
                value = str.__str__(value)
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise MalformedEntry(f"integer {value} does not fit msgpack")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MalformedEntry(f"non-finite float {value!r} in body")
        return float(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple)):
        return [canonical(v, _depth + 1) for v in value]
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise MalformedEntry(f"body map key {k!r} is not a string")
        return {k: canonical(value[k], _depth + 1) for k in sorted(value)}
    raise MalformedEntry(f"unsupported body type {type(value).__name__}")


def pack(obj: Any) -> bytes:
    """msgpack with bin type for bytes and float64 for floats (the only packing we use)."""
    return msgpack.packb(obj, use_bin_type=True, use_single_float=False, strict_types=False)


def _reject_ext(code: int, data: bytes) -> Any:
    raise MalformedEntry(f"msgpack ext type {code} is not allowed")


def unpack(data: bytes) -> Any:
    """Strict msgpack decode: str keys only, no ext types, no trailing bytes; MalformedEntry otherwise."""
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext, timestamp=0,
        )
    except MalformedEntry:
        raise
    except Exception as exc:  # msgpack raises ValueError/ExtraData/UnpackValueError/TypeError...
        raise MalformedEntry(f"undecodable msgpack ({type(exc).__name__}: {exc})") from None


def encode_payload(author: bytes, seq: int, prev: bytes, lamport: int, kind: str, body: dict) -> bytes:
    """Canonical payload bytes for entry fields (body is canonicalised here)."""
    return pack_payload(author, seq, prev, lamport, kind, canonical(body))


def pack_payload(author: bytes, seq: int, prev: bytes, lamport: int, kind: str, canon: dict) -> bytes:
    """`encode_payload` for a body already in `canonical` form (which equals what decoding
    the payload gives back, so a new entry keeps `canon` as its body)."""
    payload = pack([author, seq, prev, lamport, kind, canon])
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MalformedEntry(f"entry payload is {len(payload)} bytes (max {MAX_PAYLOAD_BYTES})")
    return payload


def decode_payload(payload: bytes, *, check_canonical: bool = True) -> tuple[bytes, int, bytes, int, str, dict]:
    """Fields of a payload. With check_canonical, re-encoding must give the same bytes."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MalformedEntry(f"entry payload is {len(payload)} bytes (max {MAX_PAYLOAD_BYTES})")
    fields = unpack(payload)
    if not isinstance(fields, list) or len(fields) != 6:
        raise MalformedEntry("payload is not a 6-element array")
    author, seq, prev, lamport, kind, body = fields
    if not (isinstance(author, bytes) and isinstance(prev, bytes) and isinstance(kind, str)
            and isinstance(body, dict) and type(seq) is int and type(lamport) is int):
        raise MalformedEntry("payload fields have the wrong types")
    if check_canonical and encode_payload(author, seq, prev, lamport, kind, body) != payload:
        raise MalformedEntry("payload is not canonically encoded")
    return author, seq, prev, lamport, kind, body


def signed_bytes(payload: bytes) -> bytes:
    return DOMAIN + payload


def entry_id(payload: bytes) -> bytes:
    """sha256(DOMAIN + payload)."""
    h = hashlib.sha256(DOMAIN)
    h.update(payload)
    return h.digest()


def encode_wire(payload: bytes, sig: bytes) -> bytes:
    return pack([payload, sig])


def decode_wire(raw: bytes) -> tuple[bytes, bytes]:
    """(payload, sig) from wire bytes; MalformedEntry on anything else."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise MalformedEntry(f"entry bytes expected, got {type(raw).__name__}")
    raw = bytes(raw)
    if len(raw) > MAX_PAYLOAD_BYTES + 128:
        raise MalformedEntry(f"entry is {len(raw)} bytes (too large)")
    obj = unpack(raw)
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], bytes) and isinstance(obj[1], bytes)):
        raise MalformedEntry("wire entry is not [payload, sig]")
    if pack(obj) != raw:
        raise MalformedEntry("wire entry is not canonically encoded")
    return obj[0], obj[1]
