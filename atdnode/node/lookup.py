"""The ids a node holds, looked up from the prefix a person typed: ledger entries, blobs
(held or announced) and peers, with the prefix rule of `atdnode.ids` (the full id or a
unique prefix of at least `MIN_PREFIX` characters; `IdError`, one line, otherwise).
"""
from __future__ import annotations

from typing import Iterable

from atdnode.ids import MIN_PREFIX, ambiguous, check_hex, resolve_entry, unique
from atdnode.node.home import NodeHome


def resolve_entry_ids(home: NodeHome, refs: Iterable[str], kinds: tuple[str, ...] | None = None, *,
                      what: str = "entry") -> list[str]:
    """Full hex ids of `refs` (ids or unique prefixes) in the node's ledger. Full ids pass
    through unchecked: the library function they go to checks them with its own errors."""
    from ledger import Ledger

    refs = [r.strip().lower() for r in refs]
    if all(len(r) == 64 for r in refs):
        return refs
    led = Ledger.open(home.ledger_db)
    try:
        return [r if len(r) == 64 else resolve_entry(led, r, kinds, what=what).id.hex() for r in refs]
    finally:
        led.close()


# ---------------------------------------------------------------- blobs


def known_blobs(home: NodeHome) -> set[str]:
    """Blobs held in the store plus those named by signed entries (fetchable from peers)."""
    from atdnode.blobs import BlobStore
    from ledger import Ledger

    out = set(BlobStore.of(home).list())
    if home.ledger_db.exists():
        led = Ledger.open(home.ledger_db)
        try:
            for kind in ("weights", "features", "aggregate"):
                for e in led.query(kind=kind):
                    for key in ("blob", "manifest", "ensemble"):
                        v = e.body.get(key)
                        if isinstance(v, str) and len(v) == 64:
                            out.add(v)
        finally:
            led.close()
    return out


def resolve_blob(home: NodeHome, ref: str) -> str:
    """The full SHA-256 of the blob `ref` names (held here or announced on the ledger)."""
    ref = check_hex(ref, "blob", "SHA-256")
    if len(ref) == 64:
        return ref  # a full hash needs no lookup: peers may hold blobs this ledger never named
    return unique(ref, known_blobs(home), what="blob", where="among the blobs held or announced on this node's ledger")


# ---------------------------------------------------------------- models and peers


def known_peers(home: NodeHome) -> set[str]:
    """Peer ids of every author and member this node's ledger knows."""
    from ledger import Ledger, peer_id_from_public_key

    led = Ledger.open(home.ledger_db)
    try:
        keys = set(led.heads()) | set(led.membership().members)
    finally:
        led.close()
    return {peer_id_from_public_key(k) for k in keys}


def resolve_peer(home: NodeHome, ref: str) -> str:
    """A full peer id for a prefix (or a suffix, as `ledger show` prints) of a known one.

    A reference that matches no known peer is returned as given: where it is used, it
    must then parse as a full peer id, and that check says what is wrong with it."""
    ref = ref.strip()
    if len(ref) >= 46 or len(ref) == 64:  # a full peer id or hex key: checked where it is used
        return ref
    peers = known_peers(home)
    hits = sorted(p for p in peers if p.startswith(ref) or p.endswith(ref)) if len(ref) >= MIN_PREFIX else []
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise ambiguous("peer", ref, hits)
    return ref
