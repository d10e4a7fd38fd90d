"""Run a whole scenario: VGS-ATD on the chosen back-end, the baselines, the gossip workload,
and the report. This is the Python API behind `atd netsim run` (and what the tests call).

    report = run_scenario(load_scenario("three_phase.toml"), out=Path("/tmp/sim"))

The report dict (also written as report.json) has: scenario, backend, nodes (data per
node), methods ({method: [one dict per phase]}), forgetting, gossip (when the scenario has
a workload), plan (with method "plan": each member's state per step, `netsim.plan`),
vgs_faults, notes, wall_s. With VGS-ATD among the methods, centralized and
local-only always run too, and so do the reference ensembles (`netsim.references`:
ensemble-raw, ensemble-untrained); `feature_verdicts` (also in notes) says per phase
whether the learned features beat them. `progress(msg)` gets one line per step.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from netsim.baselines import BASELINES, ROUND_METHODS, run_baseline
from netsim.report import forgetting, write_report
from netsim.scenario import TRAIN_KEYS, Scenario

Progress = Callable[[str], None]


def _workdir(keep: Path | None) -> Path:
    """Node homes and data live here. A fixed-length temp path keeps entry and blob sizes
    (which name file paths) identical between runs of one scenario."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="atd-netsim-", dir=keep))
    return Path(tempfile.mkdtemp(prefix="atd-netsim-"))


def run_scenario(scn: Scenario, out: Path | None = None, *, progress: Progress = lambda _m: None,
                 keep_homes: Path | None = None, bases: tuple[str, ...] = ()) -> dict:
    """Run `scn` and return its report (written into `out` when given). `bases`: run it once
    per base ("scratch", "msd"; see `scenario.base`) and report them side by side."""
    if len(bases) > 1:
        return _side_by_side(scn, bases, out, progress=progress, keep_homes=keep_homes)
    if bases:
        scn = scn.replace(base=bases[0])
    t_start = time.perf_counter()
    work = _workdir(keep_homes)
    report: dict = {"scenario": _scenario_info(scn), "backend": scn.backend, "nodes": {}, "methods": {},
                    "notes": [], "vgs_faults": []}
    try:
        if scn.learning:
            with one_torch_thread():
                _learning(scn, work, report, progress)
        if scn.workload is not None:
            report["gossip"] = run_gossip_scenario(scn, work / "gossip", progress=progress)
    finally:
        if keep_homes is None:
            shutil.rmtree(work, ignore_errors=True)
    report["wall_s"] = round(time.perf_counter() - t_start, 3)
    if out is not None:
        report["files"] = {k: p.name for k, p in write_report(report, Path(out)).items()}
    return report


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Every simulated node computes on one CPU thread (then the previous count is restored).

    The in-memory back-end runs all nodes in this process, one step at a time; a node's
    steps are small (tiny ViTs, batches of 32), so more threads only add synchronisation —
    with two busy cores, two torch threads made a 2-epoch training 14x slower (40 s vs 2.9 s)
    — and the result would depend on the machine: torch's reductions split by thread count,
    so the same scenario gave other weights on a 2-core and a 16-core machine. The process
    back-end's daemons get OMP_NUM_THREADS=1 likewise (`netsim.procnet`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _side_by_side(scn: Scenario, bases: tuple[str, ...], out: Path | None, *, progress: Progress,
                  keep_homes: Path | None) -> dict:
    """One run per base; methods are named "<method> (<base>)" in the merged report, and
    `base_comparison` lists the accuracy per phase of each base's methods."""
    t0 = time.perf_counter()
    reps = {}
    for b in bases:
        progress(f"base {b}")
        reps[b] = run_scenario(scn.replace(base=b), None, progress=progress, keep_homes=keep_homes)
    first = reps[bases[0]]
    report = {**first, "methods": {f"{m} ({b})": v for b, r in reps.items() for m, v in r["methods"].items()},
              "forgetting": {f"{m} ({b})": v for b, r in reps.items() for m, v in r.get("forgetting", {}).items()},
              "notes": [n for r in reps.values() for n in r["notes"]],
              "bases": {b: {"wall_s": r["wall_s"], **({"msd_base": r["msd_base"]} if "msd_base" in r else {})}
                        for b, r in reps.items()}}
    report.pop("msd_base", None)
    if "msd" in bases and "scratch" in bases and scn.model.name != "vit_base_patch16_gap_224":
        report["notes"].append(f"base scratch runs the scenario's {scn.model.name}; base msd runs "
                               "vit_base_patch16_gap_224 at the same sizes (for an architecture-matched "
                               "scratch run, set [model] name to it)")
    report["base_comparison"] = base_comparison(report["methods"])
    report["wall_s"] = round(time.perf_counter() - t0, 3)
    if out is not None:
        report["files"] = {k: p.name for k, p in write_report(report, Path(out)).items()}
    return report


