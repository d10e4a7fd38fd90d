"""`atd rounds` benchmark (issue 17), printing JSON.

N daemons and N `atd rounds` processes (OS processes, loopback) run R rounds of FedWAvg
(optionally adversarial) on a tiny ViT over shards of digits. Per round and node it
reports wall seconds split into local training, publish+fetch (from publishing until the
round's inputs are here) and aggregation (recording or recomputing the global model), the
weight bytes the node published and fetched, and at the end each daemon's transport byte
counters (all traffic: gossip, sync, blobs). Baseline in the same run: the training time;
`overhead_ratio` = (publish+fetch + aggregation) / training, averaged over rounds and nodes.

    python bench/rounds_bench.py [--nodes 3] [--rounds 2] [--adversarial] [--img-size 28]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.nodeprocs import ATD, _env, start_daemon, wait_until  # noqa: E402
from tests.test_daemon_procs import _consortium as consortium, _status as status  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--adversarial", action="store_true")
    ap.add_argument("--img-size", type=int, default=28)
    ap.add_argument("--embed-dim", type=int, default=32)
    ap.add_argument("--limit", type=int, default=720, help="digits samples over all nodes")
    a = ap.parse_args()
    args = ["--rounds", str(a.rounds), "--weighting", "fedwavg", "--img-size", str(a.img_size), "--patch-size", "7",
            "--embed-dim", str(a.embed_dim), "--depth", "1", "--heads", "2", "--batch-size", "32", "--lr", "3e-3",
            "--deadline", "300", "--json"] + (["--adversarial", "--pgd-steps", "2"] if a.adversarial else [])
    with tempfile.TemporaryDirectory(prefix="atd-rounds-bench-") as tmp:
        homes = consortium(Path(tmp), a.nodes)
        daemons = [start_daemon(homes[0])]
        addr = status(homes[0])["addrs"][0]
        daemons += [start_daemon(h, "--bootstrap", addr) for h in homes[1:]]
        try:
            wait_until(lambda: all(status(h)["peers"] for h in homes), 120, "every daemon to have a peer")
            t0 = time.perf_counter()
            procs = [subprocess.Popen([*ATD, "rounds", "--home", str(h), "--data",
                                       f"digits?shard={k + 1}/{a.nodes}&limit={a.limit // a.nodes}", *args],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env())
                     for k, h in enumerate(homes)]
            reports = [[json.loads(line) for line in p.communicate()[0].splitlines() if line.startswith("{")]
                       for p in procs]
            wall = time.perf_counter() - t0
            traffic = [status(h)["bytes"] for h in homes]
        finally:
            for d in daemons:
                d.terminate()
    per_round = []
    for r in range(a.rounds):
        reps = [rep for node in reports for rep in node if rep["round"] == r]
        per_round.append({"round": r, **{k: round(statistics.mean(x[k] for x in reps), 3)
                                         for k in ("train_s", "exchange_s", "aggregate_s")},
                          "bytes_out_per_node": statistics.mean(x["bytes_out"] for x in reps),
                          "bytes_in_per_node": statistics.mean(x["bytes_in"] for x in reps),
                          "identical_globals": len({x["blob"] for x in reps}) == 1})
    train = sum(x["train_s"] for x in per_round)
    print(json.dumps({"bench": "rounds", "nodes": a.nodes, "rounds": a.rounds, "adversarial": a.adversarial,
                      "img_size": a.img_size, "wall_s": round(wall, 2), "per_round": per_round,
                      "transport_bytes_per_node": {"sent": statistics.mean(t["sent"] for t in traffic),
                                                   "received": statistics.mean(t["received"] for t in traffic)},
                      "overhead_ratio": round(sum(x["exchange_s"] + x["aggregate_s"] for x in per_round) / train, 3)},
                     indent=1))


if __name__ == "__main__":
    main()
