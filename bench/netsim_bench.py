"""netsim benchmarks; prints one JSON object.

(a) `procs`: 30 real `atd node start` daemons on 127.0.0.1 (the paper's 29 nodes and one
    more); every node publishes its share of 1,000 signed entries (256-byte bodies) as
    fast as its ledger takes them; measured: seconds from the first publication until
    every node holds all 1,000, the peak total RSS of the daemon processes and the peak
    RSS of the largest one (sampled every 0.25 s; PSS once at convergence, which counts
    shared libraries once), the connections each daemon holds (its bounded peer set,
    config.toml `[peers] target / max`; sampled every 2 s, every N/20 s for N
    daemons, and at the end), and the daemons' CPU seconds from the first publication to
    convergence (per entry received). Goal: < 60 s for 30 daemons. Baseline in the same
    run: the same 1,000 entries verified and merged into 30 ledgers by one process, no network
    (`merge_baseline_s`); the ratio says what the network layer costs on top of the
    ledger work. `--nodes 100` is the acceptance-size run (a daemon's start is mostly
    imports: libp2p pulls in aioquic, dns, pydantic, httpx, zeroconf...). The merge baseline
    is printed before it runs, so a run cut by its timeout there keeps its result. Numbers
    measured at 100: RESULTS.md.
(b) `memory`: the in-memory back-end with 1,000 gossip-only peers (real MemoryTransport
    gossip, signed entries verified on arrival, the real sync protocol) under a gossip
    workload (20 publishers, 1 entry/s each for 10 simulated seconds); measured:
    simulated seconds per wall second over the whole run (start-up included). Baseline in
    the same run: the same workload on 100 full node daemons (SQLite ledgers, hello and
    discovery loops) on the same back-end.

(c) `idle`: only the idle part of (a): `--nodes` daemons started and left alone; CPU per
    daemon over `--idle-s` s (`--trace`: per-task CPU and wakeups, `bench/wakeprof`).
    Goal: <= 0.3% of a core per daemon at 100 (numbers measured: RESULTS.md). What an idle
    daemon still does: rotation dials (a rotation prunes a peer, which re-dials when under
    target, `rotations_lost`) and the announce loop's 1 s tick. `counters_in_window`
    (sync pulls, dials, rotations by reason) says what the daemons did in the window.

    python bench/netsim_bench.py [procs] [memory] [idle] [--nodes 30] [--entries 1000] [--idle-s 30] [--peers 1000] [--daemons 100]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from netsim.scenario import scenario_from_dict  # noqa: E402


async def start_concurrently(cluster, names: list[str], *, seed: int, degree: int, width: int,
                             starts: list | None = None) -> None:
    """Start `names` with up to `width` daemons starting at once (each dials up to `degree`
    seeded daemons already listening); `start_all` then finds them started. One at a time,
    100 daemons took over 9 minutes to start on the shared 2-core machine at load 16-21
    (imports, ~6 s wall each); nothing measured depends on the start order. `starts` gets
    (wall s, daemon CPU s, load) at each daemon's readiness (its address printed)."""
    import random

    limiter = trio.CapacityLimiter(max(1, width))

    async def one(n: str) -> None:
        async with limiter:
            ready = [m for m in cluster.names if m != n and cluster.nodes[m].addr]
            rng = random.Random(f"{seed}|boot|{n}")
            t0 = time.perf_counter()
            await cluster.start(n, sorted(rng.sample(ready, min(degree, len(ready))), key=cluster.names.index))
            if starts is not None:
                cpu = daemon_cpu_of(cluster, n)
                starts.append((time.perf_counter() - t0, cpu, os.getloadavg()[0]))

    if names:
        await one(names[0])
    async with trio.open_nursery() as nursery:
        for n in names[1:]:
            nursery.start_soon(one, n)


