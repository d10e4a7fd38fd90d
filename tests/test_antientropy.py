"""Periodic sync paced by what happens (`atdnode.replication.antientropy`): quiet pulls space
out up to SYNC_IDLE_FACTOR intervals; entries a pull brought, gossip arriving, or a member
whose request shows it is ahead of us bring the cadence back to `sync_interval`, and the
member seen ahead is pulled from next. Pull times on trio's mock clock; the daemon case on
the simulated network (netsim.memnet: real daemons, SQLite ledgers, the real sync server)."""
from __future__ import annotations

import random
from pathlib import Path

import trio
import trio.testing

from atdnode.replication.antientropy import SYNC_IDLE_FACTOR, AntiEntropy, SyncPace
from ledger import Ledger
from netsim.memnet import MemCluster, simulate
from netsim.scenario import NetworkSpec
from netsim.workload import start_all

BASE = 10.0


def test_quiet_pulls_space_out_and_any_sign_of_movement_resets_the_pace() -> None:
    stats: dict[str, int] = {}
    pace = SyncPace(stats)
    seen = []
    for _ in range(5):
        seen.append(pace.interval(BASE))
        pace.pulled(0)
    assert seen == [10.0, 20.0, 40.0, 40.0, 40.0] and SYNC_IDLE_FACTOR == 4
    pace.pulled(3, members=2)  # a pull brought entries gossip had not: a round of 2 more at BASE
    assert pace.interval(BASE) == BASE
    pace.pulled(0, members=2)
    pace.pulled(0, members=2)
    assert pace.interval(BASE) == BASE  # the round after the entries: each member sees we are ahead
    pace.pulled(0, members=2)
    assert pace.interval(BASE) == 2 * BASE
    pace.pulled(0)
    stats["gossip_in"] = 1  # gossip arrived since the last pull: entries are moving
    pace.pulled(0)
    assert pace.interval(BASE) == BASE
    pace.pulled(0)
    assert pace.interval(BASE) == 2 * BASE
    pace.observed("p1", False)  # in step: nothing changes
    assert pace.interval(BASE) == 2 * BASE and not pace.ahead
    pace.observed("p1", True)
    pace.observed("p1", True)
    assert pace.interval(BASE) == BASE and pace.ahead == ["p1"] and pace.wake.is_set()
    assert pace.take_ahead(["p2"], 1) == [] and not pace.ahead  # gone since: dropped


def _run_loop(until: float, pokes: dict[float, str] = {}, new_interval: tuple[float, float] | None = None
              ) -> list[tuple[float, str]]:
    """Run an AntiEntropy loop on a mock clock until `until`; `pokes`: time -> peer seen
    ahead; `new_interval`: (time, seconds) the daemon's sync_interval is set to."""
    pulls: list[tuple[float, str]] = []
    stats: dict[str, int] = {}
    interval = [BASE]

    async def pull(peer: str) -> int:
        pulls.append((trio.current_time(), peer))
        return 0

    ae = AntiEntropy(stats=stats, interval=lambda: interval[0], fanout=lambda: 1, members=lambda: ["a", "b", "c"],
                     pull=pull, rng=random.Random(1))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ae.run)
            if new_interval is not None:
                await trio.sleep_until(new_interval[0])
                interval[0] = new_interval[1]
            for at, peer in sorted(pokes.items()):
                await trio.sleep_until(at)
                ae.observed(peer, True)
            await trio.sleep_until(until)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return pulls


def test_loop_pulls_quiet_peers_ever_less_often_and_a_peer_seen_ahead_next() -> None:
    quiet = _run_loop(200.0)
    assert [t for t, _ in quiet] == [10.0, 30.0, 70.0, 110.0, 150.0, 190.0]
    # at 85 s a member's request shows entries we lack: it is pulled from at once (10 s
    # after the last pull have passed), not at 110 s; that pull brought nothing here, so
    # the next comes 2 intervals later
    poked = _run_loop(120.0, {85.0: "c"})
    assert [t for t, _ in poked] == [10.0, 30.0, 70.0, 85.0, 105.0] and poked[3][1] == "c"
    # never more often than sync_interval, however often it is poked
    busy = _run_loop(40.0, {10.5: "a", 11.0: "b", 12.0: "c", 13.0: "a"})
    times = [t for t, _ in busy]
    assert all(b - a >= BASE for a, b in zip(times, times[1:])), busy
    assert busy[1] == (20.0, "a")  # the first peer seen ahead, pulled at the earliest moment
    # sync_interval set to an hour while a pull is pending: that pull still comes when it was
    # due (as a sleep of the old interval did), the next SYNC_IDLE_FACTOR hours later
    assert [t for t, _ in _run_loop(20000.0, new_interval=(25.0, 3600.0))] == [10.0, 30.0, 30.0 + 4 * 3600.0]


