"""`atd rounds` benchmark, printing JSON.

Per round on N daemons: seconds split into local training, publish+fetch (from publishing
until the round's inputs and global are here) and aggregation (computing or recomputing
the global model), and bytes per node.

--backend memory (default): N real NodeDaemons on netsim's in-memory network, each running
    `atdnode.rounds.runner.RoundRunner` (netsim.fat.run_rounds_memnet). Training and aggregation
    are measured compute seconds; publish+fetch is *simulated* network time (the scenario's
    default link: 5 ms, 100 Mbit/s); bytes are what each node's links carried (gossip,
    sync, blobs) plus the weight blobs it published / fetched.
--backend process: N daemons and N `atd rounds` OS processes on loopback; all wall clock;
    bytes from the daemons' transport counters.

Baseline in the same run: netsim's old in-process FedAvg loop (the server-style loop the
`fedavg` baseline was before it went through `atd rounds`; kept here only as the
comparison): the same nodes, data, model, rounds and local epochs; per round every node
trains in turn in one process (netsim.learn.train_model), the average is
protocols.aggregation.weighted_average by sample count, and the transfer is analytic
(full model down + up per node, time from the same link). Ratios: rounds / old loop.

    python bench/rounds_bench.py [--nodes 5] [--rounds 3] [--backend memory] [--adversarial]

--verify-cost: the cost of always verifying a round on adopt instead: on the
    tests' ViT sizes, N in-process homes train and publish one round; per round the
    coordinator computes and records the global (`RoundRunner.record`) and every other
    member recomputes it from the inputs (`verify_round`, what adoption now always runs,
    even when the global blob is held). Seconds per round, and ratios to recording and
    to one local training of the round in the same run.

    python bench/rounds_bench.py --verify-cost [--nodes 3] [--repeat 5]
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


def model_cfg(a):
    from atdnode.learning import ModelConfig

    return ModelConfig(name="vit_tiny_patch16_224", img_size=a.img_size, patch_size=7, embed_dim=a.embed_dim,
                       depth=a.depth, num_heads=2, in_chans=1, num_classes=10)


def node_data(a) -> tuple[dict, list[str]]:
    import numpy as np

    from atdnode.data import load_dataset, without_val
    from netsim.nodedata import subset

    tr = load_dataset(without_val("digits"), a.img_size, 1, "train")
    idx = np.random.default_rng(a.seed).permutation(len(tr))[: a.limit]
    return {f"n{k}": subset(tr, np.sort(idx[k::a.nodes]), tr.classes) for k in range(a.nodes)}, list(tr.classes)


def old_inprocess_fedavg(a, train: dict, classes: list[str]) -> dict:
    """netsim's former `fedavg` baseline loop, instrumented per round (the comparison only)."""
    import torch

    from atdnode.learning import build_model
    from netsim.baselines import transfer_s
    from netsim.learn import full_state, model_config, state_bytes, train_model
    from atdnode.learning import TrainOptions
    from netsim.scenario import NetworkSpec
    from protocols.aggregation import compute_weights, weighted_average

    cfg = model_config(model_cfg(a), len(classes))
    spec = TrainOptions(epochs=1, batch_size=32, lr=3e-3, augment=False)
    torch.manual_seed(a.seed)
    state = full_state(build_model(cfg))
    names = list(train)
    weights = compute_weights("samples", counts=[len(train[n]) for n in names])
    net = NetworkSpec()
    per_round = []
    for r in range(a.rounds):
        states, secs = [], []
        for k, n in enumerate(names):
            t = train_model(cfg, train[n], spec, seed=a.seed + 7919 * r + k, epochs=1, init=state, init_part="full",
                            warmup_epochs=0.0)
            states.append(full_state(t.model))
            secs.append(t.seconds)
        t0 = time.perf_counter()
        state = weighted_average([lambda s=s: s for s in states], weights)
        agg = time.perf_counter() - t0
        m = state_bytes(state)
        per_round.append({"round": r, "train_s": round(statistics.mean(secs), 3), "max_train_s": round(max(secs), 3),
                          "exchange_s": round(2 * transfer_s(net, m), 4), "aggregate_s": round(agg, 4),
                          "bytes_sent_per_node": m, "bytes_received_per_node": m})
    return {"per_round": per_round, "model_bytes": m}