def bench_procs(nodes: int, entries: int, target: int = 8, max_peers: int = 16, idle_s: float = 30.0,
                keep_logs: Path | None = None, start_width: int = 4) -> dict:
    from atdnode.node import NodeConfig
    from netsim.procnet import ProcCluster
    from netsim.workload import run_gossip, start_all

    scn = scenario_from_dict({
        "scenario": {"name": "bench-procs", "seed": 1, "backend": "process"},
        "topology": {"nodes": nodes, "degree": 3, "sync_interval_s": 10},
        "workload": {"entries": entries, "entry_bytes": 256, "interval_s": 0.0, "deadline_s": max(600, 12 * nodes)},
    })
    root = Path(tempfile.mkdtemp(prefix="atd-bench-"))
    # 100 daemons on a shared 2-core machine: a daemon's imports alone may take minutes of wall time
    cluster = ProcCluster(root, scn.node_names(), seed=scn.seed, network=scn.network, sync_interval=10,
                          ready_timeout=600)
    for home in cluster.c.homes.values():  # the bounded peer set every daemon keeps
        cfg = NodeConfig.load(home)
        cfg.extra["peers"] = {"target": target, "max": max_peers}
        cfg.save(home)
    peak = {"rss": 0, "procs": 0, "one": 0}
    conns: dict[str, int] = {}  # most connections seen per daemon
    loads: list[float] = []

    async def sample(stop: trio.Event) -> None:
        while not stop.is_set():
            total, n = 0, 0
            for node in cluster.nodes.values():
                p = node.proc
                if p is not None and p.returncode is None:
                    try:
                        proc = psutil.Process(p.pid)
                        # a daemon has no children unless it runs under `ip netns exec` (the
                        # children scan reads all of /proc: not 120 times a second for nothing)
                        kids = proc.children(recursive=True) if cluster.netns is not None else []
                        one = proc.memory_info().rss + sum(c.memory_info().rss for c in kids)
                        total += one
                        peak["one"] = max(peak["one"], one)
                        n += 1
                    except psutil.Error:
                        pass
            if total > peak["rss"]:
                peak.update(rss=total, procs=n)
            with trio.move_on_after(0.25):
                await stop.wait()

    async def sample_conns(stop: trio.Event) -> None:
        while not stop.is_set():
            loads.append(os.getloadavg()[0])
            for name in cluster.names:
                conns[name] = max(conns.get(name, 0), len(await cluster.apeers(name)))
            with trio.move_on_after(max(2.0, len(cluster.names) / 20)):  # 100 daemons: not 50 calls a second
                await stop.wait()

    def cpu_now() -> dict[str, float]:
        """CPU seconds (user + system) of each live daemon and of this driver process."""
        return {"driver": sum(psutil.Process().cpu_times()[:2]), **daemon_cpu(cluster)}

    marks: dict[str, dict[str, float]] = {}
    idle: dict = {}
    starts: list = []
    started_at = time.perf_counter()
    pss: list[int] = []

    def pss_now() -> list[int]:
        """Proportional set size of each live daemon (its share of shared pages counted once):
        RSS counts the ~30 MB of shared libraries every daemon maps in full."""
        out = []
        for node in cluster.nodes.values():
            if node.proc is not None and node.proc.returncode is None:
                try:
                    out.append(psutil.Process(node.proc.pid).memory_full_info().pss)
                except (psutil.Error, AttributeError):
                    pass
        return out

    def on_log(msg: str) -> None:
        if "publishing" in msg:  # run_gossip's t0: every daemon started
            marks["t0"] = cpu_now()
            print(json.dumps({"publishing_at_s": round(time.perf_counter() - started_at, 1),
                              "load": os.getloadavg()[0]}), file=sys.stderr, flush=True)

    async def run() -> dict:
        stop = trio.Event()
        async with cluster.running():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample, stop)
                nursery.start_soon(sample_conns, stop)
                await start_concurrently(cluster, cluster.names, seed=scn.seed, degree=scn.topology.degree,
                                         width=start_width, starts=starts)
                marks["start"] = start_summary(starts, nodes, started_at)
                print(json.dumps({"start": marks["start"]}), file=sys.stderr, flush=True)
                if idle_s > 0:  # every daemon up and idle: what idling costs (run_gossip finds them started)
                    await start_all(cluster, cluster.names, seed=scn.seed, degree=scn.topology.degree, deadline_s=60)
                    idle.update(await measure_idle(cluster, cpu_now, idle_s))
                    print(json.dumps({"idle": idle}), file=sys.stderr, flush=True)  # kept if the run times out
                rep = await run_gossip(cluster, scn, log=on_log)
                marks["end"] = cpu_now()
                pss.extend(pss_now())
                stop.set()
            final, stats = [], {}  # connections at the end, from `atd node status` (one that timed out is left out)
            for n in cluster.names:
                st = await cluster._status(n)
                if st is not None:
                    final.append(len(st["peers"]))
                    for k, v in status_counters(st):
                        stats[k] = stats.get(k, 0) + v
        d = rep.to_dict()
        d["final_conns"] = final
        d["daemon_stats"] = stats
        return d

    try:
        rep = trio.run(run)
    finally:  # scanned (and kept) even when the run fails or is interrupted (Ctrl-C, `timeout -s INT`)
        if "start" not in marks:
            print(json.dumps({"start": start_summary(starts, nodes, started_at)}), file=sys.stderr, flush=True)
        logs = scan_logs(root, keep_logs)
        if keep_logs is not None:
            print(json.dumps({"daemon_logs": logs}), file=sys.stderr, flush=True)
        shutil.rmtree(root, ignore_errors=True)
    conv = rep["time_to_converge_s"]
    # before the baseline: at 100 daemons it merged 1,000 entries into 100 ledgers for over a
    # minute at load 30, and a run cut there by its 10-minute timeout lost its result
    print(json.dumps({"gossip": {k: rep[k] for k in ("converged", "time_to_converge_s", "publish_s", "entries")}}),
          file=sys.stderr, flush=True)
    base = merge_baseline(nodes, entries)
    t0, end = marks.get("t0", {}), marks.get("end", {})
    cpu_total = sum(end[n] - t0[n] for n in end if n in t0 and n != "driver")
    received = entries * max(0, nodes - 1)  # each entry reaches every node but its author
    return {
        "daemons": nodes, "start": marks.get("start"), "entries": rep["entries"], "converged": rep["converged"],
        "seconds_until_every_node_holds_all": conv, "publish_s": rep["publish_s"],
        "peak_total_rss_mb": round(peak["rss"] / 2**20, 1),
        "rss_per_daemon_mb": round(peak["rss"] / 2**20 / max(1, peak["procs"]), 1),
        "peak_rss_largest_daemon_mb": round(peak["one"] / 2**20, 1),
        "pss_per_daemon_mb_at_convergence": round(sum(pss) / 2**20 / len(pss), 1) if pss else None,
        "peer_set": {"target": target, "max": max_peers},
        "idle_cpu_per_daemon": idle or None,  # % of one core, all daemons up and idle, before publishing
        "connections_per_daemon_end": {"daemons": len(rep["final_conns"]), "min": min(rep["final_conns"], default=None),
                                       "mean": round(sum(rep["final_conns"]) / max(1, len(rep["final_conns"])), 2),
                                       "max": max(rep["final_conns"], default=None)},
        "connections_per_daemon_peak_max": max(conns.values(), default=None),
        "goal_s": 60.0 if nodes <= 30 else None,
        "load_avg_during": {"min": round(min(loads), 2), "max": round(max(loads), 2)} if loads else None,
        # CPU from t0 (every daemon up) to convergence: where the seconds went
        "cpu_s_daemons_total": round(cpu_total, 1),
        "cpu_ms_per_entry_received": round(1000 * cpu_total / received, 2) if received else None,
        "cpu_s_driver": round(end.get("driver", 0.0) - t0.get("driver", 0.0), 1),
        "daemon_stats_total": rep["daemon_stats"],
        "merge_baseline_s": round(base, 3),
        "ratio_to_merge_baseline": round(conv / base, 2) if conv else None,
        "notes": rep["notes"],
        "daemon_logs": logs,
    }


