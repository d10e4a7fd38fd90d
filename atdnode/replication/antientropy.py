"""Periodic sync (anti-entropy) of a daemon, paced by what happens.

Every `sync_interval` s a daemon pulls from the next `sync_fanout` connected members of a
shuffled round (`peerset.plan_sync`): that covers gossip lost on the way. In an idle
consortium every such pull finds nothing, yet each costs a libp2p stream on both ends
(yamux SYN, multistream negotiation, a digest frame each way, FIN, the stream
notifications): with 100 idle daemons on one machine, a large part of their CPU.

`AntiEntropy.run()` therefore spaces quiet pulls out: after a pull that brought nothing,
with no gossip arriving (or overflowing, or rejected) since the pull before, the next one
comes twice as late as the last, up to `SYNC_IDLE_FACTOR` x `sync_interval` (40 s at the
default 10 s). Anything that suggests entries are moving or missing brings the cadence
back to `sync_interval` at once:

* a pull that added entries (gossip had not brought them). Then the next pulls stay at
  `sync_interval` for a whole round (one per member connected then) even if they find
  nothing: a node that has just learnt what the mesh missed is likely ahead of its
  neighbours, and each of its pulls shows the member it asks that it is ahead (`observed`
  below), so the repair spreads from node to node at `sync_interval` pace rather than at
  the spaced-out one (1,000 in-memory daemons, partition healed: without the round, the
  last node caught up 26-60 simulated s later; `bench/memsim_bench.py`);
* gossip activity since the last pull (entries are flowing, so some may be lost);
* a member's sync request showing it holds entries we lack (`observed`, fed by the sync
  server: `sync.serve_sync(observe=...)`). That one also *wakes* the loop: the next pull
  goes to that member, as soon as `sync_interval` has passed since the last pull. So a
  node that missed an entry while its own pulls were spaced out learns it when any
  neighbour that has it pulls from it, and never pulls more often than `sync_interval`.

New connections still pull at once (`atdnode.replication.sync_connect`): late joiners, restarts and
healed partitions do not wait for this loop. Entries only this loop brought are counted
in `stats["anti_entropy_added"]` (the peer-set rotation reads it as "the graph misses
something", `atdnode.peers.dialer.RotationPace`).
"""
from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from atdnode.peers import plan_sync

SYNC_IDLE_FACTOR = 4  # quiet pulls space out up to this many sync intervals (module doc)
ACTIVITY_STATS = ("gossip_in", "gossip_overflow", "gossip_rejected")  # gossip moving: pull at sync_interval


class SyncPace:
    """When the next periodic pull is due (module doc); pure bookkeeping, no clock of its own."""

    def __init__(self, stats: dict[str, int], idle_factor: int = SYNC_IDLE_FACTOR) -> None:
        if idle_factor < 1:
            raise ValueError("idle_factor must be >= 1")
        self.stats = stats
        self.idle_factor = idle_factor
        self.factor = 1  # the current interval, in sync intervals
        self.hot = 0  # quiet pulls still due at sync_interval after a pull that added entries
        self._seen = self._activity()
        self.ahead: list[str] = []  # members whose requests showed entries we lack, oldest first
        self.wake = trio.Event()

    def _activity(self) -> tuple[int, ...]:
        return tuple(self.stats.get(k, 0) for k in ACTIVITY_STATS)

    def interval(self, base: float) -> float:
        """Seconds from the last pull to the next: `factor` x `base` (`base` read live: the
        daemon's sync_interval may change while it runs)."""
        return self.factor * base

    def pulled(self, added: int, members: int = 0) -> None:
        """After a round of pulls that added `added` entries, with `members` connected members
        to pull from: the next interval (module doc)."""
        activity = self._activity()
        if added:
            self.hot = members  # a whole round at sync_interval: spread what we just learnt
        if added or activity != self._seen or self.ahead:
            self.factor = 1
        elif self.hot > 0:
            self.hot -= 1
            self.factor = 1
        else:
            self.factor = min(2 * self.factor, self.idle_factor)
        self._seen = activity

    def observed(self, peer: str, ahead: bool) -> None:
        """The sync server compared `peer`'s request with our ledger: `ahead` if it holds
        entries we lack. Such a peer is pulled from next, at `sync_interval` pace."""
        if ahead and peer not in self.ahead:
            self.ahead.append(peer)
            self.factor = 1
            self.wake.set()

    def take_ahead(self, live: Iterable[str], fanout: int) -> list[str]:
        """Up to `fanout` of the peers seen ahead that are still in `live` (the rest are dropped)."""
        now = set(live)
        picks = [p for p in self.ahead if p in now][:fanout]
        self.ahead.clear()
        return picks


class AntiEntropy:
    """The periodic sync loop of one daemon (module doc)."""

    def __init__(self, *, stats: dict[str, int], interval: Callable[[], float], fanout: Callable[[], int],
                 members: Callable[[], list[str]], pull: Callable[[str], Awaitable[int]],
                 rng: random.Random, idle_factor: int = SYNC_IDLE_FACTOR) -> None:
        """`interval()` / `fanout()`: the daemon's live settings; `members()`: the connected
        members one may pull from now; `pull(peer)`: one sync pull, the entries it added."""
        self.stats = stats
        self.pace = SyncPace(stats, idle_factor)
        self._interval, self._fanout, self._members, self._pull = interval, fanout, members, pull
        self._rng = rng
        self._due: list[str] = []  # the current round (plan_sync)

    def observed(self, peer: str, ahead: bool) -> None:
        """For the sync server's `observe` hook (see `SyncPace.observed`)."""
        self.pace.observed(peer, ahead)

    async def run(self) -> None:
        pace = self.pace
        last = trio.current_time()
        while True:
            base = self._interval()  # read once per pull: a new sync_interval applies from the next one
            pace.wake = trio.Event()
            if not pace.ahead:
                with trio.move_on_at(last + pace.interval(base)):
                    await pace.wake.wait()
            await trio.sleep_until(last + base)  # never more often than sync_interval
            last = trio.current_time()
            await self.pull_round()

    async def pull_round(self) -> int:
        """One interval's pulls: the peers seen ahead of us if any, else the next of the round."""
        members = self._members()
        fanout = self._fanout()
        picks = self.pace.take_ahead(members, fanout) or plan_sync(self._due, members, fanout, self._rng)
        added = 0
        for peer in picks:
            added += await self._pull(peer)
        if added:
            self.stats["anti_entropy_added"] = self.stats.get("anti_entropy_added", 0) + added
        self.pace.pulled(added, len(members))
        return added


def chain_observers(*fns: Callable[[str, bool], Any]) -> Callable[[str, bool], None]:
    """One `observe(peer, ahead)` hook calling each of `fns` in turn."""

    def observe(peer: str, ahead: bool) -> None:
        for fn in fns:
            fn(peer, ahead)

    return observe
