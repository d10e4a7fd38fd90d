"""Bounds on what one peer can make a server hold: fair stream admission, and
a container budget for decoding msgpack frames.

Fair admission of inbound streams: a cap per peer and a cap in total.

A server protocol (sync, blob) holds one `PeerLimits`; each inbound stream asks for a
lease before the server reads anything from it. Over the per-peer cap the stream is
refused at once, so one peer -- even an admitted member gone rogue -- can hold at most
`per_peer` of the `total` slots and everyone else keeps being served.

    limits = PeerLimits(per_peer=4, total=32)
    lease = await lease_or_reset(limits, stream, "sync")
    if lease is None:
        return
    with lease:
        ...serve...
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from atdnode.transport.base import Stream

log = logging.getLogger("atd.limits")


class Lease:
    """One admitted stream; releases its slot when the `with` block ends (idempotent)."""

    __slots__ = ("_limits", "_peer", "_held")

    def __init__(self, limits: "PeerLimits", peer: str) -> None:
        self._limits, self._peer, self._held = limits, peer, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limits._release(self._peer)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PeerLimits:
    """Counts live streams per peer; `try_acquire` admits one if both caps allow it.

    Not thread-safe: used from the trio loop only.
    """

    def __init__(self, *, per_peer: int, total: int) -> None:
        if not 1 <= per_peer <= total:
            raise ValueError("need 1 <= per_peer <= total")
        self.per_peer, self.total = per_peer, total
        self._live: Counter[str] = Counter()
        self._n = 0
        self.refused = 0  # streams turned away so far (stats / tests)

    def try_acquire(self, peer: str) -> Lease | None:
        if self._n >= self.total or self._live[peer] >= self.per_peer:
            self.refused += 1
            return None
        self._live[peer] += 1
        self._n += 1
        return Lease(self, peer)

    def _release(self, peer: str) -> None:
        self._n -= 1
        self._live[peer] -= 1
        if self._live[peer] <= 0:
            del self._live[peer]

    def live(self, peer: str | None = None) -> int:
        """Streams held now, by `peer` or in total."""
        return self._n if peer is None else self._live.get(peer, 0)


async def lease_or_reset(limits: PeerLimits, stream: "Stream", what: str) -> Lease | None:
    """A lease for `stream`'s peer, or None after resetting the stream (logged) when the
    peer is over its share or the total is reached. Call it before reading anything."""
    lease = limits.try_acquire(stream.remote_peer)
    if lease is None:
        log.info("%s stream from %s refused: it already holds %d (of %d per peer, %d live in total)",
                 what, stream.remote_peer, limits.live(stream.remote_peer), limits.per_peer, limits.live())
        await stream.reset()
    return lease


class DecodeBudget:
    """msgpack `object_hook` / `list_hook` pair that refuses more containers than a message may have.

    The unpacker's per-container length caps (max_map_len, max_array_len) bound each map and
    array; counting containers bounds their number, so a frame of nested or repeated empty
    maps decodes to a few objects or fails: decoded size stays a small multiple of the frame.

        budget = DecodeBudget(maps=2, lists=1)
        msgpack.unpackb(frame, object_hook=budget.map, list_hook=budget.list, max_map_len=..., ...)
    """

    def __init__(self, *, maps: int, lists: int) -> None:
        self.maps, self.lists = maps, lists

    def map(self, d: dict) -> dict:
        self.maps -= 1
        if self.maps < 0:
            raise ValueError("too many maps in one frame")
        return d

    def list(self, v: list) -> list:
        self.lists -= 1
        if self.lists < 0:
            raise ValueError("too many arrays in one frame")
        return v
