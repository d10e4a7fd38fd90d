"""Daemon benchmarks, printing JSON.

gossip: N daemons (real libp2p: Noise + yamux + GossipSub, one process, loopback), a
    connected mesh; E entries of ~1 KB are appended round-robin and gossiped at once.
    Reports the delivery ratio (entries merged by the N-1 other ledgers / expected) and the
    p50 / p99 latency from append to merge in each other ledger (goal: p99 <
    100 ms for 5 daemons at 100 entries/s on a quiet 2-core machine), the append's own
    share (sign + durable store), the CPU seconds the process spent per entry (all 5
    daemons: they share one interpreter here) and the garbage collector's pauses meanwhile.
gossip --procs: the same, with each daemon in its own OS process, as deployed (`atd node
    start` runs one NodeDaemon per process): the parent builds the consortium, starts one
    child per home, connects them in a full mesh and gives them a common start time; each
    child appends its share of the entries on the shared schedule and records append and
    merge times on CLOCK_MONOTONIC (`time.monotonic()`, one clock for every process on the
    machine). CPU per entry sums the children's CPU over the measured window.
gossip --degree-compare D,DLO,DHI: the gossip benchmark twice in one run, with the deployed
    GossipSub mesh and with the given degrees and py-libp2p's own mesh upkeep (no
    small-consortium mode; e.g. 3,2,6 for py-libp2p's usual mesh shape); duplicate copies per entry,
    delivery and latency of both.
gossip --gate-compare: the gossip benchmark twice in one run, the daemons' membership
    filter on (as deployed: `Transport.set_peer_gate`, checked on every connection and
    every pubsub RPC in and out) and then off (the baseline), with the ratio of the p99s
    (with the filter p99 must stay < 100 ms on 5 daemons).
rss: a subprocess with two daemons (one holds a blob, the other fetches it); reports its
    peak RSS next to the blob size: memory must be bounded by buffers, not by blob size.

    python bench/daemon_bench.py [--nodes 5] [--entries 500] [--rate 100] [--blob-mb 350] [--no-rss] [--procs]
                                 [--gate-compare] [--degree-compare D,DLO,DHI]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atdnode.node import NodeDaemon, NodeHome, NodeIdentity, init_home  # noqa: E402
from ledger import Ledger  # noqa: E402


def consortium(root: Path, n: int) -> list[NodeHome]:
    homes = [NodeHome.at(root / f"n{i}") for i in range(n)]
    founder = init_home(homes[0], consortium="bench")
    with Ledger.open(homes[0].ledger_db) as led:
        genesis = led.query(kind="genesis")[0].id.hex()
        for h in homes[1:]:
            ident = init_home(h, join=genesis)
            led.admit(founder.signer, ident.public_key)
        raw = [e.to_bytes() for e in led.all_entries()]
    for h in homes[1:]:
        with Ledger.open(h.ledger_db) as led:
            led.merge(raw)
    return homes


async def gossip_bench(n: int, entries: int, rate: float, gate: bool = True,
                       degrees: tuple[int, int, int] | None = None) -> dict:
    """`gate=False`: the daemons' membership filter is taken out of the transports (baseline).
    `degrees`: GossipSub (D, D_low, D_high) of every daemon for this run, without the
    small-consortium mode (`atdnode.transport._libp2p.gossip_mesh`); None: as deployed."""
    from atdnode.transport._libp2p.pubsub import CoalescingPubsub

    with tempfile.TemporaryDirectory() as tmp:
        homes = consortium(Path(tmp), n)
        daemons = [NodeDaemon(h, sync_interval=3600, poll_interval=0.5, auto_fetch=False) for h in homes]
        sent: dict[bytes, float] = {}
        arrivals: list[list[float]] = [[] for _ in range(n)]
        for i, d in enumerate(daemons):
            d.merge_observers.append(
                lambda ids, i=i: arrivals[i].extend(time.perf_counter() - sent[x] for x in ids if x in sent))
        async with trio.open_nursery() as nursery:
            first = await nursery.start(daemons[0].run, ["/ip4/127.0.0.1/tcp/0"], [])
            for d in daemons[1:]:
                await nursery.start(d.run, ["/ip4/127.0.0.1/tcp/0"], [first[0]])
            # full mesh, then let gossipsub form its mesh before measuring
            for d in daemons[1:]:
                for other in daemons[1:]:
                    if other is not d:
                        await d.transport.connect(other.transport.addrs()[0])
            with trio.fail_after(30):
                while any(len(d.transport.topic_peers(d.topic)) < n - 1 for d in daemons):
                    await trio.sleep(0.05)
            for d in daemons:
                r = d.transport._pubsub.router
                if degrees is not None:  # and py-libp2p's own mesh upkeep (no small-consortium mode)
                    r.degree, r.degree_low, r.degree_high = degrees
                    r.adaptive_degree_low, r.adaptive_degree_high = degrees[1:]
                    r.small_consortium, r.adaptive_gossip_enabled = False, True
            used = [r.degree, r.degree_low, r.degree_high]
            if not gate:
                for d in daemons:
                    d.transport.set_peer_gate(None)
                    d.transport._pubsub.peer_gate = None
            await trio.sleep(2.0)  # gossipsub heartbeat builds the mesh
            pad = "x" * 900
            appends: list[float] = []
            pauses: list[float] = []
            gc_start = [0.0]

            def on_gc(phase: str, info: dict) -> None:
                if phase == "start":
                    gc_start[0] = time.perf_counter()
                else:
                    pauses.append(time.perf_counter() - gc_start[0])

            gc.callbacks.append(on_gc)
            dups0 = CoalescingPubsub.duplicates_dropped
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            for k in range(entries):
                d = daemons[k % n]
                body = {"k": k, "pad": pad}
                entry_t = time.perf_counter()
                e = await d.append("metrics", body)
                sent[e.id] = entry_t
                appends.append(time.perf_counter() - entry_t)
                await trio.sleep_until(trio.current_time() + max(0.0, (k + 1) / rate - (time.perf_counter() - t0)))
            expected = entries * (n - 1)
            with trio.move_on_after(30):
                while sum(len(a) for a in arrivals) < expected:
                    await trio.sleep(0.05)
            cpu = time.process_time() - cpu0
            dups = CoalescingPubsub.duplicates_dropped - dups0
            gc.callbacks.remove(on_gc)
            for d in daemons:
                d.stop()
        lat = sorted(x for a in arrivals for x in a)
        out = summary(n, entries, rate, len(e.to_bytes()), lat, appends, cpu)
        out.update({"gossip_degrees": used,
                    # copies of each entry every node received after the first (dropped unread)
                    "duplicates_per_entry": round(dups / entries, 2), "copies_per_entry": round(dups / entries + n - 1, 2)})
        out.update({"membership_filter": gate, "gc_pauses": len(pauses), "gc_pause_max_ms": round(1000 * max(pauses, default=0.0), 2),
                    "gc_pause_total_ms": round(1000 * sum(pauses), 1), "load_avg": [round(x, 2) for x in os.getloadavg()]})
        return out


def summary(n: int, entries: int, rate: float, entry_bytes: int, lat: list[float], appends: list[float],
            cpu: float) -> dict:
    """The gossip figures both modes report (`lat`: seconds from append to merge, per other node)."""
    lat, appends = sorted(lat), sorted(appends)
    expected = entries * (n - 1)
    return {
        "nodes": n, "entries": entries, "rate_per_s": rate, "entry_bytes": entry_bytes,
        "delivered": len(lat), "expected": expected, "delivery_ratio": round(len(lat) / expected, 4),
        "latency_p50_ms": round(1000 * statistics.median(lat), 2) if lat else None,
        "latency_p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 2) if lat else None,
        "goal_p99_ms": 100.0,
        "append_p50_ms": round(1000 * statistics.median(appends), 2) if appends else None,
        "append_p99_ms": round(1000 * appends[int(0.99 * (len(appends) - 1))], 2) if appends else None,
        "cpu_ms_per_entry": round(1000 * cpu / entries, 2),
    }


def gossip_procs(n: int, entries: int, rate: float) -> dict:
    """Each daemon in its own process (module doc); the parent only coordinates."""
    with tempfile.TemporaryDirectory() as tmp:
        homes = consortium(Path(tmp), n)
        children: list[subprocess.Popen] = []

        def start(i: int, bootstrap: list[str]) -> list[str]:
            child = subprocess.Popen(
                [sys.executable, __file__, "--proc-child", str(homes[i].root), "--index", str(i), "--nodes", str(n),
                 "--entries", str(entries), "--rate", str(rate), *(["--bootstrap", *bootstrap] if bootstrap else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            children.append(child)
            return _expect(child, "addrs")

        try:
            first = start(0, [])
            addrs = [first] + [start(i, [first[0]]) for i in range(1, n)]
            for c in children:  # full mesh, as the in-process mode
                _say(c, {"peers": [a[0] for a in addrs]})
            for c in children:
                _expect(c, "ready", timeout=60)
            time.sleep(2.0)  # gossipsub heartbeats build the mesh
            t0 = time.monotonic() + 0.5
            for c in children:
                _say(c, {"t0": t0})
            results = [_expect(c, "result", timeout=entries / rate + 90) for c in children]
            for c in children:
                _say(c, {"stop": True})
            for c in children:
                c.wait(timeout=30)
        finally:
            for c in children:
                if c.poll() is None:
                    c.kill()
    sent = {k: v for r in results for k, v in r["sent"].items()}
    lat = [t - sent[i] for r in results for i, t in r["arrived"].items() if i in sent]
    cpu = sum(r["cpu_s"] for r in results)
    out = summary(n, entries, rate, results[0]["entry_bytes"], lat, [a for r in results for a in r["appends"]], cpu)
    out.update({"mode": "procs", "cpu_ms_per_entry_per_daemon": [round(1000 * r["cpu_s"] / entries, 2) for r in results],
                "load_avg": [round(x, 2) for x in os.getloadavg()]})
    return out


def _say(child: subprocess.Popen, msg: dict) -> None:
    child.stdin.write(json.dumps(msg) + "\n")
    child.stdin.flush()


def _expect(child: subprocess.Popen, key: str, timeout: float = 60.0):
    """The next line the child prints that carries `key` (its value); raises if the child dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark child exited (rc {child.wait()}) before sending {key!r}")
        if line.startswith("{"):
            msg = json.loads(line)
            if key in msg:
                return msg[key]
    raise RuntimeError(f"benchmark child sent no {key!r} within {timeout:.0f} s")