def memory_rounds(a, train: dict, classes: list[str]) -> dict:
    from netsim.fat import pgd_config, run_rounds_memnet

    res = run_rounds_memnet(train, classes=classes, model=model_cfg(a), rounds=a.rounds, weighting=a.weighting,
                            adversarial=pgd_config(steps=2) if a.adversarial else None, local_epochs=1,
                            batch_size=32, lr=3e-3, seed=a.seed)
    rounds = res.per_round()
    link = {k: statistics.mean(b[k] for b in res.bytes.values()) for k in ("sent", "received")}
    for r in rounds:
        r.pop("weights"), r.pop("missing")
        r["link_bytes_sent_per_node"] = round(link["sent"] / a.rounds)  # the campaign's link bytes, per round
        r["link_bytes_received_per_node"] = round(link["received"] / a.rounds)
    return {"per_round": rounds, "identical_globals": res.identical, "sim_s": res.sim_s, "wall_s": res.wall_s,
            "exchange_clock": "simulated"}


def process_rounds(a) -> dict:
    from tests.factories import make_consortium
    from tests.nodeprocs import ATD, _env, start_daemon, status, wait_until

    args = ["--rounds", str(a.rounds), "--weighting", a.weighting, "--img-size", str(a.img_size), "--patch-size", "7",
            "--embed-dim", str(a.embed_dim), "--depth", str(a.depth), "--heads", "2", "--batch-size", "32",
            "--lr", "3e-3", "--seed", str(a.seed), "--deadline", "300", "--json"] \
        + (["--adversarial", "--pgd-steps", "2"] if a.adversarial else [])
    with tempfile.TemporaryDirectory(prefix="atd-rounds-bench-") as tmp:
        homes = [h.root for h in make_consortium(Path(tmp), a.nodes)]
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
                d.stop()
    per_round = []
    for r in range(a.rounds):
        reps = [rep for node in reports for rep in node if rep["round"] == r]
        per_round.append({"round": r, **{k: round(statistics.mean(x[k] for x in reps), 3)
                                         for k in ("train_s", "exchange_s", "aggregate_s")},
                          "weight_bytes_out": statistics.mean(x["bytes_out"] for x in reps),
                          "weight_bytes_in": statistics.mean(x["bytes_in"] for x in reps),
                          "identical": len({x["blob"] for x in reps}) == 1})
    return {"per_round": per_round, "wall_s": round(wall, 2), "exchange_clock": "wall",
            "note": "transport bytes: the daemons' libp2p counters (gossip, sync and blob-protocol streams); "
                    "blobs that went over the bulk channel are not in them (compare weight_bytes_in)",
            "transport_bytes_per_node": {"sent": statistics.mean(t["sent"] for t in traffic),
                                         "received": statistics.mean(t["received"] for t in traffic)}}


VERIFY_SIZES = {  # the tests' round models: tests/vgs_homes.py (test_rounds*), tests/test_rounds_procs.py
    "vgs_homes (img 16, patch 8, dim 32, depth 1)": dict(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2),
    "rounds_procs (img 28, patch 7, dim 32, depth 1)": dict(img_size=28, patch_size=7, embed_dim=32, depth=1,
                                                           num_heads=2),
}


