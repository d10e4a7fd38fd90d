"""FedWAvg vs FedAvg in federated adversarial training on the paper's Non-IID(c) partitions.

Federated Adversarial Training with Transformers (Sec. 4): K = 5 clients, Non-IID(2) /
Non-IID(4) class partitions, local SGD momentum 0.9 with the rate decayed per epoch, PGD
(eps 8/255) on half of every batch, FedWAvg (Eq. 3) against FedAvg. Here at laptop scale
through `netsim.fat.run_rounds_memnet` (real daemons, `atd rounds`' loop): digits 28 px,
ViT d=64 depth 2, a shared initial model pretrained (clean, AdamW) on a public IID share.

Prints one JSON object: per seed and method the FedWAvg weights (min, max over every round
and client), the cosines, clean and PGD-7 robust test accuracy; the mean over seeds; the
IID control's weight deviation; and FedWAvg - FedAvg (the paper's claim is a robust gain).

    PYTHONPATH=$PWD python bench/fat_bench.py --iid        # tests/test_fat.py's setting
    PYTHONPATH=$PWD python bench/fat_bench.py --q 1 10 30 --per-client 0 --rounds 3 --lr 0.01
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from atdnode.data import load_dataset, without_val
from atdnode.learning import ModelConfig, TrainOptions
from netsim.fat import pgd_config, run_rounds_memnet
from netsim.learn import full_state, train_model
from netsim.nodedata import subset
from netsim.partition import _rng, iid, non_iid
from protocols.adversarial import robust_accuracy
from protocols.fedwavg import ROUNDS_Q, softmax_weights

MODEL = ModelConfig(name="vit_tiny_patch16_224", img_size=28, patch_size=7, embed_dim=64, depth=2, num_heads=4,
                    in_chans=1, num_classes=10)
PUBLIC = 720
K = 5


def pretrained(tr) -> tuple[dict, np.ndarray]:
    """The shared initial model (clean AdamW on a public IID share) and the private indices."""
    perm = _rng(0, "fat-public").permutation(len(tr))
    public, private = np.sort(perm[:PUBLIC]), np.sort(perm[PUBLIC:])
    pre = train_model(MODEL, subset(tr, public, tr.classes), TrainOptions(epochs=6, batch_size=16, lr=3e-3, augment=False),
                      seed=0, warmup_epochs=0.0)
    return full_state(pre.model), private


def capped(parts: list[np.ndarray], seed: int, n: int) -> list[np.ndarray]:
    """At most n samples per client (tests/test_fat.py's draw); n = 0: all."""
    return [np.sort(p[_rng(seed, f"fat-cap{k}").permutation(len(p))[:n]]) if n else p for k, p in enumerate(parts)]


def campaign(tr, parts, weighting: str, *, q: float, seed: int, rounds: int, init, lr: float, decay: float,
             adversarial: bool = True):
    train = {f"h{k}": subset(tr, p, tr.classes) for k, p in enumerate(parts)}
    return run_rounds_memnet(train, classes=list(tr.classes), model=MODEL, rounds=rounds, weighting=weighting, q=q,
                             adversarial=pgd_config(steps=2) if adversarial else None, batch_size=16, lr=lr,
                             seed=seed, init_state=init, optimizer="sgd", lr_decay=decay)


def deviation(run) -> float:
    return max(abs(w - 1 / len(x["weights"])) for x in run.per_round() for w in x["weights"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--per-client", type=int, default=100, help="cap on private samples per client (0: all)")
    ap.add_argument("--classes-per-node", type=int, default=2)
    ap.add_argument("--q", type=float, nargs="+", default=[ROUNDS_Q], help="FedWAvg scales to run")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--decay", type=float, default=0.05)
    ap.add_argument("--iid", action="store_true", help="also the IID control (FedWAvg weight deviation)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    tr, te = load_dataset(without_val("digits"), 28, 1, "train"), load_dataset("digits", 28, 1, "test")
    t0 = time.perf_counter()
    init, private = pretrained(tr)
    attack = pgd_config(steps=7)
    out: dict = {"setting": {"K": K, "non_iid": a.classes_per_node, "rounds": a.rounds, "lr": a.lr, "decay": a.decay,
                             "model": "vit d=64 depth 2, digits 28px", "train_pgd": "eps 8/255, 2 steps, ratio 0.5",
                             "eval_pgd": "eps 8/255, 7 steps"}, "runs": []}
    for seed in a.seeds:
        parts = capped(non_iid(private, tr.labels.numpy(), K, _rng(seed, "fat-noniid"),
                               classes_per_node=a.classes_per_node), seed, a.per_client)
        for w, q in [("fedavg", 1.0)] + [("fedwavg", q) for q in a.q]:
            r = campaign(tr, parts, w, q=q, seed=seed, rounds=a.rounds, init=init, lr=a.lr, decay=a.decay)
            s = robust_accuracy(r.model(), (te.images, te.labels), generator=torch.Generator().manual_seed(0),
                                **attack.attack_kwargs())
            ws = [v for x in r.per_round() for v in x["weights"]]
            row = {"seed": seed, "weighting": w, "q": q, "clean": s.clean, "robust": s.robust,
                   "weights_min": min(ws), "weights_max": max(ws), "max_dev_from_1/K": deviation(r),
                   "cosines": [x["cosines"] for x in r.per_round()]}
            if w == "fedwavg":  # what other scales would have given on round 0 (same cosines: same init)
                c0 = np.array(row["cosines"][0])
                row["round0_weights_at_q"] = {str(qq): [round(float(v), 4) for v in softmax_weights(c0, q=qq)]
                                              for qq in (1, 10, 30, 50, 100)}
            out["runs"].append(row)
            print(json.dumps(row), flush=True)
        if a.iid:
            ip = capped(iid(private, K, _rng(seed, "fat-iid")), seed, a.per_client)
            r = campaign(tr, ip, "fedwavg", q=a.q[0], seed=seed, rounds=a.rounds, init=init, lr=a.lr, decay=a.decay)
            out["runs"].append({"seed": seed, "weighting": "fedwavg-iid", "q": a.q[0], "max_dev_from_1/K": deviation(r),
                                "cosines": [x["cosines"] for x in r.per_round()]})
            print(json.dumps(out["runs"][-1]), flush=True)
    summary = {}
    for w in sorted({(r["weighting"], r["q"]) for r in out["runs"] if "clean" in r}):
        rows = [r for r in out["runs"] if (r["weighting"], r["q"]) == w]
        summary[f"{w[0]} q={w[1]:g}"] = {k: round(float(np.mean([r[k] for r in rows])), 4)
                                         for k in ("clean", "robust", "max_dev_from_1/K")}
    out["mean_over_seeds"] = summary
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
