"""The link simulator under the in-memory transport: per-direction links with latency,
bandwidth, gossip loss and up/down (`LinkConditions`, `Link`), and the hub that owns them,
counts bytes and applies partitions (`MemoryNetwork`). See `atdnode.transport.memory` for
the transport that runs on it and the semantics both give the contract tests.

Every decision that uses randomness draws from a per-link RNG seeded from (network seed,
src, dst), so a run is reproducible with trio's MockClock.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any, Callable

import trio


@dataclass(slots=True)
class LinkConditions:
    """Simulated properties of one direction of a link."""

    latency_s: float = 0.0
    bandwidth_Bps: float | None = None  # bytes per second; None = unlimited
    loss: float = 0.0  # probability that a gossip message is dropped
    up: bool = True


# observer(src, dst, kind ("gossip" | "stream"), nbytes, delivered)
Observer = Callable[[str, str, str, int, bool], None]


class Link:
    """One direction src -> dst: conditions, a serialization clock, counters, an RNG.

    Small (a simulation of a thousand daemons holds tens of thousands of links): slots, and
    the RNG (a `random.Random` is ~2.5 KB) and the parking lot for stalled streams are made
    on first use -- only lossy links draw, only cut links stall. The RNG's seed is the same
    whenever it is made, so runs stay reproducible."""

    __slots__ = ("net", "src", "dst", "cond", "_rng", "_busy_until", "bytes", "messages", "dropped", "_lot")

    def __init__(self, net: "MemoryNetwork", src: str, dst: str) -> None:
        self.net, self.src, self.dst = net, src, dst
        self.cond = net.default  # shared until set(): conditions are replaced, never mutated
        self._rng: random.Random | None = None
        self._busy_until = 0.0
        self.bytes = self.messages = self.dropped = 0
        self._lot: trio.lowlevel.ParkingLot | None = None

    @property
    def rng(self) -> random.Random:
        """This link's RNG, seeded from (network seed, src, dst)."""
        if self._rng is None:
            digest = hashlib.sha256(f"{self.net.seed}|{self.src}|{self.dst}".encode()).digest()
            self._rng = random.Random(int.from_bytes(digest[:8], "big"))
        return self._rng

    @property
    def stats(self) -> dict[str, int]:
        return {"bytes": self.bytes, "messages": self.messages, "dropped": self.dropped}

    @property
    def _up(self) -> trio.lowlevel.ParkingLot:
        if self._lot is None:
            self._lot = trio.lowlevel.ParkingLot()
        return self._lot

    def _schedule(self, nbytes: int) -> tuple[float, float]:
        """Reserve the link for nbytes: (serialization done, delivery time)."""
        now = trio.current_time()
        start = max(now, self._busy_until)
        bw = self.cond.bandwidth_Bps
        done = start + (nbytes / bw if bw else 0.0)
        self._busy_until = done
        return done, done + self.cond.latency_s

    def gossip(self, nbytes: int) -> float | None:
        """Delivery time of a gossip message, or None if it is lost (down link or loss)."""
        if not self.is_up() or (self.cond.loss > 0 and self.rng.random() < self.cond.loss):
            self.dropped += 1
            self.net._observe(self.src, self.dst, "gossip", nbytes, False)
            return None
        _, at = self._schedule(nbytes)
        self._count(nbytes, "gossip")
        tick = self.net.gossip_tick_s
        return math.ceil(at / tick) * tick if tick else at

    async def stream(self, nbytes: int) -> float:
        """Wait while the link is down and for serialization; return the delivery time."""
        while not self.is_up():
            await self._up.park()
        done, at = self._schedule(nbytes)
        if done > trio.current_time():
            await trio.sleep_until(done)
        self._count(nbytes, "stream")
        return at

    def _count(self, nbytes: int, kind: str) -> None:
        self.bytes += nbytes
        self.messages += 1
        self.net._sent[self.src] = self.net._sent.get(self.src, 0) + nbytes
        self.net._received[self.dst] = self.net._received.get(self.dst, 0) + nbytes
        self.net._observe(self.src, self.dst, kind, nbytes, True)

    def is_up(self) -> bool:
        return self.cond.up and not self.net.severed(self.src, self.dst)

    def set(self, cond: LinkConditions) -> None:
        self.cond = cond
        if cond.up and self._lot is not None:
            self._lot.unpark_all()


