"""`atd rounds --weighting fedwavg --adversarial` on N daemons as OS processes.

Every node runs the same campaign; one node (its `atd rounds` and its daemon) is killed
with -9 right after it reported round 0, so round 1 goes on without it and names it;
restarted, it resumes from the ledger and takes part in round 2. Every node ends with the
bit-identical global model of every round it saw. 3 nodes x 3 rounds by default (the
acceptance-size 5 x 5 with ATD_ROUNDS_NODES=5 ATD_ROUNDS_ROUNDS=5 ATD_ROUNDS_GRACE=60; slower).
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from pathlib import Path

import pytest

from atdnode.aggregation import verify_entry
from atdnode.blobs import BlobStore
from atdnode.node import NodeHome, NodeIdentity
from ledger import Ledger
from tests.factories import make_consortium
from tests.atd_forkserver import forkserver
from tests.nodeprocs import _env, live_status, start_daemon, start_daemons, wait_until

pytestmark = pytest.mark.slow

N = int(os.environ.get("ATD_ROUNDS_NODES", "3"))
R = int(os.environ.get("ATD_ROUNDS_ROUNDS", "3"))
KILLED, KILL_ROUND = N - 1, R - 2  # the last node dies in the last-but-one round
DEADLINE = "150"  # generous: live members are waited for, a dead one is not
# how long a disconnected member is still waited for (each survivor waits it out once in round
# KILL_ROUND, and once more in round 0 when the killed node was the coordinator and its aggregate
# had not left): the restarted node must reconnect within it after the others' next local
# training (its daemon restarts in 1-4 s); 5 nodes on a loaded 2-core machine need ~60
GRACE = os.environ.get("ATD_ROUNDS_GRACE", "10")
ARGS = ["--rounds", str(R), "--weighting", "fedwavg", "--adversarial", "--pgd-steps", "2", "--img-size", "28",
        "--patch-size", "7", "--embed-dim", "32", "--depth", "1", "--heads", "2", "--batch-size", "32", "--lr", "3e-3",
        "--deadline", DEADLINE, "--absent-grace", GRACE, "--json"]


class Rounds:
    """A running `atd rounds` whose JSON lines (one per round) are collected."""

    def __init__(self, warm: list[str], home: Path, k: int) -> None:
        """`atd rounds` for node `k` forked from the warm interpreter `warm` (killing `proc`
        kills the command)."""
        self.err = open(home / "test-rounds.stderr", "ab")
        self.proc = subprocess.Popen([*warm, "rounds", "--home", str(home), "--data", f"digits?shard={k + 1}/{N}&limit={720 // N}",
                                      *ARGS], stdout=subprocess.PIPE, stderr=self.err, text=True, env=_env())
        self.lines: "queue.Queue[dict]" = queue.Queue()
        self.reports: list[dict] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def next(self, timeout: float) -> dict:
        try:
            rep = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no round report within {timeout}s") from None
        self.reports.append(rep)
        return rep

    def finish(self, timeout: float) -> list[dict]:
        self.proc.wait(timeout=timeout)
        assert self.proc.returncode == 0, self.proc.returncode
        while not self.lines.empty():
            self.reports.append(self.lines.get())
        return self.reports


def _aggregates(home: Path) -> dict[int, dict]:
    """Round aggregates in `home`'s ledger (read in-process: polled while the daemons run)."""
    with Ledger.open(home / "ledger.db") as led:
        return {e.body["round"]: {"id": e.id.hex(), "body": e.body} for e in led.query(kind="aggregate")
                if e.body.get("mode") == "round"}


def test_rounds_fedwavg_adversarial_on_daemons_with_kill_and_rejoin(tmp_path: Path) -> None:
    homes = [h.root for h in make_consortium(tmp_path, N)]
    # the `atd rounds` commands are forked from one interpreter that imported torch once
    # (tests/atd_forkserver.py); the daemons start meanwhile
    with forkserver(tmp_path, _env()) as warm:
        _kill_and_rejoin(warm, homes)


def _kill_and_rejoin(warm: list[str], homes: list[Path]) -> None:
    daemons, runs = {}, {}
    try:
        daemons = dict(enumerate(start_daemons(homes)))
        addr = daemons[0].addrs[0]
        wait_until(lambda: all(len(live_status(h)["peers"]) >= N - 1 for h in homes), 120, "a full mesh")
        runs = {k: Rounds(warm, h, k) for k, h in enumerate(homes)}
        for _ in range(KILL_ROUND):
            runs[KILLED].next(600)
        runs[KILLED].proc.kill()  # it is training round KILL_ROUND now
        runs[KILLED].proc.wait()
        daemons[KILLED].kill()
        # the others finish round KILL_ROUND without it (each reported it); the restarted node
        # rejoins after that: its daemon back inside a survivor's wait for round KILL_ROUND
        # would make it live there again, and waited for until the deadline (it resumes past
        # that round and never publishes for it)
        for k, r in runs.items():
            while k != KILLED and len(r.reports) <= KILL_ROUND:
                r.next(600)
        daemons[KILLED] = start_daemon(homes[KILLED], "--bootstrap", addr)
        wait_until(lambda: KILL_ROUND in _aggregates(homes[KILLED]), 120, "the restarted node to learn the round")
        before = runs[KILLED].reports
        runs[KILLED] = Rounds(warm, homes[KILLED], KILLED)
        reports = {k: r.finish(900) for k, r in runs.items()}
        reports[KILLED] = before + reports[KILLED]
        final = _aggregates(homes[0])
        assert sorted(final) == list(range(R))
        ids = [NodeIdentity.load(NodeHome.at(h)).peer_id for h in homes]
        assert final[KILL_ROUND]["body"]["missing"] == [ids[KILLED]]
        assert ids[KILLED] in final[R - 1]["body"]["participants"]  # it rejoined
        assert len(final[R - 1]["body"]["inputs"]) == N
        for k, reps in reports.items():  # every node holds the same global model of every round it ran
            assert reps, k
            for rep in reps:
                assert rep["blob"] == final[rep["round"]]["body"]["blob"], (k, rep["round"])
        assert {rep["round"] for rep in reports[KILLED]} == set(range(R)) - {KILL_ROUND}
        assert {rep["round"] for rep in reports[0]} == set(range(R))
        # any peer can verify each round (the `atd aggregate --verify` path, in-process: fast)
        store = BlobStore(homes[KILLED] / "blobs")
        with Ledger.open(homes[KILLED] / "ledger.db") as led:
            for r, e in final.items():
                assert verify_entry(led, store, led.get(e["id"])) == e["body"]["blob"]
    finally:
        for r in runs.values():
            if r.proc.poll() is None:
                r.proc.kill()
        for d in daemons.values():
            if d.alive():
                d.stop()
