"""Ed25519 keys, signatures, and libp2p peer ids — in pure Python (no libp2p import).

A node's ledger author is its raw 32-byte Ed25519 public key. For display and for the
transport it is written as a libp2p peer id: base58btc of the identity multihash
(code 0x00, length 36) over the protobuf ``PublicKey{Type=Ed25519(1), Data=pubkey}``,
which gives ``12D3KooW...``. The same bytes are what libp2p's ``ID.from_pubkey`` computes
(checked in tests/test_identity.py).
"""
from __future__ import annotations

from functools import lru_cache

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ledger.errors import BadPeerId, BadSignature
from ledger.peerid import _B58, _PEER_ID_PREFIX, PUBLIC_KEY_LEN, b58encode, describe_author  # noqa: F401

SIGNATURE_LEN = 64

_B58_INDEX = {c: i for i, c in enumerate(_B58)}

MAX_INTERNED_KEYS = 1 << 17
_interned: dict[bytes, bytes] = {}


def intern_key(key: bytes) -> bytes:
    """One shared bytes object per distinct public key in this process (like `sys.intern`
    for str): tables keyed by member keys (heads, member sets) point at one copy instead
    of each holding the bytes its SQLite row produced (~65 B per member per
    table; all nodes of a simulation share one process). Bounded: past MAX_INTERNED_KEYS
    distinct keys, new ones are returned as they are."""
    k = _interned.get(key)
    if k is None:
        if len(_interned) >= MAX_INTERNED_KEYS:
            return key
        k = _interned[key] = bytes(key)
    return k


def b58decode(text: str) -> bytes:
    """Inverse of `b58encode`; raises BadPeerId on a character outside the alphabet."""
    n = 0
    for c in text:
        try:
            n = n * 58 + _B58_INDEX[c]
        except KeyError:
            raise BadPeerId(f"invalid base58 character {c!r} in {text!r}") from None
    pad = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * pad + body


@lru_cache(maxsize=4096)
def peer_id_from_public_key(public_key: bytes) -> str:
    """libp2p peer id (``12D3KooW...``) of a raw 32-byte Ed25519 public key."""
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_LEN:
        raise BadPeerId("an Ed25519 public key is 32 bytes")
    return b58encode(_PEER_ID_PREFIX + public_key)


@lru_cache(maxsize=4096)
def public_key_from_peer_id(peer_id: str) -> bytes:
    """The raw Ed25519 public key inside an identity-multihash peer id; BadPeerId otherwise.
    Cached like `peer_id_from_public_key` (every sync answer maps its requester's peer id;
    base58 decoding is ~30 us)."""
    if not isinstance(peer_id, str) or not 40 <= len(peer_id) <= 60:
        raise BadPeerId(f"not an Ed25519 peer id: {peer_id!r}")
    raw = b58decode(peer_id.strip())
    if len(raw) != len(_PEER_ID_PREFIX) + PUBLIC_KEY_LEN or not raw.startswith(_PEER_ID_PREFIX):
        raise BadPeerId(f"not an Ed25519 identity peer id: {peer_id!r}")
    return raw[len(_PEER_ID_PREFIX):]


def parse_author(text: str) -> bytes:
    """A peer id or a 64-hex public key -> raw public key (BadPeerId if neither)."""
    text = text.strip()
    if len(text) == 2 * PUBLIC_KEY_LEN:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    return public_key_from_peer_id(text)


@lru_cache(maxsize=4096)
def _public_key_object(public_key: bytes) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(public_key)


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> None:
    """Return None if `signature` is the Ed25519 signature of `data` by `public_key`; else BadSignature."""
    if len(signature) != SIGNATURE_LEN:
        raise BadSignature("signature is not 64 bytes")
    try:
        _public_key_object(bytes(public_key)).verify(signature, data)
    except (InvalidSignature, ValueError):
        raise BadSignature("Ed25519 signature does not verify") from None


class Signer:
    """An Ed25519 private key that signs ledger entries. `.public_key` is the ledger author."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: str = peer_id_from_public_key(self.public_key)

    @classmethod
    def from_seed(cls, seed: bytes) -> "Signer":
        """Deterministic key from a 32-byte seed (the file format of HOME/node.key)."""
        if not isinstance(seed, (bytes, bytearray)) or len(seed) != 32:
            raise ValueError("an Ed25519 seed is exactly 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed)))

    @classmethod
    def generate(cls) -> "Signer":
        """A new random Ed25519 key (its `seed` is what node.key holds)."""
        return cls(Ed25519PrivateKey.generate())

    @property
    def seed(self) -> bytes:
        """The raw 32-byte private seed (handle with care: this is the node's secret)."""
        return self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of `data` (entries sign their canonical encoding)."""
        return self._key.sign(data)

    def __repr__(self) -> str:
        return f"Signer({self.peer_id})"