def verify_cost(a) -> dict:
    """Seconds per round of `verify_round` (every adopter) vs `record` (the coordinator) and
    one local training; see the module doc."""
    from atdnode.learning import resolve_config
    from atdnode.rounds import verify_round
    from atdnode.rounds import active_members, round_weights_entries
    from atdnode.rounds import RoundRunner, RoundsConfig
    from atdnode.models import load_weights
    from ledger import Ledger
    from tests.vgs_homes import consortium, sync

    out = {}
    for name, size in VERIFY_SIZES.items():
        cfg = resolve_config("vit_tiny_patch16_224", **size)
        with tempfile.TemporaryDirectory(prefix="atd-verify-bench-") as tmp:
            homes = consortium(Path(tmp), [f"n{k}" for k in range(a.nodes)])
            runners = [RoundRunner(h, RoundsConfig(data=f"digits?shard={k + 1}/{a.nodes}&limit={a.limit}", cfg=cfg,
                                                   rounds=1, weighting=a.weighting, lr=3e-3, seed=a.seed))
                       for k, h in enumerate(homes)]
            train_s = []
            for r in runners:
                t = time.perf_counter()
                rec = r.train_round(0, r.init)
                train_s.append(time.perf_counter() - t)
                r.publish(0, rec)
            sync(homes)
            first = runners[0]
            with Ledger.open(homes[0].ledger_db) as led:
                inputs, expected = round_weights_entries(led, first.campaign, 0, first.init), active_members(led)
            t = time.perf_counter()
            agg = first.record(0, inputs, expected, first.init)
            record_s = time.perf_counter() - t
            sync(homes)
            verify_s = []
            for _ in range(a.repeat):
                for r in runners[1:]:
                    with Ledger.open(r.home.ledger_db) as led:
                        t = time.perf_counter()
                        assert verify_round(led, r.store, agg, r.init) == agg.body["blob"]
                        verify_s.append(time.perf_counter() - t)
            params = sum(v.numel() for v in load_weights(first.store, agg.body["blob"])[0].values())
        out[name] = {"params": int(params), "inputs": len(inputs),
                     "verify_s_per_round": round(statistics.median(verify_s), 4),
                     "verify_s_max": round(max(verify_s), 4), "record_s": round(record_s, 4),
                     "train_s_per_round": round(statistics.median(train_s), 3),
                     "ratio_verify_over_record": round(statistics.median(verify_s) / record_s, 3),
                     "ratio_verify_over_train": round(statistics.median(verify_s) / statistics.median(train_s), 4)}
    return out


def _mean(rounds: list[dict], k: str) -> float:
    return statistics.mean(r[k] for r in rounds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", choices=("memory", "process"), default="memory")
    ap.add_argument("--weighting", choices=("fedavg", "fedwavg"), default="fedavg")
    ap.add_argument("--adversarial", action="store_true")
    ap.add_argument("--img-size", type=int, default=28)
    ap.add_argument("--embed-dim", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--limit", type=int, default=720, help="digits samples over all nodes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify-cost", action="store_true", help="measure verify-on-adopt per round instead")
    ap.add_argument("--repeat", type=int, default=5, help="--verify-cost: verifications per member")
    a = ap.parse_args()
    if a.verify_cost:
        print(json.dumps({"bench": "rounds-verify-on-adopt", "nodes": a.nodes, "weighting": a.weighting,
                          "limit_per_node": a.limit, "sizes": verify_cost(a)}, indent=1))
        return
    train, classes = node_data(a)
    old = old_inprocess_fedavg(a, train, classes)
    new = memory_rounds(a, train, classes) if a.backend == "memory" else process_rounds(a)
    o, n = old["per_round"], new["per_round"]
    ratio = {k: round(_mean(n, k) / _mean(o, k), 3) if _mean(o, k) else None
             for k in ("train_s", "exchange_s", "aggregate_s")}
    print(json.dumps({"bench": "rounds", "backend": a.backend, "nodes": a.nodes, "rounds": a.rounds,
                      "weighting": a.weighting, "adversarial": a.adversarial, "limit": a.limit,
                      "model": {"img_size": a.img_size, "embed_dim": a.embed_dim, "depth": a.depth},
                      "atd_rounds": new, "old_inprocess_fedavg": old, "ratio_rounds_over_old": ratio}, indent=1))


if __name__ == "__main__":
    main()
