"""Bounded peer sets with real daemons: connection counts stay within
`[peers] target..max` while members leave and join, and every entry still reaches every
node; after a partition heals, bounded peer sets converge every ledger.

Real `NodeDaemon`s (SQLite ledgers, signatures); the churn test runs them over real
libp2p on 127.0.0.1 in one trio run, the partition test on the in-memory transport (a
partition there is a simulated link cut). Every wait is on a condition with a deadline.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import trio

from atdnode.node import NodeConfig, NodeDaemon, NodeIdentity
from atdnode.transport import MemoryNetwork, MemoryTransport
from ledger import Ledger
from netsim.homes import make_consortium
from tests.factories import wait_for

TARGET, MAX = 3, 5
PEERS = {"target": TARGET, "max": MAX, "grace_s": 1.0, "redial_after_s": 2.0, "rotate_s": 2.0}
LISTEN = ["/ip4/127.0.0.1/tcp/0"]


def homes_with_peer_set(root: Path, n: int):
    c = make_consortium(root, [f"n{i}" for i in range(n)], seed=15)
    for h in c.homes.values():
        cfg = NodeConfig.load(h)
        cfg.extra["peers"] = dict(PEERS)
        cfg.save(h)
    return c


def ids_of(d: NodeDaemon) -> set[bytes]:
    with Ledger.open(d.home.ledger_db) as led:
        return {e.id for e in led.all_entries()}


def within_bounds(ds: list[NodeDaemon]) -> bool:
    return all(TARGET <= len(d.transport.peers()) <= MAX for d in ds)


class Cluster:
    """Daemons of one trio run that can be stopped and started again on their homes."""

    def __init__(self, c, nursery: trio.Nursery, make) -> None:
        self.c, self.nursery, self.make = c, nursery, make
        self.live: dict[str, NodeDaemon] = {}
        self.done: dict[str, trio.Event] = {}

    async def start(self, name: str, bootstrap: list[str]) -> NodeDaemon:
        d = self.make(self.c.homes[name])
        done = self.done[name] = trio.Event()

        async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
            try:
                await d.run(LISTEN, bootstrap, task_status=task_status)
            finally:
                done.set()

        await self.nursery.start(run)
        self.live[name] = d
        return d

    async def stop(self, name: str) -> None:
        self.live.pop(name).stop()
        with trio.fail_after(30):
            await self.done[name].wait()

    async def append_everywhere(self, tag: str) -> set[bytes]:
        out = set()
        for k, d in enumerate(self.live.values()):
            out.add((await d.append("metrics", {"tag": tag, "k": k})).id)
        return out


@pytest.mark.slow  # ten daemons on real libp2p, three leave and rejoin
def test_peer_set_bounds_hold_under_churn_and_entries_reach_everyone(tmp_path: Path) -> None:
    n = 10
    c = homes_with_peer_set(tmp_path, n)

    def make(home):
        return NodeDaemon(home, sync_interval=2.0, poll_interval=0.1, auto_fetch=False)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            cl = Cluster(c, nursery, make)
            first = await cl.start("n0", [])
            for i in range(1, n):  # everyone bootstraps from n0: it must prune down to max
                await cl.start(f"n{i}", [first.transport.addrs()[0]])
            ds = lambda: list(cl.live.values())  # noqa: E731
            await wait_for(lambda: within_bounds(ds()), "every peer set within bounds", 150)
            assert first.peerset.pruned > 0  # 9 inbound connections were cut down to <= 5
            sent = await cl.append_everywhere("before")
            await wait_for(lambda: all(sent <= ids_of(d) for d in ds()), "entries reach all 10", 90)

            # churn: three leave; the others replace the lost peers and stay within bounds
            for name in ("n0", "n1", "n2"):
                await cl.stop(name)
            await wait_for(lambda: within_bounds(ds()), "bounds after 3 left", 90)
            sent |= await cl.append_everywhere("during")
            # ... and they come back (new ports: found through their new hello entries)
            boot = cl.live["n5"].transport.addrs()[0]
            for name in ("n0", "n1", "n2"):
                await cl.start(name, [boot])
            await wait_for(lambda: within_bounds(ds()), "bounds after 3 rejoined", 90)
            sent |= await cl.append_everywhere("after")
            await wait_for(lambda: all(sent <= ids_of(d) for d in ds()), "all entries reach all 10", 90)
            assert len(cl.live) == n
            await wait_for(lambda: within_bounds(ds()), "bounds at the end", 60)  # rotation swaps peers meanwhile
            # a bounded set, not a full mesh: 10 nodes x <= 5 links, nobody near 9
            assert sum(len(d.transport.peers()) for d in ds()) <= n * MAX
            status = await cl.live["n5"].status()
            assert status["peer_set"]["target"] == TARGET and status["peer_set"]["max"] == MAX
            for d in ds():
                d.stop()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_partition_heals_and_bounded_peer_sets_converge(tmp_path: Path) -> None:
    n = 10
    c = homes_with_peer_set(tmp_path, n)
    net = MemoryNetwork(seed=15)

    def make(home):
        seed = NodeIdentity.load(home).signer.seed
        return NodeDaemon(home, transport=MemoryTransport(net, seed), sync_interval=1.0, poll_interval=0.1,
                          auto_fetch=False)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            cl = Cluster(c, nursery, make)
            first = await cl.start("n0", [])
            for i in range(1, n):
                await cl.start(f"n{i}", [first.transport.addrs()[0]])
            ds = list(cl.live.values())
            h = n // 2  # two sides of 5: each can hold every peer set (target 3) within itself
            await wait_for(lambda: within_bounds(ds), "peer sets within bounds", 60)
            left = {d.transport.peer_id for d in ds[:h]}
            right = {d.transport.peer_id for d in ds[h:]}
            crossing = sum(1 for d in ds[:h] for p in d.transport.peers() if p in right)
            assert crossing > 0  # the cut really separates linked nodes
            net.partition(left, right)
            for d in ds:  # the cut connections time out (as TCP's would): each side re-dials within itself
                for p in d.transport.peers():
                    if (p in right) != (d.transport.peer_id in right):
                        await d.transport.disconnect(p)
            a = {(await d.append("metrics", {"side": "left", "k": k})).id for k, d in enumerate(ds[:h])}
            b = {(await d.append("metrics", {"side": "right", "k": k})).id for k, d in enumerate(ds[h:])}
            await wait_for(lambda: all(a <= ids_of(d) for d in ds[:h]) and all(b <= ids_of(d) for d in ds[h:]),
                           "each side converges", 60)
            assert not any(b & ids_of(d) for d in ds[:h])  # nothing crossed the cut
            # each side holds bounded sets within itself; only the periodic rotation (one peer
            # swapped for a random member) brings links across again once the cut heals
            net.heal()
            await wait_for(lambda: all((a | b) <= ids_of(d) for d in ds), "every ledger after the heal", 60)
            heads = {frozenset(ids_of(d)) for d in ds}
            assert len(heads) == 1
            await wait_for(lambda: within_bounds(ds), "peer sets within bounds after the heal", 60)
            for d in ds:
                d.stop()
            nursery.cancel_scope.cancel()

    trio.run(main)
