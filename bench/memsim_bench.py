"""In-memory back-end at scale; prints one JSON object.

A gossip scenario with churn and a partition, on simulated time (`netsim.memnet.simulate`;
the scenario is `netsim.memsim.churn_scenario`): N nodes (seeded bootstrap, degree 3, at
most `max_peers` dialled connections), 20 publishers appending 256-byte `metrics` entries
1 s apart, the network cut in two halves from t=2 s to t=8 s, and 10% of the nodes killed
at t=1..3 s and restarted at t=5..9 s. Every live ledger must end up holding every
published entry (`converged`).

Run for
  * `daemon`: full `NodeDaemon`s (SQLite ledger, blob store, sync, control socket -- the
    code `atd node start` runs), node homes on /dev/shm when it exists;
  * `lite`: gossip-only `LitePeer`s (netsim.litenode), chosen explicitly.

Both relay gossip over a GossipSub-style mesh (D, D_low, D_high = 3, 2, 6 from the default
`[peers]` target 8 / max 16; `MemoryTransport(mesh=...)`), not by flooding every connected
peer; what the mesh misses (the partition, the churned nodes) the ledger sync repairs.

Measured per run: simulated seconds, wall seconds and process CPU seconds, for the whole
run (start-up included) and for the workload alone (from the first publication to
convergence), and for `idle_after` (10 simulated seconds of the converged consortium
with nothing to publish: the periodic sync, poll and peer-set loops alone);
sim_s_per_wall_s and sim_s_per_cpu_s (on a machine shared with other jobs
CPU time is the fair measure: one process, one thread); sync pulls per node by the time
every node is up (both ends of each new connection pull) and by convergence. Baseline in the same run: the same scenario
with `--baseline` full daemons (default 100); `ratio_to_baseline` compares the CPU cost
per node per simulated second.

Memory per node. Every node holds the replicated ledger: O(N) entries in its SQLite file
(on /dev/shm, so outside the process's RSS: `ledger_file_per_node_mb`) and tables derived
from it that a real daemon holds too (members, heads, the dial policy of each member: a
few hundred bytes per member). The bench reports, each divided by N:
  * `memory_per_node_mb`: RSS growth from before the cluster was built to the peak (this
    includes allocator slack left by start-up's transient reads);
  * `held_memory_per_node_mb`: RSS growth after the idle period, measured after a full
    collection and a heap trim (`malloc_trim`): what the running nodes hold;
  * `sqlite_memory_per_node_mb`: SQLite's own allocation counter (page caches, schemas,
    statements; the simulated page cache is capped, `netsim.memnet.bound_page_cache`);
  * with a baseline of another size, `held_memory_model`: held memory per node as
    fixed + per_member x N, solved from the two sizes of the same run.

    python bench/memsim_bench.py [--daemons 1000] [--lite 1000] [--baseline 100] [--entries 100] [--seed 1]

Reproducible: every random choice (keys, link jitter, trio's scheduling order, each
daemon's dialer and periodic-sync order: `NodeDaemon(rng_seed=...)`) follows `--seed`, and
the bench re-runs itself with PYTHONHASHSEED=0 so set iteration order is fixed too; two
runs with one seed reach the same simulated times and pull counts (CPU times vary).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from netsim.memsim import churn_scenario  # noqa: E402

def _libc_call(lib: str, fn: str):
    try:
        return getattr(ctypes.CDLL(lib), fn)
    except (OSError, AttributeError):
        return None


def _trim() -> None:
    """Give free heap memory back to the OS (glibc), so RSS shows what is held."""
    trim = _libc_call("libc.so.6", "malloc_trim")
    if trim is not None:
        trim(0)


def _sqlite_used() -> int | None:
    """Bytes SQLite has allocated in this process (its own counter), or None."""
    used = _libc_call("libsqlite3.so.0", "sqlite3_memory_used")
    if used is None:
        return None
    used.restype = ctypes.c_int64
    return int(used())


def held_memory(proc: psutil.Process) -> dict:
    """RSS after a full collection and a heap trim: what the nodes hold, not allocator slack."""
    gc.collect()
    _trim()
    return {"rss": proc.memory_info().rss, "sqlite": _sqlite_used()}


def run_one(n: int, kind: str, entries: int, log=lambda _m: None, idle_s: float = 10.0, seed: int = 1) -> dict:
    from netsim.litenode import LiteCluster
    from netsim.memnet import MemCluster, simulate
    from netsim.workload import run_gossip

    s, churned = churn_scenario(n, kind, entries, seed=seed)
    t = s.topology
    proc = psutil.Process()
    gc.collect()
    _trim()
    rss0, sq0 = proc.memory_info().rss, _sqlite_used()
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="atd-memsim-", dir=shm if shm.is_dir() else None))
    marks: dict[str, tuple[float, float, float]] = {}
    peak = {"rss": rss0}
    sync_pulls: dict[str, int] = {}
    try:
        w0, c0 = time.perf_counter(), time.process_time()
        if kind == "lite":
            cluster = LiteCluster(s.node_names(), seed=s.seed, network=s.network, sync_interval=t.sync_interval_s,
                                  max_peers=t.max_peers)
        else:
            cluster = MemCluster(root, s.node_names(), seed=s.seed, network=s.network,
                                 sync_interval=t.sync_interval_s, poll_interval=t.poll_interval_s,
                                 max_peers=t.max_peers, established=True)
        setup = {"wall_s": round(time.perf_counter() - w0, 2), "cpu_s": round(time.process_time() - c0, 2)}

        def pulls() -> int:  # sync pulls done by the daemons running now
            return sum(d.stats["sync_pulls"] for d in getattr(cluster, "daemons", {}).values())

        def mark(msg: str) -> None:
            if "publishing" in msg and "publishing" not in marks:  # run_gossip: every first node is up
                marks["publishing"] = (trio.current_time(), time.perf_counter(), time.process_time())
                sync_pulls["start_up"] = pulls()
            peak["rss"] = max(peak["rss"], proc.memory_info().rss)
            log(f"[{kind} {n}] {msg}")

        async def main() -> dict:
            start = (trio.current_time(), time.perf_counter(), time.process_time())
            async with cluster.running():
                rep = await run_gossip(cluster, s, log=mark)
                peak["rss"] = max(peak["rss"], proc.memory_info().rss)
                end = (trio.current_time(), time.perf_counter(), time.process_time())
                sync_pulls["whole_run"] = pulls()
                await trio.sleep(idle_s)  # the converged consortium with nothing to say
                idle = (trio.current_time() - end[0], time.perf_counter() - end[1], time.process_time() - end[2])
                held = held_memory(proc)
            return {"rep": rep, "start": start, "end": end, "idle": idle, "held": held}

        r = simulate(main, seed=s.seed)
        ledger_mb = sum(f.stat().st_size for f in root.rglob("ledger*") if f.is_file()) / 2**20 / n
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rep = r["rep"]
    (s0, w0, c0), (s1, w1, c1) = r["start"], r["end"]
    sp, wp, cp = marks.get("publishing", r["start"])  # workload start (every first node up)
    live = [v for v in rep.nodes.values() if v["status"] == "running"]
    return {
        "nodes": n, "kind": kind, "entries": rep.entries, "converged": rep.converged,
        "live_nodes_complete": sum(v["complete"] for v in live), "live_nodes": len(live), "churned": churned,
        "faults_done": sum(f.status == "done" for f in rep.faults), "faults": len(rep.faults),
        "time_to_converge_sim_s": rep.time_to_converge_s,
        "setup": setup,
        "whole_run": {"sim_s": round(s1 - s0, 2), "wall_s": round(w1 - w0, 2), "cpu_s": round(c1 - c0, 2),
                      "sim_s_per_wall_s": round((s1 - s0) / (w1 - w0), 4),
                      "sim_s_per_cpu_s": round((s1 - s0) / max(1e-9, c1 - c0), 4)},
        "workload": {"sim_s": round(s1 - sp, 2), "wall_s": round(w1 - wp, 2), "cpu_s": round(c1 - cp, 2),
                     "sim_s_per_wall_s": round((s1 - sp) / (w1 - wp), 4),
                     "sim_s_per_cpu_s": round((s1 - sp) / max(1e-9, c1 - cp), 4)},
        "start_up": {"sim_s": round(sp - s0, 2), "wall_s": round(wp - w0, 2), "cpu_s": round(cp - c0, 2)},
        "idle_after": {"sim_s": round(r["idle"][0], 2), "wall_s": round(r["idle"][1], 2),
                       "cpu_s": round(r["idle"][2], 2),
                       "sim_s_per_wall_s": round(r["idle"][0] / max(1e-9, r["idle"][1]), 3),
                       "sim_s_per_cpu_s": round(r["idle"][0] / max(1e-9, r["idle"][2]), 3)},
        "cpu_ms_per_node_per_sim_s": round(1000 * (c1 - c0) / n / max(1e-9, s1 - s0), 3),
        "memory_per_node_mb": round((peak["rss"] - rss0) / 2**20 / n, 3),
        "held_memory_per_node_mb": round((r["held"]["rss"] - rss0) / 2**20 / n, 3),
        "sqlite_memory_per_node_mb": None if sq0 is None else round((r["held"]["sqlite"] - sq0) / 2**20 / n, 3),
        "ledger_file_per_node_mb": round(ledger_mb, 3),
        "sync_pulls_per_node": {k: round(v / n, 2) for k, v in sync_pulls.items()},  # full daemons only
        "peak_rss_mb": round(peak["rss"] / 2**20, 1),
        "notes": rep.notes[:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--daemons", type=int, default=1000)
    ap.add_argument("--lite", type=int, default=1000)
    ap.add_argument("--baseline", type=int, default=100, help="full daemons in the baseline run (0: none)")
    ap.add_argument("--entries", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1, help="scenario seed: keys, links, every node's choices")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":  # set iteration order too: a run is a function of --seed
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if a.verbose else (lambda _m: None)
    out: dict = {"seed": a.seed, "load_avg_before": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}
    for key, n, kind in (("baseline_daemons", a.baseline, "daemon"), ("lite", a.lite, "lite"),
                         ("daemons", a.daemons, "daemon")):
        if n:
            out[key] = run_one(n, kind, a.entries, log, seed=a.seed)
            log(json.dumps({key: out[key]}))  # each part as it finishes (the big one takes long)
    base = out.get("baseline_daemons")
    if base and "daemons" in out:
        out["ratio_to_baseline"] = {
            "cpu_per_node_per_sim_s": round(out["daemons"]["cpu_ms_per_node_per_sim_s"]
                                            / base["cpu_ms_per_node_per_sim_s"], 3),
            "memory_per_node": round(out["daemons"]["memory_per_node_mb"] / max(1e-9, base["memory_per_node_mb"]), 3),
            "held_memory_per_node": round(out["daemons"]["held_memory_per_node_mb"]
                                          / max(1e-9, base["held_memory_per_node_mb"]), 3)}
        # held memory per node = fixed + per_member * N, from the two sizes of this run
        dn = out["daemons"]["nodes"] - base["nodes"]
        if dn:
            per_member = (out["daemons"]["held_memory_per_node_mb"] - base["held_memory_per_node_mb"]) / dn
            out["held_memory_model"] = {
                "per_member_kib": round(per_member * 1024, 3),
                "fixed_mb": round(base["held_memory_per_node_mb"] - per_member * base["nodes"], 3)}
    if "lite" in out and "daemons" in out:
        out["daemon_vs_lite_cpu"] = round(out["daemons"]["cpu_ms_per_node_per_sim_s"]
                                          / out["lite"]["cpu_ms_per_node_per_sim_s"], 2)
    out["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    out["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