def base_comparison(methods: dict[str, list[dict]]) -> list[dict]:
    """Per phase: overall accuracy of every method (named "<method> (<base>)" when bases differ)."""
    phases = sorted({ph["phase"] for v in methods.values() for ph in v})
    return [{"phase": p, **{m: next((ph["overall"].get("accuracy") for ph in v if ph["phase"] == p), None)
                            for m, v in methods.items()}} for p in phases]


def _scenario_info(scn: Scenario) -> dict:
    return {"name": scn.name, "description": scn.description, "seed": scn.seed, "source": scn.source,
            "score_split": scn.score_split,
            "methods": list(scn.methods), "model": asdict(scn.model), "train": {k: getattr(scn.train, k) for k in TRAIN_KEYS},
            "baselines": asdict(scn.baselines), "network": {k: v for k, v in asdict(scn.network).items()
                                                           if k != "links"},
            "phases": {p: scn.phase(p).mode for p in scn.phase_numbers()}, **({"plan": scn.plan} if scn.plan else {})}


def _learning(scn: Scenario, work: Path, report: dict, progress: Progress) -> None:
    from netsim.nodedata import load_scenario_data

    if scn.base == "public" and scn.public.file:  # a shipped W_p missing or changed: refused before any work
        from netsim.publicbase import shipped_public_base

        shipped_public_base(scn)
    progress("loading and partitioning the data")
    data = load_scenario_data(scn)
    report["label_space"] = data.label_space
    if scn.score_split == "val":
        report["notes"].append("score_split val: a selection run; every number below is on the data sets' val "
                               "splits (carved from their training splits), the test splits were not read")
    for n, d in data.nodes.items():
        report["nodes"][n] = {"phase": d.phase, "group": d.group, "cohort": d.cohort, "dataset": d.dataset,
                              "classes": d.classes, "train": len(d.train), "test": len(d.test),
                              **({"val": len(d.val)} if d.val is not None else {}),
                              "class_counts": d.class_counts}
    base = None
    if scn.base == "msd":  # the nodes build their base first; everything runs on its model
        from netsim.msdbase import base_scenario, run_msd_base

        base = run_msd_base(scn, data, work / "msd", progress=progress)
        report["msd_base"] = base.summary()
        scn = base_scenario(scn)
        report["notes"].append(f"base msd: every method runs {scn.model.name} (the MSD base's timm ViT, same "
                               "sizes); vgs-atd and every listed baseline again as <method>-msd start from the "
                               "base, the others from scratch")
    files = base.files if base is not None else None
    wp = None
    if scn.base == "public":  # a designated client pretrains W_p on the public pool (VGS-ATD §3.2)
        from netsim.publicbase import finetune_scenario, run_public_base

        wp = run_public_base(scn, data, work / "public", progress=progress)
        report["public_base"] = wp.summary()
        files, scn = wp.files, finetune_scenario(scn)
        report["notes"].append(f"base public: vgs-atd and every baseline start from W_p (trained on "
                               f"{scn.public.spec} by {wp.info['designated']}) and train {scn.train.epochs} epochs "
                               f"at {scn.train.lr:g}; ensemble-public is the ensemble on W_p's features, not fine-tuned")
    if "vgs-atd" in scn.methods:
        if scn.backend == "memory":
            phases, faults = run_vgs_memory(scn, data, work / "vgs", progress=progress, base_files=files)
        else:
            from netsim.procnet import run_vgs_process

            phases, faults, notes = run_vgs_process(scn, data, work / "vgs", progress=progress, base_files=files)
            report["notes"] += notes
        report["methods"]["vgs-atd"] = [r.to_dict() for r in phases]
        report["vgs_faults"] = faults
    if "plan" in scn.methods:  # the scenario's plan file, carried out by the nodes as `atd plan` does
        from netsim.plan import run_plan

        res, report["plan"], notes = run_plan(scn, data, work / "plan", progress=progress)
        report["methods"]["plan"] = [res.to_dict()]
        report["notes"] += notes
    methods = list(scn.methods)
    if "vgs-atd" in methods:  # a claim about VGS-ATD travels with centralized and local-only
        added = [m for m in ("centralized", "local") if m not in methods]
        methods += added
        if added:
            report["notes"].append(f"added {' and '.join(added)}: every VGS-ATD report shows them")
    for m in methods:
        if m in BASELINES:
            progress(f"baseline {m}")
            start = wp.extractor if wp is not None else None  # every baseline takes W_p
            if start is not None:
                report["notes"] += _no_probe_note(m, scn, "public")
            report["methods"][m] = [r.to_dict() for r in run_baseline(m, scn, data, log=progress, base=start)]
    if "vgs-atd" in methods:  # and with the same ensemble on raw inputs and on an untrained extractor
        from netsim.references import OWN_RAW, REFERENCES, headline, run_reference, verdicts

        for kind in (*REFERENCES, OWN_RAW):
            progress(f"reference {kind}")
            report["methods"][kind] = [r.to_dict() for r in run_reference(kind, scn, data, log=progress)]
        if wp is not None:  # what the public base alone gives the ensemble (does the consortium add anything?)
            from netsim.publicbase import base_model

            progress("reference ensemble-public")
            report["methods"]["ensemble-public"] = [r.to_dict() for r in run_reference(
                "ensemble-untrained", scn, data, log=progress, name="ensemble-public",
                model=lambda cfg: base_model(cfg, wp.extractor))]
        report["feature_verdicts"] = verdicts(report["methods"])
        report["notes"] += report["feature_verdicts"]
        report["headline"] = headline(report)
    if base is not None:  # every listed baseline again from the same base: the gap at equal starts
        from netsim.msdbase import base_tensors

        extractor = base_tensors(base)
        for m in (m for m in scn.methods if m in BASELINES):
            progress(f"baseline {m} from the MSD base")
            report["notes"] += _no_probe_note(m, scn, "msd")
            report["methods"][f"{m}-msd"] = [dict(r.to_dict(), method=f"{m}-msd") for r in run_baseline(
                m, scn, data, log=progress, base=extractor)]
    phase1 = [n for n, d in data.nodes.items() if d.phase == 1]
    report["forgetting"] = forgetting(report["methods"], phase1)


