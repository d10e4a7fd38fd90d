"""Digests of a ledger's heads for the digest-first sync (`atdnode.replication.sync`, protocol v2).

A heads map (author key -> highest contiguous seq in the log) is cut into BUCKETS buckets
by the first byte of the author key. Each bucket's digest is

    blake2b(digest_size=8, person=b"atd-sync-heads")( author(32) || seq(u64 big-endian) || ... )

over the bucket's authors in ascending key order; an empty bucket's digest is 8 zero bytes.
The *digest vector* is the BUCKETS digests concatenated (2,048 bytes). Two ledgers in step
have equal vectors; where they differ, only the differing buckets' heads need to cross
the wire (with 1,000 authors, ~4 per bucket).

The vector of a ledger is cached (`digest_vector`): recomputed only for the buckets whose
authors' heads changed since the last call, so a periodic pull between peers in step costs
one `heads()` (itself cached until the database changes) and one dict comparison. The
digest is not a security boundary: equal vectors only skip a pull's work, and a peer
could withhold entries anyway; everything received is still verified entry by entry.
"""
from __future__ import annotations

import hashlib
import weakref
from typing import Iterable

BUCKETS = 256
DIGEST_BYTES = 8
VECTOR_BYTES = BUCKETS * DIGEST_BYTES
_PERSON = b"atd-sync-heads"
_EMPTY = bytes(DIGEST_BYTES)


def bucket_of(author: bytes) -> int:
    return author[0]


def bucket_digest(items: Iterable[tuple[bytes, int]]) -> bytes:
    """The digest of one bucket's (author, seq) pairs (any order; sorted here)."""
    data = b"".join(author + seq.to_bytes(8, "big") for author, seq in sorted(items))  # one update: same digest
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES, person=_PERSON).digest() if data else _EMPTY


def vector_of(heads: dict[bytes, int]) -> bytes:
    """The digest vector of a heads map (module doc); no cache."""
    buckets: list[list[tuple[bytes, int]]] = [[] for _ in range(BUCKETS)]
    for author, seq in heads.items():
        buckets[bucket_of(author)].append((author, seq))
    return b"".join(bucket_digest(b) for b in buckets)


def differing(a: bytes, b: bytes) -> list[int]:
    """Indices of the buckets whose digests differ between two vectors of VECTOR_BYTES."""
    if a == b:
        return []
    d = DIGEST_BYTES
    return [i for i in range(BUCKETS) if a[i * d:(i + 1) * d] != b[i * d:(i + 1) * d]]


class _Cache:
    """One ledger's last heads map and its vector, updated bucket by bucket. `heads` is the
    ledger's own cached map where it offers one (`Ledger.heads(copy=False)`): read, never
    changed; a changed ledger hands out a new map, so the old one here is still the old."""

    __slots__ = ("token", "version", "heads", "vector")

    def __init__(self) -> None:
        self.token: object = None  # the ledger's change token when `heads` was read
        self.version: int | None = None  # the ledger's heads version of `heads` (`Ledger.heads_since`)
        self.heads: dict[bytes, int] = {}
        self.vector = _EMPTY * BUCKETS

    def update(self, heads: dict[bytes, int], authors: set[bytes] | None = None) -> bytes:
        """The vector of `heads`; `authors`: those whose head differs from the cached map's
        (None: not known, then the two maps are compared)."""
        old = self.heads
        if heads is old or (authors is None and heads == old):
            self.heads = heads
            return self.vector
        if authors is not None:
            changed = {a[0] for a in authors}
        else:
            # the buckets (first key byte, `bucket_of`) of every (author, seq) pair in one map and
            # not the other: changed, new or gone heads (set operations in C, no call per author)
            changed = {a[0] for a, _ in heads.items() ^ old.items()}
        members: dict[int, list[tuple[bytes, int]]] = {i: [] for i in changed}
        for a, s in heads.items():
            lst = members.get(a[0])
            if lst is not None:
                lst.append((a, s))
        vector = bytearray(self.vector)  # one bytes object per ledger, not one per bucket
        for i, items in members.items():
            vector[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] = bucket_digest(items)
        self.heads = heads
        self.vector = bytes(vector)
        return self.vector


_caches: "weakref.WeakKeyDictionary[object, _Cache]" = weakref.WeakKeyDictionary()


def in_buckets(heads: dict[bytes, int], buckets: frozenset[int]) -> dict[bytes, int]:
    """The heads of the authors in `buckets` (`bucket_of`), inlined: one pass, no call per author."""
    return {a: s for a, s in heads.items() if a[0] in buckets}


def digest_vector(led) -> tuple[bytes, dict[bytes, int]]:
    """(digest vector, heads) of an open `Ledger`, cached per ledger object (module doc).
    Call it where the ledger's calls are serialised (`LedgerAccess.run`). The heads map
    returned is the cache's own: read it, never change it.

    While the database is unchanged (`Ledger.change_token`) this is O(1): no heads map is
    copied or compared (with 1,000 authors, copying and comparing the heads on
    both sides of every no-op pull made start-up pulls O(N) each, O(N^2) in all)."""
    cache = _caches.get(led)
    if cache is None:
        cache = _caches[led] = _Cache()
    token_of = getattr(led, "change_token", None)
    token = token_of() if token_of is not None else None  # read before heads: a write between only recomputes
    if token is not None and token == cache.token:
        return cache.vector, cache.heads
    since = getattr(led, "heads_since", None)
    if since is not None:  # a `Ledger`: its own map, and which authors changed since the cached one
        cache.version, heads, authors = since(cache.version)
        vector = cache.update(heads, authors)
    else:
        vector = cache.update(led.heads())
    cache.token = token
    return vector, cache.heads
