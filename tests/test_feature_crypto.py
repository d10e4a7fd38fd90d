"""Sealed feature envelopes: recipients only, tamper-evident, typed errors, no pickle."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

import protocols.feature_crypto as fc
from protocols.feature_crypto import (DecryptionError, EnvelopeError, FeatureCryptoError, envelope_info,
                                      open_sealed, public_bytes, seal)

CLASSES = ["benign", "malignant", "normal"]


@pytest.fixture()
def keys():
    return {name: X25519PrivateKey.generate() for name in ("sender", "alice", "bob", "eve")}


@pytest.fixture()
def data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((17, 12)).astype(np.float32), rng.integers(0, 3, 17)


def _seal(keys, data, to=("alice", "bob")):
    feats, labels = data
    return seal(feats, labels, CLASSES, {n: public_bytes(keys[n]) for n in to}, keys["sender"], sender_id="node-s")


def test_each_recipient_opens(keys, data):
    blob = _seal(keys, data)
    for who in ("alice", "bob"):
        got = open_sealed(blob, keys[who], who)
        assert got.features.dtype == np.float32 and np.array_equal(got.features, data[0])
        assert got.labels.dtype == np.int64 and np.array_equal(got.labels, data[1])
        assert got.class_names == CLASSES
        feats, labels, names = got  # plain 3-tuple unpacking works
        assert feats.flags.writeable


def test_non_recipient_cannot_decrypt(keys, data):
    blob = _seal(keys, data)
    with pytest.raises(DecryptionError, match="not a recipient"):
        open_sealed(blob, keys["eve"], "eve")
    # claiming a recipient's id does not help without that recipient's key
    with pytest.raises(DecryptionError, match="another key"):
        open_sealed(blob, keys["eve"], "alice")
    assert issubclass(DecryptionError, FeatureCryptoError) and issubclass(FeatureCryptoError, ValueError)


def _repack(blob, **changes):
    env = msgpack.unpackb(blob, raw=False)
    env.update(changes)
    return msgpack.packb(env, use_bin_type=True)


def test_tampering_detected(keys, data):
    blob = _seal(keys, data)
    env = msgpack.unpackb(blob, raw=False)
    ct = bytearray(env["ct"])
    ct[len(ct) // 2] ^= 0x01
    with pytest.raises(DecryptionError, match="tampered"):
        open_sealed(_repack(blob, ct=bytes(ct)), keys["alice"], "alice")
    # header fields are bound as associated data
    for change in ({"shape": [12, 17]}, {"sender": "someone-else"}, {"n_classes": 2},
                   {"recipients": [r for r in env["recipients"] if r["id"] == "alice"]},
                   {"sender_pub": public_bytes(keys["eve"])}):
        with pytest.raises(DecryptionError):
            open_sealed(_repack(blob, **change), keys["alice"], "alice")
    # a wrapped key moved from bob's entry to alice's does not open
    recips = env["recipients"]
    swapped = [dict(recips[0], key=recips[1]["key"], nonce=recips[1]["nonce"]), recips[1]]
    with pytest.raises(DecryptionError):
        open_sealed(_repack(blob, recipients=swapped), keys["alice"], "alice")


def test_envelope_info_and_randomness(keys, data):
    blob = _seal(keys, data, to=("bob", "alice"))
    info = envelope_info(blob)
    assert info == {"sender": "node-s", "sender_pub": public_bytes(keys["sender"]).hex(),
                    "recipients": ["alice", "bob"], "shape": [17, 12], "dtype": "<f4", "n_classes": 3}
    assert _seal(keys, data) != _seal(keys, data)  # fresh content key, ephemeral key and nonces
    raw = data[0].tobytes()
    assert raw not in blob and raw[:64] not in blob  # features do not appear in the clear


def test_empty_feature_set(keys):
    blob = seal(np.zeros((0, 4), np.float32), np.zeros(0, np.int64), CLASSES,
                {"alice": public_bytes(keys["alice"])}, keys["sender"])
    got = open_sealed(blob, keys["alice"], "alice")
    assert got.features.shape == (0, 4) and got.labels.shape == (0,)


@pytest.mark.parametrize("feats, labels, classes, match", [
    (np.zeros((3, 2), np.float64), np.zeros(3, int), CLASSES, "float32"),
    (np.zeros(3, np.float32), np.zeros(3, int), CLASSES, "2-D"),
    (np.full((3, 2), np.nan, np.float32), np.zeros(3, int), CLASSES, "NaN"),
    (np.zeros((3, 2), np.float32), np.array([0, 1, 3]), CLASSES, "index"),
    (np.zeros((3, 2), np.float32), np.array([0, 1]), CLASSES, "3 integers"),
    (np.zeros((3, 2), np.float32), np.array([0.0, 1, 2]), CLASSES, "3 integers"),
    (np.zeros((3, 2), np.float32), np.zeros(3, int), ["a", "a", "b"], "distinct"),
])
def test_seal_rejects_bad_arrays(keys, feats, labels, classes, match):
    with pytest.raises(EnvelopeError, match=match):
        seal(feats, labels, classes, {"alice": public_bytes(keys["alice"])}, keys["sender"])


def test_seal_rejects_bad_recipients(keys, data):
    with pytest.raises(EnvelopeError, match="at least one"):
        seal(*data, CLASSES, {}, keys["sender"])
    with pytest.raises(EnvelopeError, match="32 bytes"):
        seal(*data, CLASSES, {"alice": b"short"}, keys["sender"])
    with pytest.raises(EnvelopeError, match="non-empty strings"):
        seal(*data, CLASSES, {"": public_bytes(keys["alice"])}, keys["sender"])


@pytest.mark.parametrize("blob", [
    b"", b"\x93\x01\x02", b"not msgpack at all \xc1",
    msgpack.packb({"v": 2, "alg": fc.ALG}),
    msgpack.packb({"v": 1, "alg": fc.ALG, "shape": [1, 2]}),
])
def test_malformed_envelopes(keys, blob):
    with pytest.raises(EnvelopeError):
        open_sealed(blob, keys["alice"], "alice")


def test_unsupported_dtype_and_bad_shape_in_header(keys, data):
    blob = _seal(keys, data)
    with pytest.raises(EnvelopeError, match="dtypes"):
        open_sealed(_repack(blob, dtype="<f8"), keys["alice"], "alice")
    with pytest.raises(EnvelopeError, match="shape"):
        open_sealed(_repack(blob, shape=[17, -1]), keys["alice"], "alice")


def _seal_payload(keys, payload: dict, shape, n_classes=3) -> bytes:
    """An authentic envelope whose decrypted payload contradicts its header."""
    eph, sender, alice = X25519PrivateKey.generate(), keys["sender"], keys["alice"]
    header = {"v": 1, "alg": fc.ALG, "sender": "s", "sender_pub": public_bytes(sender), "eph_pub": public_bytes(eph),
              "shape": shape, "dtype": "<f4", "labels_dtype": "<i8", "n_classes": n_classes,
              "recipients": [{"id": "alice", "pub": public_bytes(alice)}]}
    ad = fc._associated_data(header)
    ck = ChaCha20Poly1305.generate_key()
    entry = header["recipients"][0]
    wrap = fc._wrap_key(eph, sender, header, entry, alice.public_key())
    entry["nonce"] = os.urandom(12)
    entry["key"] = ChaCha20Poly1305(wrap).encrypt(entry["nonce"], ck, ad)
    nonce = os.urandom(12)
    ct = ChaCha20Poly1305(ck).encrypt(nonce, msgpack.packb(payload, use_bin_type=True), ad)
    return msgpack.packb({**header, "nonce": nonce, "ct": ct}, use_bin_type=True)


@pytest.mark.parametrize("payload, shape, match", [
    ({"features": b"\0" * 20, "labels": b"\0" * 16, "classes": CLASSES}, [2, 3], "header says shape"),
    ({"features": b"\0" * 24, "labels": b"\0" * 8, "classes": CLASSES}, [2, 3], "labels"),
    ({"features": b"\0" * 24, "labels": b"\0" * 16, "classes": ["a"]}, [2, 3], "class list"),
    ({"features": np.full(6, np.inf, np.float32).tobytes(), "labels": b"\0" * 16, "classes": CLASSES}, [2, 3], "NaN"),
    ({"features": b"\0" * 24, "labels": np.array([0, 7], "<i8").tobytes(), "classes": CLASSES}, [2, 3], "index"),
    ({"oops": 1}, [2, 3], "malformed"),
])
def test_contents_contradicting_header(keys, payload, shape, match):
    blob = _seal_payload(keys, payload, shape)
    with pytest.raises(EnvelopeError, match=match):
        open_sealed(blob, keys["alice"], "alice")


def test_crafted_payload_helper_is_sound(keys):
    ok = _seal_payload(keys, {"features": np.arange(6, dtype="<f4").tobytes(),
                              "labels": np.array([0, 2], "<i8").tobytes(), "classes": CLASSES}, [2, 3])
    got = open_sealed(ok, keys["alice"], "alice")
    assert got.features.tolist() == [[0, 1, 2], [3, 4, 5]] and got.labels.tolist() == [0, 2]
