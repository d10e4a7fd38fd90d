"""Start-up pulls (issue 29): a burst of connections starts one sync pull, not one per
connection; a failed pull does not count; a node that was away still catches up at once."""
from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from atdnode.sync_connect import ConnectPulls
from netsim.memnet import MemCluster, simulate
from netsim.scenario import NetworkSpec
from netsim.workload import start_all


def test_a_burst_of_connections_pulls_once_and_a_failure_does_not_count() -> None:
    calls: list[str] = []
    answer: dict[str, object] = {}

    async def pull(peer: str) -> object | None:
        calls.append(peer)
        await trio.sleep(0.2)  # one round trip
        return answer.get(peer, "ok")

    async def main() -> None:
        cp = ConnectPulls(pull, gap_s=5.0)
        async with trio.open_nursery() as nursery:  # five peers connect within one round trip
            for p in "abcde":
                nursery.start_soon(cp.on_connect, p)
        assert len(calls) == 1 and cp.skipped == 4
        await trio.sleep(1.0)
        await cp.on_connect("f")  # within the gap after a successful pull
        assert len(calls) == 1
        await trio.sleep(5.0)
        answer["g"] = None  # g refuses us (or is gone)
        await cp.on_connect("g")
        await cp.on_connect("h")  # a failure sets no gap: the next connection pulls
        assert calls[1:] == ["g", "h"] and cp.pulls == 3

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_established_start_pulls_once_per_node_and_a_restart_catches_up(tmp_path: Path) -> None:
    names = [f"n{i}" for i in range(6)]
    c = MemCluster(tmp_path, names, seed=7, network=NetworkSpec(latency_ms=5), sync_interval=60.0,
                   poll_interval=0.1, established=True)
    out: dict = {}

    async def main() -> None:
        async with c.running():
            assert not await start_all(c, names, seed=7, degree=5, deadline_s=30)
            await trio.sleep(3.0)  # connections settled, every head confirmed (no periodic sync before 60 s)
            out["connections"] = sum(len(c.peers(n)) for n in names) // 2
            out["pulls"] = {n: c.daemons[n].stats["sync_pulls"] for n in names}
            out["confirmed"] = all(c.daemons[n].head_confirmed for n in names)
            await c.kill("n3")
            last = [await c.append("n1", "metrics", {"k": k}) for k in range(3)][-1]
            await c.restart("n3", bootstrap=["n0", "n2", "n4"])
            pid = c.peer_ids["n1"]
            with trio.fail_after(10):  # far less than the periodic sync's 60 s
                while (await c.heads("n3")).get(pid, 0) < last:
                    await trio.sleep(0.05)
            out["restart_pulls"] = c.daemons["n3"].stats["sync_pulls"]
            out["restart_peers"] = len(c.peers("n3"))

    simulate(main, seed=7)
    # both ends of each connection used to pull: ~2 x connections / nodes pulls per node
    assert out["connections"] >= 2 * len(names), out
    assert set(out["pulls"].values()) == {1}, out
    assert out["confirmed"], out
    assert out["restart_peers"] >= 2 and out["restart_pulls"] == 1, out