def _no_probe_note(method: str, scn: Scenario, base: str) -> list[str]:
    """The one start that differs from a shared base: an `atd rounds` method's round 0 has no
    LP-FT probe (`netsim.baselines` module doc), said when [train] probe_epochs is on."""
    if method not in ROUND_METHODS or not scn.train.probe_epochs:
        return []
    return [f"base {base}: {method}'s round 0 starts from the base's extractor and a seeded head, without "
            "the LP-FT probe the other methods run (netsim.baselines)"]


def run_vgs_memory(scn: Scenario, data, work: Path, *, progress: Progress = lambda _m: None,
                   observer=None, base_files: dict | None = None) -> tuple[list, list[dict]]:
    """VGS-ATD on the in-memory back-end; returns (phase results, fault outcomes).
    `observer(src, dst, kind, nbytes, delivered)` sees every transmission (tests use it)."""
    from atdnode.blobs import volatile_disk
    from netsim.fit_share import shared_ensemble_fits
    from netsim.memnet import MemCluster, simulate
    from netsim.vgs import VgsRunner

    names = list(data.nodes)
    t = scn.topology
    cluster = MemCluster(work / "homes", names, seed=scn.seed, network=scn.network,
                         sync_interval=t.sync_interval_s, poll_interval=t.poll_interval_s, max_peers=t.max_peers,
                         auto_fetch=False, roles=scn.node_roles())
    if observer is not None:
        cluster.net.add_observer(observer)
    runner = VgsRunner(scn, data, cluster, work, log=progress, base_files=base_files)
    # simulated homes: no fsync (atdnode.blobs.fs); nodes holding the same
    # features fit the same ensemble: once per process (netsim.fit_share)
    with volatile_disk(), shared_ensemble_fits():
        phases = simulate(runner.run, seed=scn.seed)
    return phases, runner.fault_log


def run_gossip_scenario(scn: Scenario, work: Path, *, progress: Progress = lambda _m: None,
                        simulated: bool = True) -> dict:
    """The gossip workload with faults on the scenario's back-end; returns its report dict.

    The in-memory back-end runs on simulated time (`memnet.simulate`); `simulated=False`
    runs the same nodes on trio's real clock with real worker threads (the tests compare
    the two). The report's `peers` says whether the nodes were full daemons or lite peers."""
    from netsim.workload import run_gossip

    names = scn.node_names()
    t = scn.topology
    if scn.backend == "process":
        from netsim.procnet import ProcCluster, run_trio

        cluster = ProcCluster(work, names, seed=scn.seed, network=scn.network, sync_interval=t.sync_interval_s)

        async def main() -> dict:
            async with cluster.running():
                rep = await run_gossip(cluster, scn, log=progress)
            d = rep.to_dict()
            d["notes"] = cluster.notes + d["notes"]
            return d

        return run_trio(main)
    from netsim.memnet import MemCluster, simulate

    if t.peers == "lite":
        from netsim.litenode import LiteCluster

        cluster = LiteCluster(names, seed=scn.seed, network=scn.network, sync_interval=t.sync_interval_s,
                              max_peers=t.max_peers)
    else:
        cluster = MemCluster(work, names, seed=scn.seed, network=scn.network, sync_interval=t.sync_interval_s,
                             poll_interval=t.poll_interval_s, max_peers=t.max_peers)

    async def main() -> dict:
        async with cluster.running():
            rep = await run_gossip(cluster, scn, log=progress)
        d = rep.to_dict()
        d["peers"] = t.peers
        d["clock"] = "simulated" if simulated else "real"
        return d

    if not simulated:
        import trio

        return trio.run(main)
    return simulate(main, seed=scn.seed)
