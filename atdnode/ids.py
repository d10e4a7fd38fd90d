"""Unique-prefix lookup of the ids people type: ledger entries, blobs, models, peers.

One resolver per kind of id; each accepts the full id or any unique prefix of at least
`MIN_PREFIX` characters (like git) and raises `IdError` with one line when the prefix is
too short, names nothing, or names more than one thing (it lists a few).

The CLI resolves what a user typed here, at the boundary, and hands full ids to the
library: signed entry bodies always record full ids, never the prefix someone typed.
"""
from __future__ import annotations

from typing import Iterable

from atdnode.errors import ConfigError
from atdnode.node import NodeHome

MIN_PREFIX = 4
_SHOW = 3  # candidates named in an "ambiguous" error


class IdError(ConfigError):
    """An id or prefix that names no single thing (unknown, ambiguous or malformed)."""


def _ambiguous(what: str, ref: str, hits: list[str]) -> IdError:
    more = f", ... ({len(hits)} or more)" if len(hits) > _SHOW else ""
    return IdError(f"{what} {ref!r} is ambiguous: {', '.join(h[:16] for h in hits[:_SHOW])}{more}; give more digits")


def _check_hex(ref: str, what: str, noun: str = "id") -> str:
    ref = ref.strip().lower()
    if not ref or len(ref) > 64 or any(c not in "0123456789abcdef" for c in ref):
        raise IdError(f"{what} {ref!r} is not a 64-hex-digit {noun} (or a unique prefix of one)")
    if len(ref) < MIN_PREFIX:
        raise IdError(f"{what} {ref!r}: give at least {MIN_PREFIX} hex digits")
    return ref


def unique(ref: str, candidates: Iterable[str], *, what: str, hexadecimal: bool = True, where: str = "here") -> str:
    """The one candidate equal to `ref` or starting with it; IdError otherwise."""
    ref = _check_hex(ref, what) if hexadecimal else ref.strip()
    if not hexadecimal and len(ref) < MIN_PREFIX:
        raise IdError(f"{what} {ref!r}: give at least {MIN_PREFIX} characters")
    cands = sorted(set(candidates))
    if ref in cands:
        return ref
    hits = [c for c in cands if c.startswith(ref)]
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise _ambiguous(what, ref, hits)
    raise IdError(f"{what} {ref!r} not found {where}")


# ---------------------------------------------------------------- ledger entries


def resolve_entry(led, ref: str, kinds: tuple[str, ...] | None = None, *, what: str = "entry"):
    """The log entry whose id is `ref` or starts with it, of one of `kinds` when given."""
    ref = _check_hex(ref, what, "entry id")
    hits = led.find_prefix(ref, kinds=kinds, limit=_SHOW + 1)
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise _ambiguous(what, ref, [e.id.hex() for e in hits])
    other = led.find_prefix(ref, limit=_SHOW + 1) if kinds else []
    if len(other) == 1:
        raise IdError(f"{what} {ref[:16]} is a {other[0].kind} entry, not {' or '.join(kinds)}")
    found = f" (the prefix matches {len(other)} entries of other kinds: {', '.join(sorted({e.kind for e in other}))})"
    raise IdError(f"{what} entry {ref[:16]} is not in this node's ledger{found if other else ''}")


def arrived_entry(led, ref: str):
    """For a wait on an entry published elsewhere: the log entry `ref` (a full id or a prefix
    of at least MIN_PREFIX hex digits) names, or None while no entry here matches; IdError
    when `ref` is malformed or the prefix matches more than one entry."""
    ref = _check_hex(ref, "entry", "entry id")
    if len(ref) == 64:
        return led.get(ref)
    hits = led.find_prefix(ref, limit=_SHOW + 1)
    if len(hits) > 1:
        raise _ambiguous("entry", ref, [e.id.hex() for e in hits])
    return hits[0] if hits else None


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
    ref = _check_hex(ref, "blob", "SHA-256")
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
        raise _ambiguous("peer", ref, hits)
    return ref
