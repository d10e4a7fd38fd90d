"""Canonical encoding, known-answer vectors, and rejection of malformed / forged entries."""
from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from ledger import (
    BadPeerId, BadSignature, Entry, MalformedEntry, Signer, ZERO_HASH, peer_id_from_public_key,
    public_key_from_peer_id,
)
from ledger import encoding

SEED = bytes(range(32))
KAT_BODY = {"role": "node", "addrs": ["/ip4/127.0.0.1/tcp/4001"], "n": -3, "f": 0.5, "b": b"\x01\x02",
            "z": None, "t": True, "m": {"y": 1, "x": []}}
KAT_PUBKEY = "03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"
KAT_PEER_ID = "12D3KooWA4Xop1JaT3MHxwYMkCepYsv4iPVopMXwCz5iHYdBfeSB"
KAT_SIGNED_1 = (
    "6174642d6c65646765722d76310096c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b801"
    "c420000000000000000000000000000000000000000000000000000000000000000001a568656c6c6f88a5616464727391b7"
    "2f6970342f3132372e302e302e312f7463702f34303031a162c4020102a166cb3fe0000000000000a16d82a17890a17901a1"
    "6efda4726f6c65a46e6f6465a174c3a17ac0"
)
KAT_ID_1 = "7a483b2212c6ca452e7b44fbab499c1a7d719d5acd0183a50f34dee801daa825"
KAT_SIG_1 = (
    "8f6e31b27f97c7011433301edcd3fe619b73cf6c42837a7f730369d9835509866bd0e9f0f00232af526b60114c31e494"
    "58046306f4b3fa30d81b3594d19aa400"
)
KAT_SIGNED_2 = (
    "6174642d6c65646765722d76310096c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b802"
    "c4207a483b2212c6ca452e7b44fbab499c1a7d719d5acd0183a50f34dee801daa82507a76d65747269637380"
)
KAT_ID_2 = "db54b56fa6c321415aeb2cf74d27656bf2632eb5e552d24f66199df0dcadc9f5"


@pytest.fixture(scope="module")
def signer() -> Signer:
    return Signer.from_seed(SEED)


def kat_entry(signer: Signer) -> Entry:
    return Entry.create(signer, seq=1, prev=ZERO_HASH, lamport=1, kind="hello", body=KAT_BODY)


def test_known_answer_vectors(signer):
    assert signer.public_key.hex() == KAT_PUBKEY
    assert signer.peer_id == KAT_PEER_ID
    e1 = kat_entry(signer)
    assert e1.signed_bytes().hex() == KAT_SIGNED_1
    assert e1.id.hex() == KAT_ID_1
    assert e1.sig.hex() == KAT_SIG_1  # Ed25519 is deterministic
    e2 = Entry.create(signer, seq=2, prev=e1.id, lamport=7, kind="metrics", body={})
    assert e2.signed_bytes().hex() == KAT_SIGNED_2
    assert e2.id.hex() == KAT_ID_2


def test_key_order_and_tuples_do_not_change_the_encoding(signer):
    a = Entry.create(signer, seq=1, prev=ZERO_HASH, lamport=1, kind="hello", body={"b": (1, 2), "a": {"d": 1, "c": 2}})
    b = Entry.create(signer, seq=1, prev=ZERO_HASH, lamport=1, kind="hello", body={"a": {"c": 2, "d": 1}, "b": [1, 2]})
    assert a.id == b.id and a.to_bytes() == b.to_bytes()
    assert list(a.body) == ["a", "b"]


def test_a_new_entry_body_is_exactly_what_its_payload_decodes_to(signer):
    """Entry keeps its canonical body instead of decoding the payload it just packed
    (group commit's per-entry cost): same value and same plain types."""
    import enum

    class Tag(str, enum.Enum):
        A = "a"

    class Big(int):
        pass

    body = {"t": Tag.A, "i": Big(7), "f": -0.0, "l": (1, (2.5, None)), "b": bytearray(b"\x00"), "m": {"z": True, "y": b""}}
    e = Entry.create(signer, seq=1, prev=ZERO_HASH, lamport=1, kind="hello", body=body)
    decoded = encoding.decode_payload(e.payload)[5]
    assert e.body == decoded and repr(e.body) == repr(decoded)
    assert type(e.body["t"]) is str and type(e.body["i"]) is int and type(e.body["b"]) is bytes


def test_wire_round_trip(signer):
    e = kat_entry(signer)
    back = Entry.from_bytes(e.to_bytes())
    assert back == e and back.id == e.id and back.body == e.body and back.sig == e.sig
    j = back.to_json()
    assert j["id"] == KAT_ID_1 and j["author"] == KAT_PEER_ID and j["body"]["b"] == "0102"


@pytest.mark.parametrize("bad", [
    {"x": math.nan}, {"x": math.inf}, {"x": -math.inf}, {1: "int key"}, {b"k": "bytes key"},
    {"x": {1, 2}}, {"x": object()}, {"x": 1 << 64}, {"x": -(1 << 63) - 1}, {"x": "\ud800"},
])
def test_unsupported_bodies_are_malformed(signer, bad):
    with pytest.raises(MalformedEntry):
        Entry.create(signer, seq=1, prev=ZERO_HASH, lamport=1, kind="hello", body=bad)


