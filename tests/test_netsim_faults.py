"""Each fault on the in-memory back-end: real daemons on a simulated network (fast: the
clock is simulated), plus the gossip-only peers used for 1,000-node runs."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio

from ledger import Ledger
from netsim.memnet import MemCluster
from netsim.report import strip_timing
from netsim.run import run_gossip_scenario
from netsim.scenario import NetworkSpec, scenario_from_dict


def scenario(nodes: int = 4, entries: int = 24, faults: list | None = None, **topo) -> object:
    return scenario_from_dict({
        "scenario": {"name": "faults", "seed": 11},
        "network": {"latency_ms": 20, "bandwidth_mbps": 50},
        "topology": {"nodes": nodes, "degree": 2, "sync_interval_s": 2, "poll_interval_s": 0.1, **topo},
        "workload": {"entries": entries, "entry_bytes": 200, "interval_s": 0.05, "deadline_s": 60},
        "faults": faults or [],
    })


def run(tmp_path: Path, **kw) -> dict:
    return run_gossip_scenario(scenario(**kw), tmp_path)


def fault(rep: dict, kind: str) -> dict:
    (f,) = [f for f in rep["faults"] if f["kind"] == kind]
    return f


def test_no_fault_every_node_gets_every_entry(tmp_path: Path) -> None:
    rep = run(tmp_path)
    assert rep["converged"] and rep["entries"] == 24
    assert all(n["complete"] and n["held"] == 24 for n in rep["nodes"].values())
    assert all(n["bytes"]["received"] > 24 * 200 for n in rep["nodes"].values())


def test_kill_without_restart(tmp_path: Path) -> None:
    rep = run(tmp_path, faults=[{"kind": "kill", "node": "n3", "at_s": 0.2}])
    assert fault(rep, "kill")["status"] == "done"
    n3 = rep["nodes"]["n3"]
    assert n3["status"] == "killed" and not n3["complete"] and n3["missing"] > 0
    assert rep["converged"]  # the live nodes hold everything that got out
    live = [v for k, v in rep["nodes"].items() if k != "n3"]
    assert all(v["complete"] for v in live)


def test_kill_then_restart_catches_up(tmp_path: Path) -> None:
    rep = run(tmp_path, faults=[{"kind": "kill", "node": "n2", "at_s": 0.2},
                                {"kind": "restart", "node": "n2", "at_s": 1.5}])
    assert [f["status"] for f in rep["faults"]] == ["done", "done"]
    assert rep["converged"] and rep["nodes"]["n2"]["complete"] and rep["nodes"]["n2"]["status"] == "running"
    # its entries appended while it was down (as a CLI would) went out after the restart
    assert rep["entries"] == 24 and all(v["held"] == 24 for v in rep["nodes"].values())
    assert rep["nodes"]["n2"]["complete_at_s"] >= 1.5


def test_partition_then_heal(tmp_path: Path) -> None:
    rep = run(tmp_path, faults=[{"kind": "partition", "groups": [["n0", "n1"], ["n2", "n3"]], "at_s": 0.0},
                                {"kind": "heal", "at_s": 3.0}])
    assert [f["status"] for f in rep["faults"]] == ["done", "done"]
    assert rep["converged"]
    # nothing can cross the cut before the heal
    assert rep["time_to_converge_s"] >= 3.0
    assert all(v["complete"] for v in rep["nodes"].values())


def test_partition_without_heal_is_reported(tmp_path: Path) -> None:
    s = scenario(faults=[{"kind": "partition", "groups": [["n0", "n1"], ["n2", "n3"]], "at_s": 0.0}])
    s = s.replace(workload=s.workload.__class__(entries=8, entry_bytes=100, interval_s=0.05, deadline_s=5.0))
    rep = run_gossip_scenario(s, tmp_path)
    assert not rep["converged"] and any("deadline" in n for n in rep["notes"])
    assert any(not v["complete"] for v in rep["nodes"].values())


def test_slow_link_delays_delivery(tmp_path: Path) -> None:
    fast = run(tmp_path / "fast", nodes=2, entries=4)
    slow = run(tmp_path / "slow", nodes=2, entries=4,
               faults=[{"kind": "slow_link", "a": "n0", "b": "n1", "latency_ms": 1500, "at_s": 0.0}])
    assert fault(slow, "slow_link")["status"] == "done" and slow["converged"]
    assert slow["time_to_converge_s"] >= fast["time_to_converge_s"] + 1.4


def test_late_joiner_catches_up_by_sync(tmp_path: Path) -> None:
    rep = run(tmp_path, faults=[{"kind": "late_join", "node": "n3", "at_s": 2.0}])
    assert fault(rep, "late_join")["status"] == "done"
    n3 = rep["nodes"]["n3"]
    assert n3["status"] == "running" and n3["complete"] and n3["complete_at_s"] >= 2.0
    assert rep["converged"]


def test_leave_for_good(tmp_path: Path) -> None:
    rep = run(tmp_path, faults=[{"kind": "leave", "node": "n1", "at_s": 0.4}])
    assert fault(rep, "leave")["status"] == "done"
    assert rep["nodes"]["n1"]["status"] == "left"
    assert rep["converged"] and all(v["complete"] for k, v in rep["nodes"].items() if k != "n1")
    # what n1 published before leaving reached the others
    assert rep["nodes"]["n0"]["held"] == rep["nodes"]["n0"]["expected"] > 0


def test_same_seed_same_report(tmp_path: Path) -> None:
    faults = [{"kind": "kill", "node": "n1", "at_s": 0.3}, {"kind": "restart", "node": "n1", "at_s": 1.0}]
    a = run(tmp_path / "a", faults=faults)
    b = run(tmp_path / "b", faults=faults)
    assert strip_timing(a) == strip_timing(b)
    assert a["time_to_converge_s"] == b["time_to_converge_s"]  # simulated time is reproducible too


@pytest.mark.parametrize("faults", [[], [{"kind": "kill", "node": "n5", "at_s": 0.1},
                                         {"kind": "restart", "node": "n5", "at_s": 0.8}]])
def test_lite_peers(tmp_path: Path, faults: list) -> None:
    rep = run(tmp_path, nodes=40, entries=20, peers="lite", faults=faults)
    assert rep["peers"] == "lite" and rep["converged"]
    assert all(v["complete"] for v in rep["nodes"].values())


def test_scenario_link_conditions_apply(tmp_path: Path) -> None:
    fast = run(tmp_path / "fast", nodes=2, entries=4)
    raw = {"scenario": {"name": "links", "seed": 11}, "network": {"latency_ms": 20, "links": [
        {"a": "n0", "b": "n1", "latency_ms": 1500}]},
        "topology": {"nodes": 2, "degree": 2, "sync_interval_s": 2, "poll_interval_s": 0.1},
        "workload": {"entries": 4, "entry_bytes": 200, "interval_s": 0.05, "deadline_s": 60}}
    slow = run_gossip_scenario(scenario_from_dict(raw), tmp_path / "slow")
    assert slow["converged"] and slow["time_to_converge_s"] >= fast["time_to_converge_s"] + 1.4


def test_simulated_clock_gives_the_real_clock_result(tmp_path: Path) -> None:
    """One small scenario (5 full daemons, a node killed and restarted) run on trio's
    MockClock and on the real clock with real worker threads: the same entries reach the
    same nodes, both converge, and the restarted node catches up after its restart."""
    s = scenario(nodes=5, entries=15, faults=[{"kind": "kill", "node": "n3", "at_s": 0.2},
                                              {"kind": "restart", "node": "n3", "at_s": 0.8}])
    sim = run_gossip_scenario(s, tmp_path / "sim")
    real = run_gossip_scenario(s, tmp_path / "real", simulated=False)
    assert (sim["clock"], real["clock"]) == ("simulated", "real")
    for rep in (sim, real):
        assert rep["peers"] == "daemon" and rep["converged"] and rep["entries"] == 15
        assert [f["status"] for f in rep["faults"]] == ["done", "done"]
        assert rep["nodes"]["n3"]["complete_at_s"] >= 0.8
    outcome = {rep["clock"]: {n: (v["status"], v["held"], v["expected"]) for n, v in rep["nodes"].items()}
               for rep in (sim, real)}
    assert outcome["simulated"] == outcome["real"]
    assert all(held == expected == 15 for _, held, expected in outcome["real"].values())


@pytest.mark.parametrize("peers, nodes", [("daemon", 10), ("lite", 40)])
def test_churn_during_a_partition_then_heal(tmp_path: Path, peers: str, nodes: int) -> None:
    """10% of the nodes crash and come back while the network is cut in two halves; after
    the heal every ledger converges (nothing crosses the cut before it)."""
    names = [f"n{i}" for i in range(nodes)]
    churn = names[3::10]
    faults = [{"kind": "partition", "groups": [names[: nodes // 2], names[nodes // 2:]], "at_s": 0.0},
              {"kind": "heal", "at_s": 3.0}]
    faults += [{"kind": "kill", "node": n, "at_s": 0.3} for n in churn]
    faults += [{"kind": "restart", "node": n, "at_s": 1.5} for n in churn]
    rep = run(tmp_path, nodes=nodes, entries=20, peers=peers, faults=faults)
    assert rep["peers"] == peers
    assert all(f["status"] == "done" for f in rep["faults"]) and len(rep["faults"]) == 2 + 2 * len(churn)
    assert rep["converged"] and rep["time_to_converge_s"] >= 3.0
    assert all(v["complete"] and v["status"] == "running" for v in rep["nodes"].values())
    assert all(rep["nodes"][n]["held"] == rep["entries"] == 20 for n in churn)


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_append_racing_a_shutdown_is_written_as_to_a_down_node(tmp_path: Path, how: str) -> None:
    """Real clock, real threads: the node's ledger closes while an append waits in its worker
    thread (the race a real-clock run under load hit). The append is not lost and raises
    nothing: it is written the way a down node gets it."""
    c = MemCluster(tmp_path, ["n0"], seed=5, network=NetworkSpec(latency_ms=5), established=True)
    entered, release = threading.Event(), threading.Event()
    out: dict = {}

    async def main() -> None:
        async with c.running():
            await c.start("n0")
            daemon = c.daemons["n0"]
            assert daemon.head_confirmed  # the append takes the running node's path
            led = daemon.ledger.ledger
            real = led.append_many

            def held(*a, **k):
                entered.set()
                release.wait(30)
                return real(*a, **k)

            led.append_many = held

            async def appender() -> None:
                out["seq"] = await c.append("n0", "metrics", {"raced": how})

            async with trio.open_nursery() as nursery:
                nursery.start_soon(appender)
                await trio.to_thread.run_sync(entered.wait, 30)
                if how == "kill":
                    await c.kill("n0")  # closes the ledger under the waiting thread
                else:
                    c.daemons["n0"].stop()
                release.set()
                if how == "stop":
                    await c.stop("n0")
            out["status"] = c.status["n0"]

    trio.run(main)
    assert out["status"] == ("killed" if how == "kill" else "stopped")
    with Ledger.open(c.c.homes["n0"].ledger_db) as led:
        mine = [e for author in led.heads() for e in led.entries_after(author, 0) if e.kind == "metrics"]
    assert [e.body for e in mine] == [{"raced": how}] and mine[0].seq == out["seq"]