def test_a_daemon_that_missed_an_entry_pulls_it_from_the_member_whose_request_shows_it(tmp_path: Path) -> None:
    """Three idle daemons whose pulls spaced out to SYNC_IDLE_FACTOR intervals; an entry of a
    fourth member (not running) reaches n1 only, as if gossip missed n0. Right after n0's
    own periodic pull, n1 pulls from n0: that request shows n0 that n1 is ahead, and n0
    pulls the entry from n1 within one sync interval, not at its spaced-out next pull."""
    sync_s = 5.0
    names = ["n0", "n1", "n2", "n3"]
    cluster = MemCluster(tmp_path, names, seed=9, network=NetworkSpec(), sync_interval=sync_s,
                         poll_interval=0.25, established=True)
    out: dict = {}

    async def main() -> None:
        async with cluster.running():
            assert not await start_all(cluster, names[:3], seed=9, degree=2, deadline_s=30)
            await trio.sleep(12 * sync_s)  # idle: pulls spaced out
            n0, n1 = cluster.daemons["n0"], cluster.daemons["n1"]
            out["factor"] = n0.replica.anti_entropy.pace.factor
            seq = await cluster.append("n3", "metrics", {"missed": True})  # n3's ledger file, its daemon is down
            key = Ledger.open(cluster.c.homes["n3"].ledger_db)
            raw = [e.to_bytes() for e in key.all_entries() if e.seq == seq and e.kind == "metrics"]
            key.close()
            cluster._ledger_call("n1", lambda led: led.merge(raw))
            pulls = n0.stats["sync_pulls"]
            while n0.stats["sync_pulls"] == pulls:  # n0 just pulled: its next spaced-out pull is far off
                await trio.sleep(0.05)
            assert cluster.peer_ids["n0"] in n1.transport.peers()
            t0 = trio.current_time()
            await n1.replica.pull_from(cluster.peer_ids["n0"])
            pid = cluster.peer_ids["n3"]
            with trio.move_on_after(10 * sync_s):
                while (await cluster.heads("n0")).get(pid, 0) < seq:
                    await trio.sleep(0.05)
            out["learned_s"] = trio.current_time() - t0

    simulate(main, seed=9)
    assert out["factor"] == SYNC_IDLE_FACTOR, out  # spaced out before
    assert out["learned_s"] <= sync_s + 1.0, out  # its next pull was SYNC_IDLE_FACTOR intervals away


def test_periodic_pulls_skip_a_member_whose_refusal_back_off_runs(tmp_path: Path) -> None:
    """A member that refused us lately (its refusal back-off runs) is left out of the periodic
    round: the round's pull goes to another member instead of being skipped (a round with
    two peers lost every other pull; tests/test_gossip_mesh.py then waited in vain for the
    pull that a new sync_interval follows)."""
    sync_s = 2.0
    names = ["n0", "n1", "n2"]
    cluster = MemCluster(tmp_path, names, seed=11, network=NetworkSpec(), sync_interval=sync_s,
                         poll_interval=0.25, established=True)
    out: dict = {}

    async def main() -> None:
        async with cluster.running():
            assert not await start_all(cluster, names, seed=11, degree=2, deadline_s=30)
            await trio.sleep(5 * sync_s)
            n0 = cluster.daemons["n0"]
            assert len(n0.transport.peers()) == 2
            n0.replica.anti_entropy.pace.idle_factor = 1  # a pull every interval: rounds are countable
            n0.dialer.policy.refusals.base = n0.dialer.policy.refusals.cap = 60.0
            n0.dialer.refused_by(cluster.peer_ids["n1"])  # n1 refused us: left alone for 60 s
            pulls = n0.stats["sync_pulls"]
            await trio.sleep(8 * sync_s + 0.5)
            out["pulls"] = n0.stats["sync_pulls"] - pulls

    simulate(main, seed=11)
    assert out["pulls"] >= 7, out  # one per interval (8), where every other one was skipped
