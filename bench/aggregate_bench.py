"""Benchmark: streaming weighted average of N ViT-sized safetensors weight sets.

Writes N weight sets of random float32 values with a ViT-B/16 tensor layout
(86.6M parameters by default; ``--params`` scales the layout down) to a temp
directory, then measures, each in a fresh subprocess and alternating so both
see the same machine load:

* ``numpy_add``  -- baseline: the same arrays already in memory, summed with
  ``numpy.add(acc, x, out=acc)`` (accumulator allocation included);
* ``atd_float32`` / ``atd_float64`` -- ``protocols.aggregation.weighted_average``
  streaming the files (read + scale + add), float32 / float64 accumulation;
* ``load_file``  -- reference: ``safetensors.torch.load_file`` per input and
  ``torch.add_(alpha=w)`` (the obvious implementation).

Throughput is bytes of input per second (best of ``--rounds``), reported on
wall time and on process CPU time (the latter is robust to other load on a
shared machine). Peak RSS is measured in each subprocess: the kernel's peak
mark (VmHWM) is reset just before the timed part, and "added" is that peak
minus the RSS at that moment (imports and, for the baseline, its preloaded
arrays excluded). Prints one JSON object.

    python bench/aggregate_bench.py                   # 5 x ViT-B (needs ~2 GB disk, ~3 GB RAM)
    python bench/aggregate_bench.py --params 5000000  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_RATIO, TARGET_RSS = 0.7, 3.0


def vit_layout(params: int) -> dict[str, tuple[int, ...]]:
    """ViT-B/16 (224 px, 1000 classes) tensor shapes, embed dim scaled to ~``params``."""
    depth, dim = 12, 768
    if params < 86_000_000:  # keep depth, shrink width (a multiple of 16) to fit
        dim = max(16, int((params / (12 * depth)) ** 0.5) // 16 * 16)
    s: dict[str, tuple[int, ...]] = {"cls_token": (1, 1, dim), "pos_embed": (1, 197, dim),
                                     "patch_embed.proj.weight": (dim, 3, 16, 16), "patch_embed.proj.bias": (dim,)}
    for i in range(depth):
        p = f"blocks.{i}."
        s.update({p + "norm1.weight": (dim,), p + "norm1.bias": (dim,), p + "attn.qkv.weight": (3 * dim, dim),
                  p + "attn.qkv.bias": (3 * dim,), p + "attn.proj.weight": (dim, dim), p + "attn.proj.bias": (dim,),
                  p + "norm2.weight": (dim,), p + "norm2.bias": (dim,), p + "mlp.fc1.weight": (4 * dim, dim),
                  p + "mlp.fc1.bias": (4 * dim,), p + "mlp.fc2.weight": (dim, 4 * dim), p + "mlp.fc2.bias": (dim,)})
    s.update({"norm.weight": (dim,), "norm.bias": (dim,), "head.weight": (1000, dim), "head.bias": (1000,)})
    return s


def write_inputs(directory: Path, n: int, params: int) -> list[Path]:
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    paths = []
    for i in range(n):
        tensors = {k: torch.randn(shape, generator=g) * 0.02 for k, shape in vit_layout(params).items()}
        paths.append(directory / f"w{i}.safetensors")
        save_file(tensors, paths[-1])
    return paths


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM), Linux >= 4.0; False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) in bytes; ru_maxrss as a fallback."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(mode: str, paths: list[str]) -> dict:
    """One measurement in this (fresh) process."""
    import numpy as np
    import torch
    from safetensors.numpy import load_file as np_load
    from safetensors.torch import load_file

    from protocols.aggregation import safetensors_loader, uniform_weights, weighted_average

    w = uniform_weights(len(paths))
    arrays = [np_load(p) for p in paths] if mode == "numpy_add" else None
    base = _rss("VmRSS")
    exact_peak = _reset_peak_rss()
    wall, cpu = time.perf_counter(), time.process_time()
    if mode == "numpy_add":
        acc = {k: np.zeros_like(v) for k, v in arrays[0].items()}
        for a in arrays:
            for k, v in acc.items():
                np.add(v, a[k], out=v)
    elif mode.startswith("atd_"):
        dtype = torch.float32 if mode == "atd_float32" else torch.float64
        acc = weighted_average([safetensors_loader(p) for p in paths], w, accumulate_dtype=dtype)
    elif mode == "load_file":
        acc = None
        for p, wi in zip(paths, w):
            sd = load_file(p)
            if acc is None:
                acc = {k: torch.zeros_like(v) for k, v in sd.items()}
            for k, v in sd.items():
                acc[k].add_(v, alpha=float(wi))
            del sd
    else:
        raise SystemExit(f"unknown mode {mode}")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    out = {"wall_s": wall, "cpu_s": cpu, "peak_rss": _rss("VmHWM"), "base_rss": base, "exact_peak": exact_peak}
    if mode.startswith("atd_"):  # spot-check one tensor against a float64 reference
        key = "blocks.0.attn.qkv.weight"
        ref = sum(float(wi) * load_file(p)[key].double() for p, wi in zip(paths, w))
        out["max_abs_err"] = float((acc[key].double() - ref).abs().max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=86_567_656, help="parameters per weight set (ViT-B: 86.6M)")
    ap.add_argument("--inputs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="alternating measurement rounds; best is kept")
    ap.add_argument("--modes", default="numpy_add,atd_float32,atd_float64,load_file")
    ap.add_argument("--dir", type=Path, default=None, help="where to write inputs (default: a temp dir)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.paths)))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        paths = write_inputs(Path(tmp), args.inputs, args.params)
        set_bytes = paths[0].stat().st_size
        total = sum(p.stat().st_size for p in paths)
        modes = args.modes.split(",")
        best: dict[str, dict] = {}
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        for _ in range(args.rounds):
            for mode in modes:
                proc = subprocess.run([sys.executable, __file__, "--worker", mode, *map(str, paths)],
                                      capture_output=True, text=True, env=env, check=True)
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                b = best.setdefault(mode, {"wall_s": float("inf"), "cpu_s": float("inf"), "peak_rss": 0})
                b["wall_s"], b["cpu_s"] = min(b["wall_s"], r["wall_s"]), min(b["cpu_s"], r["cpu_s"])
                b["peak_rss"] = max(b["peak_rss"], r["peak_rss"])
                b["base_rss"] = r["base_rss"]
                if "max_abs_err" in r:
                    b["max_abs_err"] = r["max_abs_err"]
    results = {}
    for mode, b in best.items():
        results[mode] = {"GBps_wall": round(total / b["wall_s"] / 1e9, 3), "GBps_cpu": round(total / b["cpu_s"] / 1e9, 3),
                         "peak_rss_MB": round(b["peak_rss"] / 2**20, 1),
                         "rss_added_MB": round((b["peak_rss"] - b["base_rss"]) / 2**20, 1),
                         "rss_added_x_weight_set": round((b["peak_rss"] - b["base_rss"]) / set_bytes, 2),
                         **({"max_abs_err": b["max_abs_err"]} if "max_abs_err" in b else {})}
    report = {"benchmark": "aggregate", "params": args.params, "inputs": args.inputs, "rounds": args.rounds,
              "weight_set_MB": round(set_bytes / 2**20, 1), "input_GB": round(total / 1e9, 3),
              "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2), "results": results}
    if "numpy_add" in results:
        base = results["numpy_add"]
        report["ratio_vs_numpy_add"] = {m: {"wall": round(r["GBps_wall"] / base["GBps_wall"], 3),
                                            "cpu": round(r["GBps_cpu"] / base["GBps_cpu"], 3)}
                                        for m, r in results.items() if m != "numpy_add"}
        if "atd_float32" in results:
            r = report["ratio_vs_numpy_add"]["atd_float32"]
            report["targets"] = {"ratio_min": TARGET_RATIO, "rss_added_max_x": TARGET_RSS,
                                 "ratio_met_wall": r["wall"] >= TARGET_RATIO, "ratio_met_cpu": r["cpu"] >= TARGET_RATIO,
                                 "rss_met": results["atd_float32"]["rss_added_x_weight_set"] < TARGET_RSS}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
