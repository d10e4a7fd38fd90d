"""What an idle daemon does (a hundred daemons on one machine must not spend
the CPU idling). Counted on the simulated clock (netsim.memnet: real daemons, SQLite
ledgers, simulated network and time), not timed:

* the announce loop reads the ledger only when its files changed (`ledger_stamp`) and every
  LEDGER_RECHECK_S, yet an entry a CLI command appends from another connection is still
  gossiped within an idle poll tick (IDLE_POLL_S) or so;
* periodic sync pulls from `sync_fanout` peers per interval, in turn, not from every peer,
  and quiet pulls space out (`atdnode.replication.antientropy`);
* its own loops wake rarely: the announce loop every IDLE_POLL_S once quiet, the
  peer-set round every IDLE_TICK_S once settled, the fetch loop not at all with nothing wanted.
"""
from __future__ import annotations

from pathlib import Path

import trio

from atdnode.replication.announce import IDLE_POLL_S, LEDGER_RECHECK_S, ledger_stamp
from atdnode.replication.antientropy import SYNC_IDLE_FACTOR
from atdnode.peers.dialer import IDLE_TICK_S
from atdnode.replication import SYNC_FANOUT
from ledger import Ledger, Signer
from netsim.memnet import MemCluster, simulate
from netsim.scenario import NetworkSpec
from netsim.workload import start_all

IDLE_S = 60.0
SYNC_S = 5.0
POLL_S = 0.25


def test_ledger_stamp_moves_on_a_commit_from_another_connection(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    signer = Signer.generate()
    with Ledger.open(db) as led:
        led.create_genesis(signer, "stamp", [])
        before = ledger_stamp(db)
        assert ledger_stamp(db) == before  # nothing written: the same stamp
        with Ledger.open(db) as other:  # e.g. a CLI command's own handle
            other.append(signer, "metrics", {"x": 1})
        assert ledger_stamp(db) != before
        assert led.head_of(signer.public_key) == 2
    assert ledger_stamp(tmp_path / "absent.db") == (None, None)


def test_idle_daemon_reads_its_ledger_only_on_change_and_pulls_a_few_peers(tmp_path: Path) -> None:
    names = [f"n{i}" for i in range(6)]
    cluster = MemCluster(tmp_path, names, seed=5, network=NetworkSpec(), sync_interval=SYNC_S,
                         poll_interval=POLL_S, established=True)
    out: dict = {}

    async def main() -> None:
        async with cluster.running():
            assert not await start_all(cluster, names, seed=5, degree=5, deadline_s=30)
            await trio.sleep(10)  # hellos said, on-connect pulls done
            d = cluster.daemons["n0"]
            led = d.ledger.ledger
            reads = {"head_of": 0}
            real_head_of = led.head_of

            def counting_head_of(author: bytes) -> int:
                reads["head_of"] += 1
                return real_head_of(author)

            led.head_of = counting_head_of
            pulls0 = d.stats["sync_pulls"]
            peers = len(d.transport.peers())
            steps = _StepCounter(LOOPS)
            trio.lowlevel.add_instrument(steps)
            await trio.sleep(IDLE_S)
            trio.lowlevel.remove_instrument(steps)
            out.update(reads=reads["head_of"], pulls=d.stats["sync_pulls"] - pulls0, peers=peers,
                       wakeups={k: v / len(names) / IDLE_S for k, v in steps.counts.items()})
            # a CLI command appends from its own connection: still announced at once
            signer = Signer.from_seed(cluster.c.seeds["n0"])
            with Ledger.open(cluster.c.homes["n0"].ledger_db) as cli_handle:
                seq = cli_handle.append(signer, "metrics", {"idle": True}).seq
            t0 = trio.current_time()
            pid = cluster.peer_ids["n0"]
            with trio.move_on_after(30):
                while min([(await cluster.heads(n)).get(pid, 0) for n in names]) < seq:
                    await trio.sleep(0.05)
            out["spread_s"] = trio.current_time() - t0

    simulate(main, seed=5)
    intervals = IDLE_S / SYNC_S
    assert out["peers"] == 5
    # one read per recheck (plus a tick's slack), where reading on every poll tick made 240
    assert out["reads"] <= IDLE_S / LEDGER_RECHECK_S + 2, out
    # at most SYNC_FANOUT pulls per interval, where pulling from every peer made 5 per
    # interval; and quiet pulls space out to SYNC_IDLE_FACTOR intervals (at a
    # pull per interval, 12 here), yet never stop
    assert SYNC_FANOUT < 5 and 1 <= out["pulls"] <= intervals * SYNC_FANOUT / SYNC_IDLE_FACTOR + 2, out
    # an idle announce loop polls every IDLE_POLL_S, not every POLL_S
    assert out["spread_s"] < IDLE_POLL_S + 4 * POLL_S, out
    # wakeups (task steps) per second of each daemon's own loops; polling made
    # over 4, about 2 and 1
    w = out["wakeups"]
    assert w["announce_loop"] <= 1.5 / IDLE_POLL_S, w  # a tick a second, a few more at ledger re-reads
    assert w["discovery_loop"] <= 3 / IDLE_TICK_S, w  # a round is a step or two
    assert w["fetch_loop"] <= 0.1, w


LOOPS = ("announce_loop", "discovery_loop", "fetch_loop")


class _StepCounter(trio.abc.Instrument):
    """Counts the task steps (wakeups) of tasks whose name ends with one of `names`."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.counts = dict.fromkeys(names, 0)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        for n in self.names:
            if task.name.endswith(n):
                self.counts[n] += 1
