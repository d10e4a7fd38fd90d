"""Benchmark: do learned ViT features beat raw pixels on `digits-jitter`, and does the margin
grow with the data ("a setting and recipe in which learning matters")?

The centralized probe behind `netsim/scenarios/jitter.toml`: one model of the scenario's
config (`[model]`, `[train]`) trained end to end (`netsim.learn.train_model`, the baselines'
trainer) on the whole training split of `digits-jitter?variants=K`, then the scenario's
VGS-ATD ensemble (`[ensemble]`: PCA -> MLP + RF + SVM, `protocols.vgs.fit_vertical_ensemble`)
fitted on

    learned     the trained model's pre-logits features;
    raw         the raw pixels                (`atdnode.aggregation.ensemble_refs`, ensemble-raw);
    untrained   an untrained extractor's features (ensemble-untrained);

all three measured in the same run, on the same split (the K variants of a source digit
share a split side: no test image re-renders a training digit). Prints one JSON object:
per K and seed, each accuracy, the end-to-end model's own accuracy, learned - raw and
learned - untrained in points, and the seconds each step took.

    nice -n 15 python bench/jitter_probe_bench.py --variants 1 3 --seeds 0
    nice -n 15 python bench/jitter_probe_bench.py --variants 3 --epochs 10 --embed-dim 64
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def probe(scn, k: int, seed: int, log) -> dict:
    import numpy as np

    from atdnode.data import load_dataset
    from atdnode.aggregation import fit_reference
    from atdnode.learning import extract_features
    from netsim.learn import model_config, predict, train_model
    from netsim.nodedata import _prepare
    from netsim.references import ensemble_options
    from protocols.vgs import fit_vertical_ensemble

    m = scn.model
    spec = f"digits-jitter?variants={k}"
    tr = _prepare(load_dataset(spec, m.img_size, m.in_chans, "train", seed=seed), None)
    te = _prepare(load_dataset(spec, m.img_size, m.in_chans, "test", seed=seed), None)
    y = te.labels.numpy()
    cfg = model_config(m, len(tr.classes))
    kw = {**replace(ensemble_options(scn), seed=seed).kwargs(), "prior": "none"}
    out = {"variants": k, "seed": seed, "train": len(tr), "test": len(te)}
    t0 = time.perf_counter()
    trained = train_model(cfg, tr, scn.train, seed=seed)
    out["train_s"] = round(time.perf_counter() - t0, 1)
    out["end_to_end"] = round(float((predict(trained.model, te.images) == y).mean()), 4)
    t0 = time.perf_counter()
    Xtr, _ = extract_features(trained.model, tr)
    Xte, _ = extract_features(trained.model, te)
    ens, _ = fit_vertical_ensemble([(Xtr, tr.labels.numpy(), list(tr.classes))], own=0, **kw)
    out["learned"] = round(float((ens.predict(Xte) == y).mean()), 4)
    for kind in ("ensemble-raw", "ensemble-untrained"):
        ref = fit_reference(kind, [tr], cfg, **kw)
        out[kind.split("-")[1]] = round(float((ref.predict(te.images) == y).mean()), 4)
    out["ensembles_s"] = round(time.perf_counter() - t0, 1)
    out["learned_minus_raw"] = round(100 * (out["learned"] - out["raw"]), 1)
    out["learned_minus_untrained"] = round(100 * (out["learned"] - out["untrained"]), 1)
    log(json.dumps(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="jitter", help="a shipped scenario name or a TOML path ([model], [train], [ensemble])")
    ap.add_argument("--variants", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--epochs", type=int, help="override [train] epochs")
    ap.add_argument("--lr", type=float, help="override [train] lr")
    ap.add_argument("--embed-dim", type=int, help="override [model] embed_dim")
    ap.add_argument("--depth", type=int, help="override [model] depth")
    ap.add_argument("--heads", type=int, help="override [model] num_heads")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from netsim.scenario import load_scenario, shipped_scenario

    torch.set_num_threads(args.threads)
    path = Path(args.scenario) if args.scenario.endswith(".toml") else shipped_scenario(args.scenario)
    scn = load_scenario(path)
    train = {k: v for k, v in (("epochs", args.epochs), ("lr", args.lr)) if v is not None}
    model = {k: v for k, v in (("embed_dim", args.embed_dim), ("depth", args.depth), ("num_heads", args.heads))
             if v is not None}
    scn = scn.replace(train=replace(scn.train, **train), model=replace(scn.model, **model))
    t0 = time.perf_counter()
    runs = [probe(scn, k, s, lambda line: print(line, file=sys.stderr, flush=True))
            for k in args.variants for s in args.seeds]
    m, t = scn.model, scn.train
    print(json.dumps({"bench": "jitter_probe", "scenario": str(path.name),
                      "model": {"embed_dim": m.embed_dim, "depth": m.depth, "heads": m.num_heads, "img_size": m.img_size,
                                "patch_size": m.patch_size},
                      "train": {"epochs": t.epochs, "lr": t.lr, "batch_size": t.batch_size, "augment": t.augment},
                      "runs": runs, "wall_s": round(time.perf_counter() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