def proc_child(home: str, index: int, n: int, entries: int, rate: float, bootstrap: list[str]) -> None:
    """One daemon of `--procs`: the parent talks to it by JSON lines on stdin / stdout."""
    async def main() -> None:
        d = NodeDaemon(NodeHome.at(Path(home)), sync_interval=3600, poll_interval=0.5, auto_fetch=False)
        lines = _lines(trio.lowlevel.FdStream(os.dup(0)))
        arrived: dict[str, float] = {}
        d.merge_observers.append(lambda ids: arrived.update((x.hex(), time.monotonic()) for x in ids))
        async with trio.open_nursery() as nursery:
            addrs = await nursery.start(d.run, ["/ip4/127.0.0.1/tcp/0"], bootstrap)
            _print({"addrs": addrs})
            peers = (await lines.__anext__())["peers"]
            for a in peers:
                if a not in addrs:
                    await d.transport.connect(a)
            with trio.fail_after(30):
                while len(d.transport.topic_peers(d.topic)) < n - 1:
                    await trio.sleep(0.05)
            _print({"ready": True})
            t0 = (await lines.__anext__())["t0"]
            mine = range(index, entries, n)
            expected = entries - len(mine)
            sent: dict[str, float] = {}
            appends: list[float] = []
            pad = "x" * 900
            before = set(arrived)
            cpu0 = time.process_time()
            for k in mine:
                await trio.sleep_until(trio.current_time() + max(0.0, t0 + k / rate - time.monotonic()))
                at = time.monotonic()
                e = await d.append("metrics", {"k": k, "pad": pad})
                sent[e.id.hex()] = at
                appends.append(time.monotonic() - at)
            with trio.move_on_after(30):
                while len(set(arrived) - before) < expected:
                    await trio.sleep(0.02)
            cpu = time.process_time() - cpu0
            new = {i: t for i, t in arrived.items() if i not in before}
            _print({"result": {"sent": sent, "arrived": new, "appends": appends, "cpu_s": cpu,
                               "entry_bytes": len(e.to_bytes())}})
            await lines.__anext__()  # stop: peers may still need this daemon to relay
            d.stop()

    import logging

    logging.basicConfig(level=logging.ERROR)
    trio.run(main)


