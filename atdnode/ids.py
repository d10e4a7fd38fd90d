"""Unique-prefix lookup of the ids people type: ledger entries, blobs, models, peers.

One resolver per kind of id; each accepts the full id or any unique prefix of at least
`MIN_PREFIX` characters (like git) and raises `IdError` with one line when the prefix is
too short, names nothing, or names more than one thing (it lists a few).

The CLI resolves what a user typed at the boundary, and hands full ids to the library:
signed entry bodies always record full ids, never the prefix someone typed. The lookups
over what one node holds (its ledger, blob store and peers) are `atdnode.node.lookup`'s.
"""
from __future__ import annotations

from typing import Iterable

from atdnode.errors import ConfigError

MIN_PREFIX = 4
_SHOW = 3  # candidates named in an "ambiguous" error


class IdError(ConfigError):
    """An id or prefix that names no single thing (unknown, ambiguous or malformed)."""


def ambiguous(what: str, ref: str, hits: list[str]) -> IdError:
    more = f", ... ({len(hits)} or more)" if len(hits) > _SHOW else ""
    return IdError(f"{what} {ref!r} is ambiguous: {', '.join(h[:16] for h in hits[:_SHOW])}{more}; give more digits")


def check_hex(ref: str, what: str, noun: str = "id") -> str:
    ref = ref.strip().lower()
    if not ref or len(ref) > 64 or any(c not in "0123456789abcdef" for c in ref):
        raise IdError(f"{what} {ref!r} is not a 64-hex-digit {noun} (or a unique prefix of one)")
    if len(ref) < MIN_PREFIX:
        raise IdError(f"{what} {ref!r}: give at least {MIN_PREFIX} hex digits")
    return ref


def unique(ref: str, candidates: Iterable[str], *, what: str, hexadecimal: bool = True, where: str = "here") -> str:
    """The one candidate equal to `ref` or starting with it; IdError otherwise."""
    ref = check_hex(ref, what) if hexadecimal else ref.strip()
    if not hexadecimal and len(ref) < MIN_PREFIX:
        raise IdError(f"{what} {ref!r}: give at least {MIN_PREFIX} characters")
    cands = sorted(set(candidates))
    if ref in cands:
        return ref
    hits = [c for c in cands if c.startswith(ref)]
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise ambiguous(what, ref, hits)
    raise IdError(f"{what} {ref!r} not found {where}")


# ---------------------------------------------------------------- ledger entries


def resolve_entry(led, ref: str, kinds: tuple[str, ...] | None = None, *, what: str = "entry"):
    """The log entry whose id is `ref` or starts with it, of one of `kinds` when given."""
    ref = check_hex(ref, what, "entry id")
    hits = led.find_prefix(ref, kinds=kinds, limit=_SHOW + 1)
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise ambiguous(what, ref, [e.id.hex() for e in hits])
    other = led.find_prefix(ref, limit=_SHOW + 1) if kinds else []
    if len(other) == 1:
        raise IdError(f"{what} {ref[:16]} is a {other[0].kind} entry, not {' or '.join(kinds)}")
    found = f" (the prefix matches {len(other)} entries of other kinds: {', '.join(sorted({e.kind for e in other}))})"
    raise IdError(f"{what} entry {ref[:16]} is not in this node's ledger{found if other else ''}")


def arrived_entry(led, ref: str):
    """For a wait on an entry published elsewhere: the log entry `ref` (a full id or a prefix
    of at least MIN_PREFIX hex digits) names, or None while no entry here matches; IdError
    when `ref` is malformed or the prefix matches more than one entry."""
    ref = check_hex(ref, "entry", "entry id")
    if len(ref) == 64:
        return led.get(ref)
    hits = led.find_prefix(ref, limit=_SHOW + 1)
    if len(hits) > 1:
        raise ambiguous("entry", ref, [e.id.hex() for e in hits])
    return hits[0] if hits else None