LOG_SIGNS = {"bad_pubsub_rpc": "bad inbound pubsub RPC",  # a garbled RPC, reset instead of a crash
             "graft_flood": "GRAFT flood", "graft_in_backoff": "GRAFT: ignoring request", "traceback": "Traceback",
             "empty_mesh": "heartbeats: flood-relaying",  # atdnode/transport/_libp2p/gossip_mesh.py, per episode
             "mesh_refilled": "refilled after"}


def scan_logs(root: Path, keep: Path | None) -> dict:
    """Count WARNING/ERROR lines and the LOG_SIGNS in every daemon's stderr log under `root`
    (`netsim-daemon.log`: its log lines and anything a crash printed); with `keep`, copy the
    logs that hold any sign (or an ERROR) there before `root` is removed."""
    out = {k: 0 for k in ("warning_lines", "error_lines", *LOG_SIGNS)}
    kept = []
    for path in sorted(root.rglob("netsim-daemon.log")):
        text = path.read_text(errors="replace")
        out["warning_lines"] += text.count(" WARNING ")
        out["error_lines"] += text.count(" ERROR ")
        hits = {k: text.count(sign) for k, sign in LOG_SIGNS.items()}
        # a daemon still starting when the run is interrupted (Ctrl-C, `timeout -s INT`) prints
        # a KeyboardInterrupt traceback: the bench's doing, counted apart from real ones
        interrupted = len(re.findall(r"^KeyboardInterrupt\s*$", text, re.M))
        hits["traceback"] -= min(interrupted, hits["traceback"])
        out["interrupted_traceback"] = out.get("interrupted_traceback", 0) + interrupted
        # after the daemon logged its shutdown: py-libp2p prints tasks it had in flight that the
        # shutdown cancelled (e.g. "[ADDCONN_FAIL] ... Cancelled"), counted apart as well
        at_stop = text.partition("atd.daemon: shutting down")[2].count(LOG_SIGNS["traceback"])
        hits["traceback"] -= min(at_stop, hits["traceback"])
        out["traceback_after_shutdown"] = out.get("traceback_after_shutdown", 0) + at_stop
        for k, n in hits.items():
            out[k] += n
        if keep is not None and (any(hits.values()) or " ERROR " in text):
            keep.mkdir(parents=True, exist_ok=True)
            dest = keep / f"{path.parent.name}-{path.name}"
            shutil.copyfile(path, dest)
            kept.append(str(dest))
    out["kept"] = kept
    return out


