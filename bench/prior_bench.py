"""Which class-prior correction should the node ensemble use by default?

Setting (a chest X-ray shape, on the embedded digits): two classes (digits 0-4
"negative" vs 5-9 "positive"), three nodes with skewed class shares 40/60, 4/96 and 8/92
(200 / 250 / 250 samples), so the pooled training set is 84 % positive while node A's is
60 %; a balanced test split (100 per class); each node holds out a stratified 20 % of its
data as its validation split. The VGS-ATD ensemble (PCA -> MLP + RF + SVM) is fitted on
the pooled data of all three nodes (what vertical mode with every node's features fits)
on raw pixels (`ensemble-raw`, the cheap stand-in for features) with each prior, and on
each node's own data alone ("local"); scored on the node's validation split and on the
balanced test split. Prints JSON.

Why "balanced" is the default (`atdnode.aggregation.ensemble.DEFAULT_PRIOR`, netsim
`[ensemble] prior`; numbers in RESULTS.md): without a correction the pooled ensemble is
worse than the best-balanced node's own model on that node's validation data (collaboration
made it worse); "balanced" is the best on every node's balanced test split (a chest X-ray
setting has one official balanced test split, and netsim's node test sets hold every class
of the node) and beats that node's own model on its validation data too. "node" is best on
each node's own (skewed) validation data but falls far on balanced test data: choose it
only where the node will see its own training mix.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from atdnode.data import LabeledImages, load_dataset, without_val
from atdnode.aggregation import fit_reference
from atdnode.learning import resolve_config
from netsim.learn import score

SHARES = {"A": (0.40, 200), "B": (0.04, 250), "C": (0.08, 250)}  # negative share, samples
PRIORS = ("none", "balanced", "node")


def _subset(d: LabeledImages, idx: np.ndarray) -> LabeledImages:
    t = torch.as_tensor(idx, dtype=torch.int64)
    return LabeledImages(images=d.images[t], labels=d.labels[t], classes=list(d.classes))


def setting(seed: int) -> tuple[dict[str, tuple[LabeledImages, LabeledImages]], LabeledImages]:
    """Per node (train, val), and the balanced test split, two classes."""
    rng = np.random.default_rng(seed)
    full = load_dataset(without_val("digits"), 8, 1, "train", seed=seed)
    y = (full.labels.numpy() >= 5).astype(np.int64)
    data = LabeledImages(images=full.images, labels=torch.as_tensor(y), classes=["neg", "pos"])
    pools = {c: list(rng.permutation(np.flatnonzero(y == c))) for c in (0, 1)}
    test = np.concatenate([[pools[c].pop() for _ in range(100)] for c in (0, 1)])
    nodes = {}
    for name, (neg, n) in SHARES.items():
        k = max(2, round(neg * n))
        idx = {0: [pools[0].pop() for _ in range(k)], 1: [pools[1].pop() for _ in range(n - k)]}
        val = np.concatenate([v[:max(1, len(v) // 5)] for v in idx.values()])
        tr = np.concatenate([v[max(1, len(v) // 5):] for v in idx.values()])
        nodes[name] = (_subset(data, tr), _subset(data, val))
    return nodes, _subset(data, test)


def run(seed: int) -> dict:
    nodes, test = setting(seed)
    cfg = resolve_config("vit_base_patch16_gap_224", img_size=8, patch_size=4, embed_dim=32, depth=2,
                          num_heads=2, in_chans=1, num_classes=2)
    ens = dict(pca_components=16, mlp_max_iter=300, seed=seed)
    out: dict[str, dict] = {}
    names = list(nodes)
    for k, n in enumerate(names):
        own_val = nodes[n][1]
        row = {}
        for prior in PRIORS:
            ref = fit_reference("ensemble-raw", [nodes[m][0] for m in names], cfg, own=k, prior=prior, **ens)
            row[prior] = {s: score(d.labels.numpy(), ref.predict(d.images))["accuracy"]
                          for s, d in (("val", own_val), ("test", test))}
        local = fit_reference("ensemble-raw", [nodes[n][0]], cfg, **ens)
        row["local"] = {s: score(d.labels.numpy(), local.predict(d.images))["accuracy"]
                        for s, d in (("val", own_val), ("test", test))}
        out[n] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    runs = {s: run(s) for s in a.seeds}
    mean = {n: {m: {s: round(float(np.mean([runs[k][n][m][s] for k in runs])), 3) for s in ("val", "test")}
                for m in (*PRIORS, "local")} for n in SHARES}
    print(json.dumps({"seeds": a.seeds, "mean": mean, "runs": runs, "wall_s": round(time.perf_counter() - t0, 1)},
                     indent=1))


if __name__ == "__main__":
    main()
