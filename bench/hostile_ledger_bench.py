"""A hostile member against a node's ledger: disk under a flood of invented kinds, and what
the body spec costs on merge.

    python bench/hostile_ledger_bench.py [--quick] [--entries 500] [--kb 200] [--kinds 100] [--n 2000]

Prints one JSON object:
  flood:  a member signs `entries` entries of `kb` KB over `kinds` invented kinds; a node
          merges them as it merges from the network (members only, quota, body spec), in
          gossip batches of 50. `growth_mb` is how much the node's ledger database grew
          (after a checkpoint), for: `no_quota` (nothing bounds it), `per_kind` (a window per
          kind, each invented kind its own: what a quota keyed by (author, kind) allowed),
          `budget` (this node's quota: unnamed kinds share one window, and one budget per
          author over all kinds, `[quota] author_bytes`). `budget_mb` the configured budget;
          `growth_to_budget` = budget growth / budget (<= 1 when bounded).
  merge:  `n` realistic entries (weights and round aggregates, every body fitting its spec)
          merged into a fresh ledger with the spec check (`check=atdnode.bodies.refusal`)
          and without it, best of 3, microseconds per entry -> `ratio` (with / without).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atdnode.bodies import refusal  # noqa: E402
from ledger import AuthorQuota, Entry, Ledger, Signer  # noqa: E402
from ledger.quota import DEFAULT_LIMITS  # noqa: E402

F = Signer.from_seed(b"F" * 32)
A = Signer.from_seed(b"A" * 32)
MB = 1 << 20


def founded(path: Path) -> Ledger:
    led = Ledger.open(path)
    led.create_genesis(F, "bench", members=[(A.public_key, False)])
    return led


def db_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def flood(tmp: Path, *, entries: int, kb: int, kinds: int) -> dict:
    src = founded(tmp / "src.db")
    pad = os.urandom(kb * 1000)
    rows = [e.to_bytes() for e in src.append_many(A, [(f"k{i % kinds}", {"pad": pad, "i": i}) for i in range(entries)])
            if isinstance(e, Entry)]
    genesis = src.raw_rows()[:1]  # (the genesis admits A)
    src.close()
    budget = AuthorQuota()
    per_kind = AuthorQuota({**DEFAULT_LIMITS, **{f"k{i}": DEFAULT_LIMITS["*"] for i in range(kinds)}},
                           author_entries=1 << 40, author_bytes=1 << 40)
    out = {"entries": entries, "entry_kb": kb, "kinds": kinds, "sent_mb": round(len(rows) * kb * 1000 / MB, 1),
           "budget_mb": round(budget.author_bytes / MB, 1), "growth_mb": {}}
    for name, quota in (("no_quota", None), ("per_kind", per_kind), ("budget", budget)):
        path = tmp / f"{name}.db"
        led = Ledger.open(path)
        led.merge(genesis)
        led.close()
        before = db_size(path)
        led = Ledger.open(path)
        for i in range(0, len(rows), 50):
            led.merge(rows[i:i + 50], members_only=True, quota=quota, check=refusal)
        led.close()  # the last connection checkpoints the WAL into the database
        out["growth_mb"][name] = round((db_size(path) - before) / MB, 1)
    out["growth_to_budget"] = round(out["growth_mb"]["budget"] / out["budget_mb"], 3)
    return out


def merge_cost(tmp: Path, n: int) -> dict:
    src = founded(tmp / "m.db")
    h = lambda i: f"{i:064x}"  # noqa: E731
    peers = ["12D3KooWQbb6k91VYokt5K45RdSVM4oyN3QhkCNwwfqy1L3DWbsz"] * 3
    weights = {"blob": h(1), "size": 123456, "manifest": h(2), "part": "full", "model": {"img_size": 28, "embed_dim": 64},
               "labels": [str(c) for c in range(10)], "label_fp": "fp", "samples": 500, "metrics": {"accuracy": 0.9},
               "provenance": [h(3)], "campaign": "c", "round": 1, "start": h(4), "readers": peers}
    agg = {"blob": h(5), "size": 123456, "manifest": h(6), "mode": "round", "weighting": "fedavg", "q": 1.0,
           "weights": [0.25] * 4, "inputs": [h(7 + i) for i in range(4)], "head": True, "part": "full",
           "campaign": "c", "round": 1, "reference": h(4), "participants": peers, "missing": [], "model": {}}
    rows = [e.to_bytes() for e in src.append_many(A, [("weights", weights) if i % 2 else ("aggregate", agg)
                                                      for i in range(n)])]
    genesis = src.raw_rows()[:1]  # (the genesis admits A)
    src.close()
    best: dict[str, float] = {}
    for rep in range(3):
        for name, check in (("without", None), ("with", refusal)):
            path = tmp / f"m{rep}{name}.db"
            led = Ledger.open(path)
            led.merge(genesis)
            t = time.perf_counter()
            res = led.merge(rows, members_only=True, check=check)
            dt = time.perf_counter() - t
            assert len(res.added) == n, (name, len(res.added), res.rejected[:1])
            led.close()
            best[name] = min(best.get(name, 1e9), dt / n * 1e6)
    return {"n": n, "us_per_entry_without": round(best["without"], 1), "us_per_entry_with": round(best["with"], 1),
            "ratio": round(best["with"] / best["without"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--entries", type=int, default=500)
    ap.add_argument("--kb", type=int, default=200)
    ap.add_argument("--kinds", type=int, default=100)
    ap.add_argument("--n", type=int, default=2000)
    a = ap.parse_args()
    if a.quick:
        a.entries, a.n = 150, 300
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print(json.dumps({"flood": flood(tmp, entries=a.entries, kb=a.kb, kinds=a.kinds),
                          "merge": merge_cost(tmp, a.n)}, indent=1))


if __name__ == "__main__":
    main()