async def _lines(stream):
    """JSON messages, one per line, from an async byte stream."""
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        yield json.loads(line)


def _print(msg: dict) -> None:
    print(json.dumps(msg), flush=True)


def rss_child(blob_mb: int) -> None:
    """Run in a subprocess: two daemons, one fetches a blob_mb blob from the other."""
    async def main() -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            homes = consortium(Path(tmp), 2)
            src = Path(tmp) / "blob.bin"
            with open(src, "wb") as f:
                chunk = os.urandom(1 << 20)
                for _ in range(blob_mb):
                    f.write(chunk)
            from atdnode.blobs import BlobStore

            blob = BlobStore(homes[0].blobs_dir).put_file(src)
            src.unlink()
            d0, d1 = (NodeDaemon(h, sync_interval=3600, auto_fetch=False) for h in homes)
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            async with trio.open_nursery() as nursery:
                a0 = await nursery.start(d0.run, ["/ip4/127.0.0.1/tcp/0"], [])
                await nursery.start(d1.run, ["/ip4/127.0.0.1/tcp/0"], [a0[0]])
                with trio.fail_after(30):
                    while not d1.transport.peers():
                        await trio.sleep(0.02)
                t = time.perf_counter()
                await d1.fetch(blob)
                secs = time.perf_counter() - t
                d0.stop()
                d1.stop()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return {"blob_mb": blob_mb, "fetch_s": round(secs, 3), "fetch_MBps": round(blob_mb * 1.048576 / secs, 1),
                    "rss_before_mb": round(base / 1024, 1), "peak_rss_mb": round(peak / 1024, 1),
                    "peak_rss_growth_mb": round((peak - base) / 1024, 1)}

    print(json.dumps(trio.run(main)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--entries", type=int, default=500)
    ap.add_argument("--rate", type=float, default=100.0, help="entries appended per second (all nodes together)")
    ap.add_argument("--blob-mb", type=int, default=350)
    ap.add_argument("--no-rss", action="store_true", help="gossip latency only")
    ap.add_argument("--procs", action="store_true", help="gossip with each daemon in its own OS process")
    ap.add_argument("--gate-compare", action="store_true", help="gossip with and without the membership filter")
    ap.add_argument("--degree-compare", metavar="D,DLO,DHI", help="gossip with the deployed mesh degrees, then these")
    ap.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--proc-child", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args.blob_mb)
        return
    if args.proc_child:
        proc_child(args.proc_child, args.index, args.nodes, args.entries, args.rate, args.bootstrap)
        return
    import logging

    logging.basicConfig(level=logging.ERROR)
    if args.gate_compare:
        on = trio.run(gossip_bench, args.nodes, args.entries, args.rate, True)
        off = trio.run(gossip_bench, args.nodes, args.entries, args.rate, False)
        out = {"gossip_filtered": on, "gossip_unfiltered": off,
               "p99_ratio_filtered_over_unfiltered": round(on["latency_p99_ms"] / off["latency_p99_ms"], 3)
               if on["latency_p99_ms"] and off["latency_p99_ms"] else None}
    elif args.degree_compare:  # duplicates with the deployed mesh degrees, then the given ones (same run)
        base = trio.run(gossip_bench, args.nodes, args.entries, args.rate, True, None)
        other = trio.run(gossip_bench, args.nodes, args.entries, args.rate, True,
                         tuple(int(x) for x in args.degree_compare.split(",")))
        out = {"gossip_deployed_degrees": base, "gossip_given_degrees": other,
               "duplicates_ratio_given_over_deployed": round(other["duplicates_per_entry"] / base["duplicates_per_entry"], 3)
               if base["duplicates_per_entry"] else None}
    elif args.procs:
        out = {"gossip": gossip_procs(args.nodes, args.entries, args.rate)}
    else:
        out = {"gossip": trio.run(gossip_bench, args.nodes, args.entries, args.rate)}
    if args.no_rss:
        print(json.dumps(out, indent=2))
        return
    child = subprocess.run([sys.executable, __file__, "--rss-child", "--blob-mb", str(args.blob_mb)],
                           capture_output=True, text=True, check=True)
    out["rss"] = json.loads(child.stdout.strip().splitlines()[-1])
    out["rss"]["peak_over_blob"] = round(out["rss"]["peak_rss_growth_mb"] / args.blob_mb, 3)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