def test_too_deep_and_too_large_bodies(signer):
    deep: dict = {}
    cur = deep
    for _ in range(40):
        cur["x"] = {}
        cur = cur["x"]
    with pytest.raises(MalformedEntry):
        Entry.create(signer, seq=1, prev=ZERO_HASH, lamport=1, kind="hello", body=deep)
    with pytest.raises(MalformedEntry):
        Entry.create(signer, seq=1, prev=ZERO_HASH, lamport=1, kind="hello", body={"x": b"\0" * 1_000_000})


@pytest.mark.parametrize("fields,msg", [
    (dict(seq=0), "seq"), (dict(seq=1, prev=b"\1" * 32), "prev"), (dict(seq=2, prev=ZERO_HASH), "prev"),
    (dict(lamport=0), "lamport"), (dict(kind="Hello"), "kind"), (dict(kind=""), "kind"),
    (dict(seq=2, prev=b"\1" * 32, kind="genesis", body={}), "genesis"),
    (dict(kind="member", body={"action": "admit", "member": b"x"}), "member"),
    (dict(kind="member", body={"action": "revoke", "member": b"k" * 32, "upto": -1}), "upto"),
    (dict(kind="member", body={"action": "promote", "member": b"k" * 32}), "action"),
    (dict(kind="genesis", body={"consortium": "c", "members": []}), "genesis"),
])
def test_entry_invariants(signer, fields, msg):
    args = dict(seq=1, prev=ZERO_HASH, lamport=1, kind="hello", body={})
    args.update(fields)
    with pytest.raises(MalformedEntry, match=msg):
        Entry.create(signer, **args)


def test_genesis_founder_must_be_author(signer):
    other = Signer.from_seed(b"\x07" * 32)
    with pytest.raises(MalformedEntry, match="founder"):
        Entry.create(signer, seq=1, prev=ZERO_HASH, lamport=1, kind="genesis",
                     body={"consortium": "c", "founder": other.public_key, "members": []})


def test_truncated_bytes_are_malformed(signer):
    raw = kat_entry(signer).to_bytes()
    for n in range(len(raw)):
        with pytest.raises(MalformedEntry):
            Entry.from_bytes(raw[:n])
    with pytest.raises(MalformedEntry):
        Entry.from_bytes(raw + b"\0")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_garbage_bytes_are_malformed(data):
    with pytest.raises((MalformedEntry, BadSignature)):
        Entry.from_bytes(data)


def test_garbage_that_is_valid_msgpack_is_malformed():
    for obj in (None, 1, [], [b"a"], [b"a", b"b", b"c"], {"a": 1}, [b"\x90", b"s" * 64], ["str", b"s" * 64]):
        with pytest.raises(MalformedEntry):
            Entry.from_bytes(msgpack.packb(obj, use_bin_type=True))


def test_non_canonical_payload_is_malformed_even_when_signed(signer):
    # same fields, map keys unsorted: a validly signed but non-canonical encoding
    packer = msgpack.Packer(use_bin_type=True)
    payload = packer.pack([signer.public_key, 1, ZERO_HASH, 1, "hello", {"b": 1, "a": 2}])
    sig = signer.sign(encoding.DOMAIN + payload)
    with pytest.raises(MalformedEntry, match="canonical"):
        Entry.from_bytes(encoding.encode_wire(payload, sig))
    # a float32 where float64 is canonical
    payload = msgpack.packb([signer.public_key, 1, ZERO_HASH, 1, "hello", {"a": 0.5}], use_single_float=True)
    with pytest.raises(MalformedEntry, match="canonical"):
        Entry.from_bytes(encoding.encode_wire(payload, signer.sign(encoding.DOMAIN + payload)))


def test_bad_signature_and_tampered_body(signer):
    e = kat_entry(signer)
    sig = bytearray(e.sig)
    sig[5] ^= 1
    with pytest.raises(BadSignature) as info:
        Entry.from_bytes(encoding.encode_wire(e.payload, bytes(sig)))
    assert e.id.hex() in str(info.value) and KAT_PEER_ID in str(info.value)
    tampered = Entry(e.author, e.seq, e.prev, e.lamport, e.kind, dict(e.body, role="server"))
    with pytest.raises(BadSignature):
        Entry.from_bytes(encoding.encode_wire(tampered.payload, e.sig))
    # a signature over the payload without the domain prefix does not verify
    with pytest.raises(BadSignature):
        Entry.from_bytes(encoding.encode_wire(e.payload, signer.sign(e.payload)))
    # signed by somebody else
    other = Signer.from_seed(b"\x09" * 32)
    with pytest.raises(BadSignature):
        Entry.from_bytes(encoding.encode_wire(e.payload, other.sign(e.signed_bytes())))


def test_peer_id_round_trip_and_errors(signer):
    assert peer_id_from_public_key(signer.public_key) == KAT_PEER_ID
    assert public_key_from_peer_id(KAT_PEER_ID) == signer.public_key
    for bad in ("", "garbage", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", KAT_PEER_ID[:-1] + "0",
                KAT_PEER_ID + "1", KAT_PEER_ID[:-2]):
        with pytest.raises(BadPeerId):
            public_key_from_peer_id(bad)


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=32, max_size=32))
def test_peer_id_round_trip_any_key(key):
    assert public_key_from_peer_id(peer_id_from_public_key(key)) == key
