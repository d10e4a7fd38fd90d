"""Benchmark: the demo's accuracy, VGS-ATD against centralized training (issue 12).

Runs the shipped `demo` scenario (what `atd demo` runs) with the methods VGS-ATD and
centralized only, and prints one JSON object: per phase, the overall accuracy (mean over
nodes on the phase's pooled test set) of each, their difference in points
(VGS-ATD - centralized; the goal is > -2 in every phase), the phase-1 nodes' accuracy
after each phase (forgetting) and how many `aggregate` entries re-verified.

    python bench/demo_accuracy_bench.py                     # in-memory back-end (same numbers, faster)
    python bench/demo_accuracy_bench.py --backend process   # real daemons, as `atd demo`
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL_POINTS = -2.0  # VGS-ATD may trail centralized by at most this much


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("memory", "process"), default="memory")
    ap.add_argument("--scenario", default="demo", help="a shipped scenario name or a TOML path")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()

    import torch

    from netsim.run import run_scenario
    from netsim.scenario import load_scenario, shipped_scenario

    torch.set_num_threads(1)
    path = Path(args.scenario) if args.scenario.endswith(".toml") else shipped_scenario(args.scenario)
    scn = load_scenario(path).replace(methods=("vgs-atd", "centralized"), backend=args.backend)
    if args.seed is not None:
        scn = scn.replace(seed=args.seed)
    t0 = time.perf_counter()
    rep = run_scenario(scn)
    acc = {m: {ph["phase"]: ph["overall"]["accuracy"] for ph in rep["methods"][m]} for m in ("vgs-atd", "centralized")}
    phases = sorted(acc["vgs-atd"])
    diff = {p: round(100 * (acc["vgs-atd"][p] - acc["centralized"][p]), 1) for p in phases}
    print(json.dumps({
        "bench": "demo_accuracy", "scenario": scn.name, "backend": scn.backend, "seed": scn.seed,
        "model": scn.model.name,
        "vgs_atd": {str(p): acc["vgs-atd"][p] for p in phases},
        "centralized": {str(p): acc["centralized"][p] for p in phases},
        "diff_points": {str(p): diff[p] for p in phases},
        "goal_met": {str(p): diff[p] >= GOAL_POINTS for p in phases},
        "forgetting": rep["forgetting"],
        "verified": {str(ph["phase"]): ph.get("verified") for ph in rep["methods"]["vgs-atd"]},
        "wall_s": round(time.perf_counter() - t0, 1),
    }, indent=2))


if __name__ == "__main__":
    main()
