"""The gossip workload: nodes publish signed ledger entries; measure who ends with what.

Run against any back-end that offers the `faults.Cluster` calls plus `append`, `heads`
(peer id -> contiguous seq) and `node_bytes`:

1. start every node except late joiners, each dialing up to `degree` seeded earlier nodes,
   and wait (deadline) until every started node has a peer;
2. t0: publishers append `entries` entries between them (`metrics` kind, `entry_bytes` of
   padding each, `interval_s` apart) while the fault schedule runs;
3. wait (deadline `workload.deadline_s` after t0) until every node that is up at the end
   holds every *published* entry — an entry counts as published when its author is up
   at the end or when some node that is up holds it (a node killed before gossiping its
   last entries cannot be blamed on the others);
4. report per node: status, entries held / expected, when it had them all, bytes.
"""
from __future__ import annotations

import random
from bisect import bisect_right
from functools import partial
from dataclasses import dataclass, field
from typing import Any

import trio

from netsim.faults import FaultOutcome, pick_bootstrap, run_schedule
from netsim.scenario import Scenario, WorkloadSpec


@dataclass
class Published:
    author: str  # node name
    seq: int


@dataclass
class GossipReport:
    entries: int = 0
    converged: bool = False
    time_to_converge_s: float | None = None  # since t0 (simulated seconds on memnet)
    publish_s: float = 0.0
    nodes: dict[str, dict] = field(default_factory=dict)
    faults: list[FaultOutcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"entries": self.entries, "converged": self.converged,
                "time_to_converge_s": None if self.time_to_converge_s is None else round(self.time_to_converge_s, 3),
                "publish_s": round(self.publish_s, 3), "nodes": self.nodes,
                "faults": [f.to_dict() for f in self.faults], "notes": self.notes}


def late_joiners(scn: Scenario) -> set[str]:
    return {f.node for f in scn.faults if f.kind == "late_join"}


async def start_all(cluster: Any, names: list[str], *, seed: int, degree: int, deadline_s: float) -> list[str]:
    """Start `names` in order, each dialing seeded earlier nodes; wait until each has a peer.
    Returns the names that did not get a peer in time."""
    for n in names:
        await cluster.start(n, pick_bootstrap(cluster, n, degree, seed))
    lonely = [n for n in names if cluster.alive(n)]
    if len(names) < 2:
        return []
    with trio.move_on_after(deadline_s):
        while lonely:
            lonely = [n for n in lonely if not cluster.peers(n)]
            if lonely:
                await trio.sleep(0.05)
    return lonely


async def run_gossip(cluster: Any, scn: Scenario, *, log=lambda _m: None) -> GossipReport:
    wl: WorkloadSpec = scn.workload or WorkloadSpec()
    rep = GossipReport()
    names = cluster.names
    late = late_joiners(scn)
    first = [n for n in names if n not in late]
    lonely = await start_all(cluster, first, seed=scn.seed, degree=scn.topology.degree,
                             deadline_s=min(60.0, wl.deadline_s))
    if lonely:
        rep.notes.append(f"no peer within the start deadline: {', '.join(lonely)}")
    log(f"{len(first)} nodes up; publishing {wl.entries} entries")
    pubs = list(wl.publishers or names)
    published: list[Published] = []
    t0 = trio.current_time()
    rng = random.Random(f"{scn.seed}|payload")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(run_schedule, cluster, list(scn.faults), t0=t0, seed=scn.seed,
                                   degree=scn.topology.degree, outcomes=rep.faults))

        async def publisher(k: int, name: str) -> None:
            mine = [i for i in range(wl.entries) if i % len(pubs) == k]
            for j, i in enumerate(mine):
                if j:
                    await trio.sleep(wl.interval_s)
                if cluster.status.get(name) in ("left", "not started"):
                    continue  # a departed or not-yet-joined node publishes nothing
                pad = rng.randbytes(wl.entry_bytes)
                seq = await cluster.append(name, "metrics", {"netsim": i, "pad": pad})
                published.append(Published(name, seq))

        for k, name in enumerate(pubs):
            nursery.start_soon(publisher, k, name)
    rep.publish_s = trio.current_time() - t0
    rep.entries = len(published)
    log(f"published {len(published)} entries; waiting for every node to hold them")
    await _converge(cluster, rep, published, t0=t0, deadline=t0 + wl.deadline_s)
    return rep