def daemon_cpu_of(cluster, name: str) -> float | None:
    """CPU seconds (user + system) of one live daemon, None if it is not running."""
    p = cluster.nodes[name].proc
    try:
        return sum(psutil.Process(p.pid).cpu_times()[:2]) if p is not None and p.returncode is None else None
    except psutil.Error:
        return None


def start_summary(starts: list, nodes: int, t0: float) -> dict:
    """How long the daemons took to start: started count, wall to the last, per daemon the
    CPU s to readiness (imports, key, SQLite, libp2p host) and the wall s of each start."""
    cpus = sorted(c for _, c, _ in starts if c is not None)
    walls = sorted(w for w, _, _ in starts)
    med = (lambda xs: round(xs[len(xs) // 2], 2) if xs else None)
    return {"started": len(starts), "of": nodes, "wall_s": round(time.perf_counter() - t0, 1),
            "cpu_s_to_ready_median": med(cpus), "cpu_s_to_ready_max": round(max(cpus), 2) if cpus else None,
            "cpu_s_to_ready_total": round(sum(cpus), 1), "wall_s_per_start_median": med(walls),
            "load_at_ready": [round(starts[i][2], 1) for i in range(0, len(starts), max(1, len(starts) // 5))]}


def daemon_cpu(cluster) -> dict[str, float]:
    """CPU seconds (user + system) of each live daemon of a ProcCluster."""
    out = {}
    for name, node in cluster.nodes.items():
        if node.proc is not None and node.proc.returncode is None:
            try:
                out[name] = sum(psutil.Process(node.proc.pid).cpu_times()[:2])
            except psutil.Error:
                pass
    return out


async def measure_idle(cluster, cpu_now, idle_s: float, settle_s: float = 15.0, trace: Path | None = None) -> dict:
    """CPU of every daemon (% of one core) over `idle_s` s once all are up and `settle_s` s
    passed (discovery, hellos and on-connect pulls done). `trace`: the daemons run with
    `bench/wakeprof` (per-task CPU and wakeups); their counts over the window are summed."""
    await trio.sleep(settle_s)
    pids = [n.proc.pid for n in cluster.nodes.values() if n.proc is not None and n.proc.returncode is None]
    s0 = await daemon_counters(cluster)  # outside the window: a status call costs the daemon a ledger read
    if trace is not None:
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
    c0, w0 = cpu_now(), time.perf_counter()
    await trio.sleep(idle_s)
    c1, w1 = cpu_now(), time.perf_counter()
    pct = sorted(100 * (c1[n] - c0[n]) / (w1 - w0) for n in c1 if n in c0 and n != "driver")
    res = {"daemons": len(pct), "window_s": round(w1 - w0, 1), "load_avg": os.getloadavg()[0],
           "cpu_pct_mean": round(sum(pct) / max(1, len(pct)), 3),
           "cpu_pct_median": round(pct[len(pct) // 2], 3) if pct else None,
           "cpu_pct_max": round(max(pct, default=0.0), 3)}
    s1 = await daemon_counters(cluster)
    res["counters_in_window"] = {k: s1[k] - s0.get(k, 0) for k in sorted(s1)}  # all daemons, summed
    if trace is not None:
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        await trio.sleep(3)
        res["per_task"] = wakeup_table(trace, len(pids), w1 - w0)
    return res


async def daemon_counters(cluster) -> dict[str, int]:
    """The daemons' counters summed (`atd node status`: sync pulls, entries they added, connect
    pulls skipped, peer-set dials and prunes): what the daemons did in an idle window."""
    out: dict[str, int] = {}
    for n in cluster.names:
        st = await cluster._status(n)
        if st is None:
            continue
        for k, v in status_counters(st):
            out[k] = out.get(k, 0) + v
    return out


def status_counters(st: dict) -> list[tuple[str, int]]:
    """A daemon's counters from its `atd node status`: its stats and its peer-set dials and prunes."""
    items = [*st["stats"].items(), *((f"peer_set_{k}", st["peer_set"][k]) for k in ("dialled", "pruned"))]
    return [(k, v) for k, v in items if isinstance(v, int)]


def wakeup_table(trace: Path, daemons: int, window_s: float, top: int = 20) -> dict:
    """Sum the daemons' wakeprof files: per task, CPU (ms per s per daemon) and wakeups (per s per daemon)."""
    tasks: dict[str, list[float]] = {}
    proc = main = 0.0
    files = list(trace.glob("*.json"))
    for f in files:
        doc = json.loads(f.read_text())
        proc += doc["process_cpu_s"]
        main += doc["main_thread_cpu_s"]
        for name, t in doc["tasks"].items():
            key = name.split(" ")[0].rsplit("<locals>.", 1)[-1]
            acc = tasks.setdefault(key, [0.0, 0.0])
            acc[0] += t["cpu_s"]
            acc[1] += t["steps"]
    n, scale = max(1, len(files)), 1000.0 / max(1, len(files)) / window_s
    in_tasks = sum(v[0] for v in tasks.values())
    rows = sorted(tasks.items(), key=lambda kv: -kv[1][0])[:top]
    return {"daemons_traced": len(files),
            "process_cpu_ms_per_s": round(proc * scale, 3),
            "worker_threads_ms_per_s": round((proc - main) * scale, 3),
            "scheduler_ms_per_s": round((main - in_tasks) * scale, 3),
            "tasks_ms_per_s": round(in_tasks * scale, 3),
            "wakeups_per_s": round(sum(v[1] for v in tasks.values()) / n / window_s, 1),
            "top": {k: {"ms_per_s": round(v[0] * scale, 4), "steps_per_s": round(v[1] / n / window_s, 2)}
                    for k, v in rows}}


def bench_idle(nodes: int, idle_s: float, trace: bool = False, target: int = 8, max_peers: int = 16,
               rotate_s: float | None = None) -> dict:
    """Idle CPU only: `nodes` real daemons started and left alone (<= 0.3% of a core each at 100)."""
    from atdnode.node import NodeConfig
    from netsim.procnet import ProcCluster
    from netsim.workload import start_all

    scn = scenario_from_dict({"scenario": {"name": "bench-idle", "seed": 1, "backend": "process"},
                              "topology": {"nodes": nodes, "degree": 3, "sync_interval_s": 10}})
    root = Path(tempfile.mkdtemp(prefix="atd-bench-idle-"))
    trace_dir = None
    if trace:  # every daemon runs with bench/wakeprof (per-task CPU and wakeups)
        trace_dir = root / "wakeprof"
        trace_dir.mkdir()
        os.environ["ATD_WAKEPROF"] = str(trace_dir)
        os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parent / "wakeprof") + os.pathsep + os.environ.get("PYTHONPATH", "")
    cluster = ProcCluster(root, scn.node_names(), seed=scn.seed, network=scn.network, sync_interval=10,
                          ready_timeout=600)
    for home in cluster.c.homes.values():
        cfg = NodeConfig.load(home)
        cfg.extra["peers"] = {"target": target, "max": max_peers,
                              **({"rotate_s": rotate_s} if rotate_s is not None else {})}
        cfg.save(home)

    async def run() -> dict:
        async with cluster.running():
            t0 = time.perf_counter()
            lonely = await start_all(cluster, cluster.names, seed=scn.seed, degree=3, deadline_s=60)
            started = time.perf_counter() - t0
            res = await measure_idle(cluster, lambda: daemon_cpu(cluster), idle_s, trace=trace_dir)
            conns = [len(cluster.peers(n)) for n in cluster.names]
        return {**res, "start_s": round(started, 1), "lonely": lonely,
                "connections_mean": round(sum(conns) / max(1, len(conns)), 2)}

    try:
        return trio.run(run)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def merge_baseline(nodes: int, entries: int) -> float:
    """Verify + merge `entries` signed entries into `nodes` fresh ledgers in one process."""
    from ledger import Ledger, Signer
    from netsim.homes import node_seed

    root = Path(tempfile.mkdtemp(prefix="atd-bench-merge-"))
    signers = [Signer.from_seed(node_seed(9, f"n{i}")) for i in range(nodes)]
    dbs = [Ledger.open(root / f"p{i}.db") for i in range(nodes)]
    try:
        g = dbs[0].create_genesis(signers[0], "bench", [(s.public_key, False) for s in signers[1:]])
        for led in dbs[1:]:
            led.merge([g.to_bytes()])
        authors = [Ledger.open(root / f"a{i}.db") for i in range(nodes)]
        for led in authors:
            led.merge([g.to_bytes()])
        payload = os.urandom(256)
        raws = [authors[k % nodes].append(signers[k % nodes], "metrics", {"netsim": k, "pad": payload}).to_bytes()
                for k in range(entries)]
        for a in authors:
            a.close()
        t0 = time.perf_counter()
        for led in dbs:
            led.merge(raws)
        return time.perf_counter() - t0
    finally:
        for d in dbs:
            d.close()
        shutil.rmtree(root, ignore_errors=True)


def bench_memory(peers: int, daemons: int) -> dict:
    from netsim.litenode import LiteCluster
    from netsim.memnet import MemCluster, simulate
    from netsim.workload import run_gossip

    def scenario(n: int, kind: str):
        return scenario_from_dict({
            "scenario": {"name": f"bench-mem-{kind}", "seed": 1},
            "network": {"latency_ms": 20, "bandwidth_mbps": 100},
            "topology": {"nodes": n, "degree": 3, "max_peers": 6, "peers": kind, "sync_interval_s": 5},
            "workload": {"entries": 200, "entry_bytes": 256, "interval_s": 1.0, "deadline_s": 120,
                         "publishers": [f"n{i}" for i in range(0, n, max(1, n // 20))][:20]},
        })

    out = {}
    for n, kind in ((peers, "lite"), (daemons, "daemon")):
        s = scenario(n, kind)
        with tempfile.TemporaryDirectory(prefix="atd-bench-mem-") as d:
            t_setup = time.perf_counter()
            if kind == "lite":
                cluster = LiteCluster(s.node_names(), seed=s.seed, network=s.network, sync_interval=5, max_peers=6)
            else:
                cluster = MemCluster(Path(d), s.node_names(), seed=s.seed, network=s.network, sync_interval=5,
                                     poll_interval=0.1, max_peers=6)
            setup = time.perf_counter() - t_setup

            async def run() -> dict:
                t0, w0 = trio.current_time(), time.perf_counter()
                async with cluster.running():
                    rep = await run_gossip(cluster, s)
                return {"rep": rep, "sim": trio.current_time() - t0, "wall": time.perf_counter() - w0}

            r = simulate(run, seed=s.seed)
        rep = r["rep"]
        out[kind] = {"nodes": n, "entries": rep.entries, "converged": rep.converged,
                     "time_to_converge_sim_s": rep.time_to_converge_s, "simulated_s": round(r["sim"], 3),
                     "wall_s": round(r["wall"], 2), "setup_wall_s": round(setup, 2),
                     "sim_s_per_wall_s": round(r["sim"] / r["wall"], 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("parts", nargs="*", default=["procs", "memory"])
    ap.add_argument("--nodes", type=int, default=30)
    ap.add_argument("--entries", type=int, default=1000)
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--daemons", type=int, default=100)
    ap.add_argument("--target", type=int, default=8, help="procs: [peers] target of each daemon")
    ap.add_argument("--max-peers", type=int, default=16, help="procs: [peers] max of each daemon")
    ap.add_argument("--idle-s", type=float, default=30.0, help="procs: seconds of idle CPU measured before publishing (0: none)")
    ap.add_argument("--rotate-s", type=float, default=None, help="idle: [peers] rotate_s of each daemon")
    ap.add_argument("--keep-logs", type=Path, default=None,
                    help="procs: copy daemon logs with a garbled RPC, GRAFT flood, traceback or ERROR here")
    ap.add_argument("--trace", action="store_true", help="idle: per-task CPU and wakeups (bench/wakeprof)")
    ap.add_argument("--start-width", type=int, default=4, help="procs: daemons started at once")
    a = ap.parse_args()
    result: dict = {"load_avg_before": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}
    if "procs" in a.parts:
        result["procs"] = bench_procs(a.nodes, a.entries, a.target, a.max_peers, a.idle_s, a.keep_logs, a.start_width)
    if "idle" in a.parts:
        result["idle"] = bench_idle(a.nodes, a.idle_s, a.trace, a.target, a.max_peers, a.rotate_s)
    if "memory" in a.parts:
        result["memory"] = bench_memory(a.peers, a.daemons)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
