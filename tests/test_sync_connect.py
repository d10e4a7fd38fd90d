"""One pull per new connection between ledgers in step (atdnode.sync_connect, issue 29):
the leader (smaller peer id) pulls; the follower pulls only when the leader's request
showed something it lacks, or when no request came in time. Simulated time, in-memory
daemons (netsim.memnet); periodic sync off, so only connection pulls can carry an entry
across a healed cut."""
from __future__ import annotations

from pathlib import Path
from typing import Awaitable, Callable

import pytest
import trio

from atdnode.sync_connect import ConnectPulls
from netsim.memnet import MemCluster, simulate
from netsim.scenario import NetworkSpec


def _run(root: Path, body: Callable[[MemCluster, str, str], Awaitable[dict]]) -> dict:
    """Start n0 and n1 (established ledgers in step, n1 dials n0), wait until both own
    heads are confirmed and the connection pulls are done, then `body(cluster, leader,
    follower)` (the leader: the smaller peer id); returns what it returned."""
    c = MemCluster(root, ["n0", "n1"], seed=3, network=NetworkSpec(latency_ms=5), sync_interval=1e6,
                   poll_interval=0.1, established=True)
    out: dict = {}

    async def main() -> None:
        async with c.running():
            await c.start("n0")
            await c.start("n1", bootstrap=["n0"])
            with trio.fail_after(20):
                while not all(c.daemons[n].head_confirmed for n in ("n0", "n1")) or not c.peers("n0"):
                    await trio.sleep(0.05)
            await trio.sleep(1.0)  # connection pulls (and waits) done
            leader, follower = sorted(["n0", "n1"], key=lambda n: c.peer_ids[n])
            out.update(await body(c, leader, follower))

    simulate(main, seed=3)
    return out


def _pulls(c: MemCluster, n: str) -> int:
    return c.daemons[n].stats["sync_pulls"]


def _skipped(c: MemCluster, n: str) -> int:
    return c.daemons[n].stats.get("connect_pulls_skipped", 0)


def test_ledgers_in_step_pull_once_per_connection_and_the_follower_is_confirmed(tmp_path: Path) -> None:
    """Two established ledgers in step connect: one pull in all (the leader's), the follower
    skips its own and its own chain head is confirmed by the leader's request alone (no
    pull of its own). Both ends pulling -- the old rule -- makes two."""

    async def body(c: MemCluster, leader: str, follower: str) -> dict:
        return dict(leader=_pulls(c, leader), follower=_pulls(c, follower), skipped=_skipped(c, follower),
                    confirmed=c.daemons[follower].head_confirmed)

    out = _run(tmp_path, body)
    assert out == {"leader": 1, "follower": 0, "skipped": 1, "confirmed": True}


async def _reconnect_after_cut(c: MemCluster, writer: str) -> int:
    """Cut the link, let `writer` append into the cut (its gossip reaches no one), heal and
    reconnect; returns the entry's seq."""
    c.partition([["n0"], ["n1"]])
    await c.daemons["n0"].transport.disconnect(c.peer_ids["n1"])
    seq = await c.append(writer, "metrics", {"k": 1})
    await trio.sleep(10.0)  # past any gossip history window
    other = "n1" if writer == "n0" else "n0"
    assert (await c.heads(other)).get(c.peer_ids[writer], 0) < seq
    c.heal()
    if c.peer_ids["n1"] not in c.peers("n0"):  # (a dialer may have been first)
        await c.daemons["n0"].transport.connect(c.address("n1"))
    with trio.fail_after(30):
        while (await c.heads(other)).get(c.peer_ids[writer], 0) < seq:
            await trio.sleep(0.05)
    return seq


@pytest.mark.parametrize("writer_role", ["leader", "follower"])
def test_whoever_lacks_the_entry_gets_it_on_reconnecting(tmp_path: Path, writer_role: str) -> None:
    """One side appended while the link was cut. If the leader wrote it, the follower learns
    from the leader's request that it lacks something and pulls (a follower that always
    skipped would never get it: periodic sync is off); if the follower wrote it, the
    leader's own pull fetches it and the follower, lacking nothing, skips its pull."""

    async def body(c: MemCluster, leader: str, follower: str) -> dict:
        before = {n: (_pulls(c, n), _skipped(c, n)) for n in ("n0", "n1")}
        await _reconnect_after_cut(c, leader if writer_role == "leader" else follower)
        return {"follower_pulled": _pulls(c, follower) > before[follower][0],
                "follower_skipped": _skipped(c, follower) > before[follower][1],
                "leader_pulled": _pulls(c, leader) > before[leader][0]}

    out = _run(tmp_path, body)
    if writer_role == "leader":
        assert out == {"follower_pulled": True, "follower_skipped": False, "leader_pulled": True}
    else:
        assert out == {"follower_pulled": False, "follower_skipped": True, "leader_pulled": True}


def test_a_follower_pulls_when_the_leader_never_does(tmp_path: Path) -> None:
    """A leader that does not pull on connecting (an older daemon, one in a back-off): the
    follower hears no request and pulls after its wait, so it still gets the leader's entry."""

    async def body(c: MemCluster, leader: str, follower: str) -> dict:
        async def no_pull(_peer: str) -> None:
            await trio.lowlevel.checkpoint()

        c.daemons[leader].replica.connect_pull = no_pull  # the bound method the daemon starts
        before = _pulls(c, follower)
        t0 = trio.current_time()
        await _reconnect_after_cut(c, leader)
        return {"waited": trio.current_time() - t0 >= 10.0 + c.daemons[follower].replica.connect_pulls.wait_s,
                "follower_pulled": _pulls(c, follower) > before}

    out = _run(tmp_path, body)
    assert out == {"waited": True, "follower_pulled": True}


def test_only_a_request_after_the_connection_counts() -> None:
    """An observation made before the follower started waiting (an earlier connection's)
    is no evidence about this one: the waiter times out and says pull."""
    cp = ConnectPulls("b", wait_s=1.0)
    out: list[bool] = []

    async def main() -> None:
        cp.observed("a", False)  # before anyone waits: forgotten
        out.append(await cp.peer_has_nothing_new("a"))
        async with trio.open_nursery() as nursery:
            async def later(ahead: bool) -> None:
                await trio.sleep(0.2)
                cp.observed("a", ahead)

            nursery.start_soon(later, False)
            out.append(await cp.peer_has_nothing_new("a"))
            nursery.start_soon(later, True)
            out.append(await cp.peer_has_nothing_new("a"))
        assert not cp._waiting  # nothing left behind

    simulate(main, seed=1)
    assert out == [False, True, False]
    assert cp.leads("c") and not cp.leads("a")
