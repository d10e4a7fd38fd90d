"""Simulated links stay small (a 1,000-daemon simulation holds tens of thousands):
no RNG or parking lot until a link needs one, and the RNG made late draws what an early one
would have (runs stay reproducible)."""
from __future__ import annotations

import hashlib
import random

import trio
import trio.testing

from atdnode.transport import LinkConditions, MemoryNetwork


def test_links_make_their_rng_and_lot_only_when_used_and_draw_as_seeded() -> None:
    net = MemoryNetwork(seed=11, default=LinkConditions(latency_s=0.01))
    drops: list[bool] = []

    async def main() -> None:
        quiet = net.link("a", "b")
        assert quiet.gossip(100) is not None and quiet.gossip(100) is not None
        assert quiet._rng is None and quiet._lot is None  # a lossless, never-cut link holds neither
        assert not hasattr(quiet, "__dict__")  # slots: no per-link dict
        assert quiet.stats == {"bytes": 200, "messages": 2, "dropped": 0}
        net.set_link("a", "c", LinkConditions(latency_s=0.01, loss=0.5))
        lossy = net.link("a", "c")
        drops.extend(lossy.gossip(10) is None for _ in range(200))
        assert lossy._rng is not None and net.link("c", "a").cond.loss == 0.5
        assert quiet.cond is net.default and net.link("c", "a").cond is not lossy.cond  # set_link copies

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    digest = hashlib.sha256(b"11|a|c").digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    assert drops == [rng.random() < 0.5 for _ in range(200)]  # the seed of (network seed, src, dst)
    assert 50 < sum(drops) < 150
