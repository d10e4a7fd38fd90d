"""Benchmark: VGS-ATD against every baseline of the report, over seeds.

Runs a shipped scenario (`demo`, what `atd demo` runs, or `three_phase`) once per seed with
every method of the scenario — VGS-ATD, centralized, FedAvg, swarm, local — plus the
reference ensembles every report carries (the VGS-ATD ensemble on raw inputs and on an
untrained extractor, `netsim.references`), and prints one JSON object: per phase and
method, the overall accuracy (mean over nodes on the phase's pooled test set) per seed,
its mean, standard deviation, min and max over the seeds; VGS-ATD minus each baseline in
points (mean); the phase-1 nodes' accuracy after each phase (forgetting); how many
`aggregate` entries re-verified; the wall time of each run.

    python bench/demo_accuracy_bench.py --scenario three_phase --seeds 0 1 2
    python bench/demo_accuracy_bench.py --backend process   # real daemons, as `atd demo`
    # seeds side by side (one process each), then one summary:
    python bench/demo_accuracy_bench.py --scenario netsim/scenarios/jitter_public.toml --seeds 0 --save runs/
    python bench/demo_accuracy_bench.py --scenario netsim/scenarios/jitter_public.toml --merge runs/seed-*.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL_POINTS = -2.0  # VGS-ATD may trail centralized by at most this much


def spread(xs: list[float]) -> dict:
    return {"runs": xs, "mean": round(statistics.fmean(xs), 4),
            "std": round(statistics.pstdev(xs), 4) if len(xs) > 1 else 0.0, "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("memory", "process"), default="memory")
    ap.add_argument("--scenario", default="demo", help="a shipped scenario name or a TOML path")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--save", help="also write each seed's run (report and wall time) to DIR/seed-N.json")
    ap.add_argument("--merge", nargs="+", metavar="RUN_JSON",
                    help="run nothing: summarise runs saved by --save (seeds run in parallel processes)")
    args = ap.parse_args()

    import torch

    from netsim.run import run_scenario
    from netsim.scenario import load_scenario, shipped_scenario

    torch.set_num_threads(1)
    path = Path(args.scenario) if args.scenario.endswith(".toml") else shipped_scenario(args.scenario)
    base = load_scenario(path).replace(backend=args.backend)
    runs = []
    for seed in [] if args.merge else args.seeds:
        t0 = time.perf_counter()
        rep = run_scenario(base.replace(seed=seed))
        runs.append({"seed": seed, "wall_s": round(time.perf_counter() - t0, 1), "report": rep})
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
            (Path(args.save) / f"seed-{seed}.json").write_text(json.dumps(runs[-1]))
    for f in args.merge or []:
        runs.append(json.loads(Path(f).read_text()))
    runs.sort(key=lambda r: r["seed"])
    args.seeds = [r["seed"] for r in runs]
    methods = list(runs[0]["report"]["methods"])
    phases = sorted(ph["phase"] for ph in runs[0]["report"]["methods"]["vgs-atd"])

    def acc(r: dict, m: str, p: int) -> float:
        return next(ph["overall"]["accuracy"] for ph in r["report"]["methods"][m] if ph["phase"] == p)

    per = {m: {str(p): spread([acc(r, m, p) for r in runs]) for p in phases} for m in methods}
    diff = {m: {str(p): round(100 * (per["vgs-atd"][str(p)]["mean"] - per[m][str(p)]["mean"]), 1) for p in phases}
            for m in methods if m != "vgs-atd"}
    print(json.dumps({
        "bench": "demo_accuracy", "scenario": base.name, "backend": base.backend, "seeds": args.seeds,
        "model": base.model.name, "img_size": base.model.img_size, "patch_size": base.model.patch_size,
        "accuracy": per, "vgs_minus_points": diff,
        "goal_met": {str(p): diff["centralized"][str(p)] >= GOAL_POINTS for p in phases} if "centralized" in diff else None,
        "verdicts": {r["seed"]: r["report"].get("feature_verdicts") for r in runs},
        "forgetting": {r["seed"]: r["report"]["forgetting"].get("vgs-atd") for r in runs},
        "verified": {r["seed"]: [ph.get("verified") for ph in r["report"]["methods"]["vgs-atd"]] for r in runs},
        "wall_s": {r["seed"]: r["wall_s"] for r in runs},
    }, indent=1))


if __name__ == "__main__":
    main()