class MemoryNetwork:
    """The hub all `MemoryTransport`s of one simulated network attach to."""

    def __init__(self, *, seed: int = 0, default: LinkConditions | None = None) -> None:
        self.seed = seed
        self.default = default or LinkConditions()
        self.nodes: dict[str, Any] = {}  # peer id -> its MemoryTransport (attached by the transport)
        self._links: dict[tuple[str, str], Link] = {}
        self._observers: list[Observer] = []
        self._seq = itertools.count()  # global tie-breaker for same-time deliveries
        # > 0: gossip arrives on this time grid (rounded up). A simulation with thousands of
        # nodes then wakes once per tick for all messages due, not once per message
        # (netsim.memnet.SimNetwork uses 1 ms); 0 keeps exact delivery times.
        self.gossip_tick_s = 0.0
        self._cuts: list[dict[str, int]] = []  # partitions in force (see partition)
        self._sent: dict[str, int] = {}  # per node, the sum of its links' bytes (node_stats: no scan of all links)
        self._received: dict[str, int] = {}

    def link(self, src: str, dst: str) -> Link:
        lk = self._links.get((src, dst))
        if lk is None:
            lk = self._links[(src, dst)] = self.new_link(src, dst)
        return lk

    def new_link(self, src: str, dst: str) -> Link:
        """The link src -> dst, made when first used (a subclass may set its conditions)."""
        return Link(self, src, dst)

    def set_link(self, a: str, b: str, cond: LinkConditions, *, both: bool = True) -> None:
        """Set the conditions of a -> b (and b -> a unless both=False)."""
        self.link(a, b).set(dataclasses.replace(cond))
        if both:
            self.link(b, a).set(dataclasses.replace(cond))

    def partition(self, *groups: set[str]) -> None:
        """Take down every link between peers of different groups (others unchanged).
        Kept as a cut (peer -> group), not per link: cutting 1,000 nodes in two halves
        would otherwise build 500,000 links."""
        self._cuts.append({p: i for i, g in enumerate(groups) for p in g})

    def severed(self, src: str, dst: str) -> bool:
        """Do src and dst sit in different groups of a partition in force?"""
        for where in self._cuts:
            a, b = where.get(src), where.get(dst)
            if a is not None and b is not None and a != b:
                return True
        return False

    def heal(self) -> None:
        """Bring every link back up (stalled stream bytes then flow again)."""
        self._cuts.clear()
        for link in self._links.values():
            if not link.cond.up:
                link.set(dataclasses.replace(link.cond, up=True))
            elif link._lot is not None:
                link._lot.unpark_all()  # streams stalled by the cut

    def add_observer(self, fn: Observer) -> None:
        self._observers.append(fn)

    def _observe(self, src: str, dst: str, kind: str, nbytes: int, delivered: bool) -> None:
        for fn in self._observers:
            fn(src, dst, kind, nbytes, delivered)

    def link_stats(self) -> dict[tuple[str, str], dict[str, int]]:
        """(src, dst) -> {"bytes", "messages", "dropped"} for every link used so far."""
        return {k: v.stats for k, v in self._links.items()}

    def node_stats(self, peer_id: str) -> dict[str, int]:
        """Bytes a node put on / took off its links (gossip + streams, link level)."""
        return {"sent": self._sent.get(peer_id, 0), "received": self._received.get(peer_id, 0)}

    def next_seq(self) -> int:
        return next(self._seq)
