"""Benchmark: split-learning wire costs (pure, in-process; no network).

* ``codec`` -- tensor-frame encode + strict decode of one ViT-B/16 feature batch
  (``--batch`` x 197 x 768 float32) against the baseline of a bare copy out and back
  (``tobytes`` + ``frombuffer().copy()``): ratio = frame throughput / copy throughput.
* ``comm``  -- FESTA and p-FESTA on the same tiny digits setting (2 clients, 2 tasks):
  measured wire bytes per client vs the paper's formulas, and p-FESTA / FESTA.
* ``msd``   -- MSD's one round (`run_msd_inprocess`, 2 clients x 300 digits; one distillation
  step: the bytes do not depend on the steps): measured bytes per client vs MSD Eq. 9
  (T_MSD = DF + Pb) and Eq. 8 (T_FL-SSL = 4 R/r P) at the paper's Table VII schedule
  (R = 50, r = 1) and at this bench's FESTA schedule; ratio T_MSD / T_FL-SSL (paper: ~0.25).

    python bench/split_bench.py            # ~1 min on a small CPU
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from protocols import festa, pfesta
from protocols.comm_cost import MSD_TABLE7_FL_ROUNDS, CostParams, compare, msd_vs_fl_ssl, tensor_bytes
from protocols.msd import MSDConfig, run_msd_inprocess
from protocols.pfesta import permute_tokens, random_permutations
from protocols.split_parts import SPLIT_MODEL, TaskSpec, build_plain_embedder, digits_images, digits_targets
from protocols.tensor_frames import decode_frame, encode_frame


def _best(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_codec(batch: int, rounds: int) -> dict:
    x = torch.randn(batch, 197, 768)
    nbytes = x.numel() * 4
    t_frame = _best(lambda: decode_frame(encode_frame({"x": x}, {"kind": "forward"})), rounds)
    t_copy = _best(lambda: torch.from_numpy(np.frombuffer(x.numpy().tobytes(), dtype=np.float32).copy()), rounds)
    return {"bytes": nbytes, "frame_MBps": nbytes / t_frame / 1e6, "copy_MBps": nbytes / t_copy / 1e6,
            "ratio_frame_vs_copy": t_copy / t_frame}


def bench_comm(rounds: int, steps: int, n: int) -> dict:
    torch.set_num_threads(1)
    cfg = SPLIT_MODEL
    tasks = [TaskSpec("digit", "classification", 10), TaskSpec("ink", "segmentation", 1, 0.5)]
    x, y = digits_images(16)
    data = {cid: (t, x[lo:lo + 300], digits_targets(t, x[lo:lo + 300], y[lo:lo + 300], 4))
            for cid, t, lo in (("a", tasks[0], 0), ("c", tasks[1], 300))}
    test = {cid: (x[1400:], digits_targets(t, x[1400:], y[1400:], 4)) for cid, (t, _, _) in data.items()}
    setting = dict(rounds=rounds, steps_per_round=steps, unifying_rounds=n, test_data=test)
    t0 = time.perf_counter()
    f = festa.run_festa_inprocess(festa.FestaServer(cfg, tasks, lr=3e-3),
                                  [festa.FestaClient(c, cfg, t, xs, ys, seed=i)
                                   for i, (c, (t, xs, ys)) in enumerate(data.items())], **setting)
    t_f = time.perf_counter() - t0
    emb = build_plain_embedder(cfg)
    t0 = time.perf_counter()
    p = pfesta.run_pfesta_inprocess(pfesta.PFestaServer(cfg, tasks, lr=3e-3),
                                    [pfesta.PFestaClient(c, cfg, t, xs, ys, emb, seed=i)
                                     for i, (c, (t, xs, ys)) in enumerate(data.items())], **setting)
    t_p = time.perf_counter() - t0
    out = {"setting": {"samples_per_client": 300, "batch": 32, **{k: v for k, v in setting.items() if k != "test_data"}}}
    for name, res, kinds, secs in (("festa", f, festa.TRAIN_KINDS, t_f), ("pfesta", p, pfesta.TRAIN_KINDS, t_p)):
        rows = compare(res.counter, res.params, name, kinds)
        out[name] = {"seconds": round(secs, 2), "metrics": res.metrics,
                     "clients": {r["client"]: {"measured_wire": r["measured_wire"], "formula": r["formula"],
                                               "rel_error": round(r["rel_error"], 5), "T_FL": r["formulas"]["fl"],
                                               "T_SL": r["formulas"]["sl"]} for r in rows}}
    out["ratio_pfesta_vs_festa_measured"] = (sum(v["measured_wire"] for v in out["pfesta"]["clients"].values())
                                             / sum(v["measured_wire"] for v in out["festa"]["clients"].values()))
    return out


def bench_msd(rounds: int, n: int) -> dict:
    torch.set_num_threads(1)
    cfg = SPLIT_MODEL
    x, _ = digits_images(16)
    emb = build_plain_embedder(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        uploads = {c: permute_tokens(t := emb(x[lo:lo + 300]), random_permutations(t.shape[0], t.shape[1], gen))
                   for c, lo in (("a", 0), ("b", 300))}
    res, ch = run_msd_inprocess(cfg, uploads, MSDConfig(steps=1, batch_size=32))
    f = cfg.num_patches * cfg.embed_dim * 4
    ph, pb = tensor_bytes(emb.state_dict()), tensor_bytes(res.body_state)
    msd_p = CostParams(D=300, B=0, R=1, n=1, F=f, G=f, Ph=ph, Pb=pb, Pt=0)
    measured = {c: ch.counter.total(c) for c in uploads}
    mean = sum(measured.values()) / len(measured)
    out = {"measured_per_client": measured, "Pb": pb, "Ph": ph, "F": f, "D": 300}
    for label, r, every in (("table7_R50_r1", MSD_TABLE7_FL_ROUNDS, 1), (f"festa_schedule_R{rounds}_r{n}", rounds, n)):
        fl_p = CostParams(D=300, B=0, R=r, n=every, F=f, G=f, Ph=ph, Pb=pb, Pt=0)
        out[label] = {k: (round(v, 5) if isinstance(v, float) else v)
                      for k, v in msd_vs_fl_ssl(msd_p, fl_p, measured_msd=mean).items()}
        out[label]["measured_over_T_FL_SSL"] = round(mean / out[label]["T_FL_SSL"], 5)
    out["measured_over_eq9"] = round(mean / out["table7_R50_r1"]["T_MSD"], 5)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5, help="timing repetitions for the codec")
    ap.add_argument("--train-rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--unify", type=int, default=2)
    a = ap.parse_args()
    print(json.dumps({"codec": bench_codec(a.batch, a.rounds),
                      "comm": bench_comm(a.train_rounds, a.steps, a.unify),
                      "msd": bench_msd(a.train_rounds, a.unify)}, indent=1))


if __name__ == "__main__":
    main()