def _held(heads: dict[str, int], seqs: dict[str, list[int]], pid: dict[str, str]) -> int:
    """How many of `seqs` (author -> ascending seqs) the node with `heads` holds: those at or
    below its contiguous head of each author (a bisection per author: the harness polls this
    for every node, and counting entry by entry was a fifth of a 300-daemon run's CPU)."""
    return sum(bisect_right(ss, heads.get(pid[a], 0)) for a, ss in seqs.items())


async def _converge(cluster: Any, rep: GossipReport, published: list[Published], *, t0: float, deadline: float) -> None:
    pid = cluster.peer_ids
    seqs: dict[str, list[int]] = {}
    for p in published:
        seqs.setdefault(p.author, []).append(p.seq)
    for ss in seqs.values():
        ss.sort()  # _held bisects
    done_at: dict[str, float] = {}
    heads: dict[str, dict[str, int]] = {}
    wanted = {pid[a] for a in seqs}  # only the publishers' heads matter here
    expected = 0
    last = {pid[a]: ss[-1] for a, ss in seqs.items() if ss}
    with trio.move_on_at(deadline):
        while True:
            up = [n for n in cluster.names if cluster.alive(n)]
            for n in up:
                if n not in done_at:  # re-read only the authors it does not hold all of yet
                    h = heads.setdefault(n, {})
                    need = [p for p in wanted if h.get(p, 0) < last.get(p, 0)]
                    if need:
                        h.update(await cluster.heads(n, authors=need))
            expected = _expected(cluster, seqs, heads, up, pid)
            for n in up:
                if n not in done_at and _held(heads[n], expected, pid) == _count(expected):
                    done_at[n] = trio.current_time() - t0
            if all(n in done_at for n in up) and await _confirm(cluster, seqs, heads, up, pid, wanted, done_at):
                break
            # reading every ledger is the harness's cost, not the nodes': with many nodes
            # poll less often (the convergence time is then known to within this step)
            await trio.sleep(max(0.05, len(cluster.names) / 2000))
    up = [n for n in cluster.names if cluster.alive(n)]
    expected = _expected(cluster, seqs, heads, up, pid)
    if hasattr(cluster, "refresh_all"):  # process back-end: read the daemons' byte counters now
        await cluster.refresh_all()
    total = _count(expected)
    for n in cluster.names:
        h = heads.get(n)
        if h is None or n not in up:
            try:
                h = await cluster.heads(n)
            except Exception as exc:  # a dead node's ledger may be unreadable mid-write
                h = {}
                rep.notes.append(f"{n}: ledger unreadable: {exc}")
        held = _held(h, expected, pid)
        rep.nodes[n] = {"status": cluster.status.get(n, "?"), "held": held, "expected": total,
                        "missing": total - held, "complete": held == total,
                        "complete_at_s": round(done_at[n], 3) if n in done_at else None,
                        "bytes": cluster.node_bytes(n)}
    rep.converged = bool(up) and all(n in done_at for n in up)
    rep.time_to_converge_s = max(done_at.values()) if rep.converged and done_at else None
    if not rep.converged:
        rep.notes.append("deadline passed before every live node held every published entry")


async def _confirm(cluster: Any, seqs: dict[str, list[int]], heads: dict[str, dict[str, int]], up: list[str],
                   pid: dict[str, str], wanted: set[str], done_at: dict[str, float]) -> bool:
    """Every live node looks complete from the heads read so far (each poll re-reads only the
    authors a node was still missing): read every publisher's head of every live node again
    and check once more. A node found short (its head went back) is not done after all."""
    for n in up:
        heads[n] = await cluster.heads(n, authors=wanted)
    expected = _expected(cluster, seqs, heads, up, pid)
    short = [n for n in up if _held(heads[n], expected, pid) != _count(expected)]
    for n in short:
        done_at.pop(n, None)
    return not short


def _count(expected: dict[str, list[int]]) -> int:
    return sum(len(v) for v in expected.values())


def _expected(cluster: Any, seqs: dict[str, list[int]], heads: dict[str, dict[str, int]], up: list[str],
              pid: dict[str, str]) -> dict[str, list[int]]:
    """Entries every live node should hold: all of live authors, and those of departed or
    dead authors that some live node holds (they got out before the author went away)."""
    out = {}
    for a, ss in seqs.items():
        if a in up:
            out[a] = ss
        else:
            best = max((heads.get(n, {}).get(pid[a], 0) for n in up), default=0)
            out[a] = [s for s in ss if s <= best]
    return out
