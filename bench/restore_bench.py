"""Restore benchmark: a node's own chain of `--mb` MB (default 100) pulled
back into a fresh home (genesis only, the state after `atd key import`) from a member.

    python bench/restore_bench.py [--mb 100] [--entry-kb 500]

The member's ledger holds the founder's genesis and admission and the node's chain of
entries of `entry-kb` KB. The restore is the daemon's own path: one `atdnode.replication.sync.pull`
over the in-memory transport (`serve_sync` on the member, `LedgerAccess(own=node key)` on
the fresh home, so no quota or waiting cap holds the own chain back), then
`own_chain.confirms` on the end marker. Baseline, same run: `Ledger.merge` of the same
entries into another fresh ledger, no network (what the restore cannot beat).

Prints one JSON object: restore_s, baseline_merge_s, ratio (restore / baseline), MB/s,
entries, whether one pull confirmed the head, and no fork (frozen authors, evidence rows).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import trio

from atdnode.replication import SYNC_PROTOCOL, LedgerAccess, pull, serve_sync
from atdnode.replication.own_chain import confirms
from atdnode.transport import MemoryNetwork, MemoryTransport
from ledger import Ledger, Signer


def build_member(path: Path, mb: int, entry_kb: int) -> tuple[Ledger, Signer, int]:
    founder, node = Signer.generate(), Signer.generate()
    led = Ledger.open(path)
    led.create_genesis(founder, "bench")
    led.admit(founder, node.public_key)
    n = max(1, (mb << 20) // (entry_kb * 1000))
    for i in range(n):
        led.append(node, "weights", {"i": i, "pad": os.urandom(entry_kb * 1000)})
    return led, node, n


def restore(member: Ledger, node: Signer, fresh: Ledger) -> tuple[float, object]:
    net = MemoryNetwork(seed=0)
    server, client = MemoryTransport(net, os.urandom(32)), MemoryTransport(net, node.seed)
    sa, ca = LedgerAccess(member), LedgerAccess(fresh, own=node.public_key)
    server.set_stream_handler(SYNC_PROTOCOL, lambda s: serve_sync(s, sa))

    async def main():
        async with server.run([]), client.run([]):
            await client.connect(server.addrs()[0])
            t0 = time.perf_counter()
            res = await pull(await client.open_stream(server.peer_id, SYNC_PROTOCOL), ca)
            return time.perf_counter() - t0, res

    return trio.run(main)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--entry-kb", type=int, default=500)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        t0 = time.perf_counter()
        member, node, n = build_member(d / "member.db", args.mb, args.entry_kb)
        t_build = time.perf_counter() - t0
        genesis = member.genesis_id
        fresh = Ledger.open(d / "fresh.db", genesis_id=genesis)
        fresh.merge(member.query(kind="genesis"))
        t_restore, res = restore(member, node, fresh)
        own_head = fresh.head_of(node.public_key)
        base = Ledger.open(d / "base.db", genesis_id=genesis)
        rows = member.raw_rows()
        t0 = time.perf_counter()
        base.merge(rows, members_only=True)
        t_base = time.perf_counter() - t0
        out = {
            "bench": "restore_own_chain",
            "chain_mb": round(sum(len(r) for r in rows) / 1e6, 1), "entries": n, "entry_kb": args.entry_kb,
            "restore_s": round(t_restore, 2), "baseline_merge_s": round(t_base, 2),
            "ratio": round(t_restore / t_base, 2), "restore_mb_per_s": round(args.mb / t_restore, 1),
            "own_head": own_head, "peer_said": res.yours, "confirmed_by_one_pull": confirms(own_head, res.yours),
            "frozen_authors": len(fresh.forks()), "evidence_rows": fresh.stats()["evidence"],
            "build_s": round(t_build, 1), "cpus": os.cpu_count(), "python": platform.python_version(),
        }
        for led in (member, fresh, base):
            led.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
