"""Restart benchmark: `atd local down && atd local up`, `--cycles` times (default 20),
on a local consortium of `--nodes` daemons (default 3), through the library calls behind those
commands (`atdnode.node.localnet.down` / `up`).

    python bench/restart_bench.py [--nodes 3] [--cycles 20] [--baseline-cycles 3]

A cycle succeeds when `up` returns (every daemon connected to every other one, all ledgers
agreeing) with every node running, connected to the N-1 others, on addresses none of which it
had in the cycle before (each start takes a new port: the members' old `hello`s are stale).
A failed cycle records its error and the next cycle runs `down` first, as a user would.

Baseline, same run: the same cycle on a one-node consortium (one daemon's start and stop, no
connections). `ratio` = an N-node cycle / a one-node cycle. A daemon's start is ~1.2 s of one
core (importing py-libp2p alone ~0.8 s of it): started one after another N daemons take about N
times one; side by side (what `up` does) about N / free cores, plus the time they take to find
each other (introduction, new `hello`s, dials) and to agree on the ledger, which a one-node
cycle does not have. Other processes on the host (`load`) stretch the N-node cycle most.

Prints one JSON object: nodes, cycles, successes, failures (cycle, error), cycle_s / up_s /
down_s {p50, max}, baseline_cycle_s {p50, max}, ratio (p50 / baseline p50), cpus, load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from atdnode.node import localnet
from atdnode.errors import AtdError


def _summary(xs: list[float]) -> dict:
    return {"p50": round(statistics.median(xs), 2), "max": round(max(xs), 2)} if xs else {"p50": None, "max": None}


def _check(nodes: list[localnet.NodeState], before: dict[str, set[str]], n: int) -> str | None:
    for s in nodes:
        if not s.running or len(s.peers) != n - 1:
            return f"{s.name}: running={s.running}, {len(s.peers)} of {n - 1} peers"
        if set(s.addrs) & before.get(s.peer_id, set()):
            return f"{s.name} kept an old address {s.addrs}"
    return None


def run_cycles(root: Path, n: int, cycles: int) -> dict:
    """`up` once, then `cycles` times `down` + `up`, each checked; returns the timings."""
    nodes = localnet.up(root, n, extra_args=["--sync-interval=3"])
    before = {s.peer_id: set(s.addrs) for s in nodes}
    ups, downs, totals, failures = [], [], [], []
    for c in range(cycles):
        t0 = time.monotonic()
        localnet.down(root)
        t1 = time.monotonic()
        try:
            nodes = localnet.up(root)
            error = _check(nodes, before, n)
        except AtdError as exc:
            nodes, error = [], str(exc)
        t2 = time.monotonic()
        if error:
            failures.append({"cycle": c, "error": error})
        else:
            ups.append(t2 - t1)
            downs.append(t1 - t0)
            totals.append(t2 - t0)
        before = {s.peer_id: set(s.addrs) for s in nodes}
    localnet.down(root)
    return {"successes": cycles - len(failures), "failures": failures,
            "cycle_s": _summary(totals), "up_s": _summary(ups), "down_s": _summary(downs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--baseline-cycles", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="atd-restart-") as tmp:
        base = run_cycles(Path(tmp) / "one", 1, a.baseline_cycles)
        res = run_cycles(Path(tmp) / "many", a.nodes, a.cycles)
    p50, b50 = res["cycle_s"]["p50"], base["cycle_s"]["p50"]
    print(json.dumps({"nodes": a.nodes, "cycles": a.cycles, **res, "baseline_cycle_s": base["cycle_s"],
                      "baseline_successes": base["successes"],
                      "ratio": round(p50 / b50, 2) if p50 and b50 else None,
                      "cpus": os.cpu_count(), "load": round(os.getloadavg()[0], 1)}, indent=2))


if __name__ == "__main__":
    main()
