"""Robust round aggregators against FedAvg, printing JSON.

Campaigns of `atd rounds` among N real daemons on netsim's in-memory network
(`netsim.fat.run_rounds_memnet`, the RoundRunner loop of the CLI, each aggregator from
`protocols.rounds.AGGREGATORS` as `--aggregator` selects it), on IID shards of digits, per
seed and aggregator, from one shared initial model pretrained (clean, AdamW) on a public
IID share disjoint from the nodes' shards (as tests/test_fat.py: the rounds fine-tune), with
0 and with 1 hostile member (`netsim.hostile_rounds.ScaledRunner`:
its input is the round's reference x -1000, every round). Per campaign: the honest nodes'
final global model's test accuracy (chance 1/10) and the seconds per round the honest
nodes spent computing / recomputing the global (aggregate_s) and in all (train + exchange
+ aggregate). Baseline in the same run: FedAvg on the same shards and seed; ratios are
aggregator / FedAvg (accuracy difference in points, cost ratio per round).

Cost per round, measured apart (`cost`): campaign seconds move with the machine's load, so
the aggregation every member runs once per round (`atdnode.rounds.rules.compute_round`:
recording or verifying the global) is also timed on one set of five inputs per model size,
the rules interleaved and repeated, median seconds and the ratio to FedAvg's.

    python bench/robust_rounds_bench.py [--nodes 5] [--rounds 3] [--seeds 0,1,2]
        [--aggregators fedavg,median,trimmed-mean,krum,multi-krum]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def model_cfg(a, classes: list[str]):
    from atdnode.learning import ModelConfig

    return ModelConfig(name="vit_tiny_patch16_224", img_size=a.img_size, patch_size=a.patch_size,
                       embed_dim=a.embed_dim, depth=a.depth, num_heads=2, in_chans=1, num_classes=len(classes))


def campaign(a, train: dict, classes: list[str], te, rule: str, seed: int, hostile: bool, init: dict) -> dict:
    from atdnode.errors import AtdError
    from netsim.fat import run_rounds_memnet
    from netsim.hostile_rounds import ScaledRunner
    from netsim.learn import predict

    bad = {sorted(train)[-1]: ScaledRunner} if hostile else None
    try:
        res = run_rounds_memnet(train, classes=classes, model=model_cfg(a, classes), rounds=a.rounds, weighting=rule,
                                seed=seed, lr=a.lr, local_epochs=a.local_epochs, batch_size=16, hostile=bad,
                                init_state=init)
    except AtdError as exc:  # e.g. training from a global the attack made non-finite
        return {"error": str(exc)[:200]}
    pred = predict(res.model(), te.images)
    per = res.per_round()
    return {"accuracy": round(float((pred == te.labels.numpy()).mean()), 4), "identical": res.identical,
            "aggregate_s": statistics.mean(r["aggregate_s"] for r in per),
            "round_s": statistics.mean(r["train_s"] + r["exchange_s"] + r["aggregate_s"] for r in per),
            "missing": sorted({m for r in per for m in r["missing"]})}


COST_SIZES = {"bench": None, "vit_tiny_28px": dict(img_size=28, patch_size=7, num_classes=10)}


def cost(a, repeat: int) -> dict:
    """Median seconds of compute_round per rule on five trained inputs, and the ratio to FedAvg's."""
    import tempfile
    import time

    from atdnode.learning import resolve_config
    from atdnode.rounds import round_weights_entries
    from atdnode.rounds.rules import compute_round
    from atdnode.rounds import RoundRunner, RoundsConfig
    from ledger import Ledger
    from protocols.rounds import AGGREGATORS
    from tests.vgs_homes import consortium, sync

    out = {}
    for name, size in COST_SIZES.items():
        cfg = model_cfg(a, [str(c) for c in range(10)]) if size is None else resolve_config("vit_tiny_patch16_224", **size)
        with tempfile.TemporaryDirectory(prefix="atd-robust-bench-") as tmp:
            homes = consortium(Path(tmp), [f"n{k}" for k in range(a.nodes)])
            runners = [RoundRunner(h, RoundsConfig(data=f"digits?shard={k + 1}/{a.nodes}&limit={8 * a.nodes}", cfg=cfg,
                                                   rounds=1, weighting="fedavg", lr=3e-3))
                       for k, h in enumerate(homes)]
            for r in runners:
                r.publish(0, r.train_round(0, r.init))
            sync(homes)
            first = runners[0]
            with Ledger.open(homes[0].ledger_db) as led:
                inputs = round_weights_entries(led, first.campaign, 0, first.init)
            secs: dict[str, list[float]] = {rule: [] for rule in AGGREGATORS}
            for _ in range(repeat):
                for rule in AGGREGATORS:
                    t = time.perf_counter()
                    compute_round(first.store, inputs, weighting=rule, q=10.0, reference=first.init, byzantine=1)
                    secs[rule].append(time.perf_counter() - t)
            params = sum(p.numel() for p in __import__("atdnode.learning.model", fromlist=["build_model"])
                         .build_model(first.cfg).parameters())
        base = statistics.median(secs["fedavg"])
        out[name] = {"params": int(params), "inputs": len(inputs),
                     **{rule: {"s": round(statistics.median(v), 4),
                               "vs_fedavg": round(statistics.median(v) / base, 3)} for rule, v in secs.items()}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--aggregators", default="fedavg,median,trimmed-mean,krum,multi-krum")
    p.add_argument("--samples", type=int, default=100, help="training samples per node")
    p.add_argument("--public", type=int, default=600, help="samples the shared initial model is pretrained on")
    p.add_argument("--pretrain-epochs", type=int, default=6)
    p.add_argument("--img-size", type=int, default=16)
    p.add_argument("--patch-size", type=int, default=4)
    p.add_argument("--embed-dim", type=int, default=32)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--repeat", type=int, default=5, help="timings per rule in the cost section")
    p.add_argument("--cost-only", action="store_true", help="only the cost section")
    a = p.parse_args()
    if a.cost_only:
        print(json.dumps({"bench": "robust-rounds-cost", "cost": cost(a, a.repeat)}, indent=1))
        return

    import numpy as np
    import torch

    from atdnode.data import load_dataset, without_val
    from atdnode.learning import TrainOptions
    from netsim.learn import full_state, predict, train_model
    from netsim.nodedata import subset
    from netsim.partition import _rng, iid

    torch.set_num_threads(1)
    rules = a.aggregators.split(",")
    if rules[0] != "fedavg":
        rules = ["fedavg", *[r for r in rules if r != "fedavg"]]
    tr = load_dataset(without_val("digits"), a.img_size, 1, "train")
    te = load_dataset("digits", a.img_size, 1, "test")
    runs: dict[str, dict[str, list[dict]]] = {r: {"0": [], "1": []} for r in rules}
    initial: list[float] = []
    for seed in (int(s) for s in a.seeds.split(",")):
        perm = _rng(seed, "robust-bench").permutation(len(tr))
        public, private = np.sort(perm[:a.public]), np.sort(perm[a.public:a.public + a.nodes * a.samples])
        pre = train_model(model_cfg(a, list(tr.classes)), subset(tr, public, tr.classes),
                          TrainOptions(epochs=a.pretrain_epochs, batch_size=16, lr=3e-3, augment=False), seed=seed,
                          warmup_epochs=0.0)
        init = full_state(pre.model)
        init_acc = float((predict(pre.model.eval(), te.images) == te.labels.numpy()).mean())
        print(json.dumps({"progress": "initial model", "seed": seed, "accuracy": round(init_acc, 4)}), file=sys.stderr)
        initial.append(init_acc)
        parts = iid(private, a.nodes, _rng(seed, "robust-iid"))
        train = {f"n{k}": subset(tr, np.sort(pt), tr.classes) for k, pt in enumerate(parts)}
        for rule in rules:
            for hostile in (False, True):
                out = campaign(a, train, list(tr.classes), te, rule, seed, hostile, init)
                runs[rule][str(int(hostile))].append({"seed": seed, **out})
                print(json.dumps({"progress": rule, "seed": seed, "hostile": int(hostile), **out}), file=sys.stderr)

    def mean(rows: list[dict], key: str) -> float | None:
        vals = [r[key] for r in rows if key in r]
        return round(statistics.mean(vals), 4) if len(vals) == len(rows) and vals else None

    base = {h: runs["fedavg"][h] for h in ("0", "1")}
    summary = {}
    for rule in rules:
        s = {}
        for h in ("0", "1"):
            acc, b_acc = mean(runs[rule][h], "accuracy"), mean(base[h], "accuracy")
            s[f"hostile_{h}"] = {"accuracy_mean": acc,
                                 "accuracy_per_seed": [r.get("accuracy") for r in runs[rule][h]],
                                 "minus_fedavg_points": None if acc is None or b_acc is None else round(100 * (acc - b_acc), 2)}
        agg, b_agg = mean(runs[rule]["0"], "aggregate_s"), mean(base["0"], "aggregate_s")
        rnd, b_rnd = mean(runs[rule]["0"], "round_s"), mean(base["0"], "round_s")
        s["aggregate_s_per_round"] = agg
        s["aggregate_cost_vs_fedavg"] = round(agg / b_agg, 3) if agg and b_agg else None
        s["round_s"] = rnd
        s["round_cost_vs_fedavg"] = round(rnd / b_rnd, 3) if rnd and b_rnd else None
        summary[rule] = s
    print(json.dumps({"bench": "robust-rounds", "nodes": a.nodes, "rounds": a.rounds, "seeds": a.seeds,
                      "samples_per_node": a.samples, "model": {"img": a.img_size, "patch": a.patch_size,
                                                               "embed_dim": a.embed_dim, "depth": a.depth},
                      "local_epochs": a.local_epochs, "chance": 0.1,
                      "initial_model_accuracy": [round(x, 4) for x in initial], "attack": "1 of nodes sends reference x -1000",
                      "summary": summary, "cost": cost(a, a.repeat), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
