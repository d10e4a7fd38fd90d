"""libp2p peer ids of Ed25519 keys, for display: base58btc of the identity multihash over the
protobuf ``PublicKey{Type=Ed25519(1), Data=pubkey}`` (``12D3KooW...``). Imports nothing of
ours, so error messages (`ledger.errors`) can name authors; parsing a peer id, which can
fail, lives in `ledger.keys`.
"""
from __future__ import annotations

PUBLIC_KEY_LEN = 32

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
# protobuf PublicKey: field 1 (Type) varint 1 = Ed25519; field 2 (Data) length-delimited 32 bytes.
_PROTO_PREFIX = b"\x08\x01\x12\x20"
# identity multihash: code 0x00, digest length 36 (= len(protobuf)).
_PEER_ID_PREFIX = b"\x00\x24" + _PROTO_PREFIX


def b58encode(data: bytes) -> str:
    """Base58btc (bitcoin alphabet), leading zero bytes kept as '1'."""
    n = int.from_bytes(data, "big")
    out: list[str] = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def describe_author(author: object) -> str:
    """Peer id for a well-formed key, else a hex dump (used in error messages)."""
    if isinstance(author, bytes) and len(author) == PUBLIC_KEY_LEN:
        return b58encode(_PEER_ID_PREFIX + author)
    return f"<bad author {bytes(author).hex() if isinstance(author, (bytes, bytearray)) else author!r}>"
