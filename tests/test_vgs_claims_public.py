"""The accuracy claims where learning matters: `netsim/scenarios/jitter_public.toml`
(28 px jittered digits, 49 patches, every method from the public pretrained W_p of VGS-ATD
§3.2), three seeds, every baseline measured in the same runs.

Claims, on the mean over seeds 0-2 of each phase's overall accuracy (mean over the present
nodes on the phase's pooled test set):

* VGS-ATD beats the same ensemble on raw pixels and on an untrained extractor of the config;
* VGS-ATD is at least centralized training on the pooled data minus 2 points (phase 3 is a
  strict xfail: not met with the W_p this code builds, RESULTS.md);
* VGS-ATD is at least FedAvg, swarm and local-only;
* every `aggregate` entry of every run re-verifies (`atd aggregate --verify`), in every seed;
* the report's verdict sentence per phase says what its own numbers say;
* the phase-1 nodes lose at most 2 points of their own-test accuracy after phases 2 and 3,
  scored on the model `atd classify` uses by default: the scenario gives every node a held-out
  val split (`val_fraction`), so `[aggregate] keep = best` decides, on it, whether a node keeps
  its own model or takes the consortium's (netsim.vgs_keep), and each per-node number says
  which. Without that choice no 10-class model meets the bound here: the founders' test sets
  hold their 6 classes, and centralized training loses 7-8 points on them (it is printed).

Cost: the three runs (each trains W_p, VGS-ATD, centralized, FedAvg, swarm, local and three
reference ensembles at 28 px) run side by side in a process pool: about 20 minutes on two
cores. That is over the suite's budget, so this file is its own tier, `pytest --claims`
(marker `claims`, deselected without the flag; see tests/conftest.py). The numbers it
checks, measured, are in RESULTS.md.
"""
from __future__ import annotations

import json
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import pytest

from netsim.references import verdicts
from netsim.scenario import shipped_scenario

pytestmark = [pytest.mark.claims, pytest.mark.slow, pytest.mark.timeout(5400)]
SEEDS = (0, 1, 2)
PHASES = (1, 2, 3)
E2E = ("fedavg", "swarm", "local")
REFERENCES = ("ensemble-raw", "ensemble-untrained")
BAR_POINTS = 0.02  # VGS-ATD may trail centralized by this much (a fraction: 2 points)


def _run(seed: int) -> dict:
    """One seed of the shipped scenario in a fresh process (one torch thread, as netsim runs)."""
    import torch

    from netsim.run import run_scenario
    from netsim.scenario import load_scenario

    torch.set_num_threads(1)
    rep = run_scenario(load_scenario(shipped_scenario("jitter_public")).replace(seed=seed))
    return json.loads(json.dumps(rep, default=str))  # plain data across the process boundary


@pytest.fixture(scope="module")
def reports() -> dict[int, dict]:
    # every seed at once: one torch thread each, and the daemons' waits overlap the training
    with ProcessPoolExecutor(len(SEEDS), mp_context=mp.get_context("spawn")) as pool:
        return dict(zip(SEEDS, pool.map(_run, SEEDS)))


def _overall(report: dict, method: str) -> dict[int, float]:
    return {ph["phase"]: ph["overall"]["accuracy"] for ph in report["methods"][method]}


def _mean(reports: dict[int, dict], method: str) -> dict[int, float]:
    per = [_overall(r, method) for r in reports.values()]
    return {p: sum(o[p] for o in per) / len(per) for p in PHASES}


def test_every_method_is_measured_in_every_run(reports: dict[int, dict]) -> None:
    want = {"vgs-atd", "centralized", *E2E, *REFERENCES, "ensemble-raw-own", "ensemble-public"}
    for seed, rep in reports.items():
        assert set(rep["methods"]) == want, seed
        for m in want:
            assert sorted(_overall(rep, m)) == list(PHASES), (seed, m)


def test_learned_features_beat_raw_pixels_and_the_untrained_extractor(reports: dict[int, dict]) -> None:
    vgs = _mean(reports, "vgs-atd")
    for kind in REFERENCES:
        ref = _mean(reports, kind)
        for p in PHASES:
            assert vgs[p] > ref[p], f"phase {p}: VGS-ATD {vgs[p]:.3f} <= {kind} {ref[p]:.3f} (mean of seeds {SEEDS})"


@pytest.mark.parametrize("phase", [
    1, 2,
    pytest.param(3, marks=pytest.mark.xfail(strict=True, reason=(
        "not met: VGS-ATD 0.695 against centralized 0.719 over seeds 0-2 (-2.4 points) with the W_p this "
        "code builds; an earlier measurement's W_p gave 0.715 against 0.724, and the same commit rerun now "
        "builds the W_p and numbers of today's code bit for bit (RESULTS.md, jitter_public.toml)"))),
])
def test_vgs_atd_within_2_points_of_centralized(reports: dict[int, dict], phase: int) -> None:
    vgs, cen = _mean(reports, "vgs-atd"), _mean(reports, "centralized")
    print(json.dumps({"vgs-atd": vgs, "centralized": cen}))
    assert vgs[phase] >= cen[phase] - BAR_POINTS, f"phase {phase}: VGS-ATD {vgs[phase]:.3f}, centralized {cen[phase]:.3f}"


def test_vgs_atd_at_least_fedavg_swarm_and_local(reports: dict[int, dict]) -> None:
    vgs = _mean(reports, "vgs-atd")
    for m in E2E:
        other = _mean(reports, m)
        for p in PHASES:
            assert vgs[p] >= other[p], f"phase {p}: VGS-ATD {vgs[p]:.3f} < {m} {other[p]:.3f}"


def test_phase1_nodes_lose_at_most_2_points_on_the_model_they_use(reports: dict[int, dict]) -> None:
    def after(method: str) -> dict[str, float]:
        f = [r["forgetting"][method] for r in reports.values()]  # phase-1 nodes' own-test accuracy per phase
        return {p: sum(x[p] for x in f) / len(f) for p in ("1", "2", "3")}

    vgs = after("vgs-atd")
    print(json.dumps({"vgs-atd": vgs, "centralized (the consortium's model)": after("centralized")}))
    for rep in reports.values():  # each per-node number says which model it scored
        for ph in rep["methods"]["vgs-atd"]:
            assert all(e.get("model") in ("own", "consortium") for e in ph["per_node"].values()), ph["per_node"]
    for p in ("2", "3"):
        assert vgs["1"] - vgs[p] <= BAR_POINTS, f"after phase {p}: {vgs[p]:.3f}, after phase 1: {vgs['1']:.3f}"


def test_every_aggregate_entry_verifies_in_every_run(reports: dict[int, dict]) -> None:
    for seed, rep in reports.items():
        for ph in rep["methods"]["vgs-atd"]:
            v = ph["verified"]
            assert v["aggregates"] > 0 and v["verified"] == v["aggregates"], (seed, ph["phase"], v)


def test_each_report_says_what_its_numbers_say(reports: dict[int, dict]) -> None:
    for seed, rep in reports.items():
        lines = rep["feature_verdicts"]
        assert lines == verdicts(rep["methods"]) and len(lines) == len(PHASES), seed
        vgs, raw, unt, pub = (_overall(rep, m) for m in ("vgs-atd", *REFERENCES, "ensemble-public"))
        for p, line in zip(PHASES, lines):
            refs = {"raw inputs": raw[p], "the untrained extractor": unt[p], "the public base W_p": pub[p]}
            lost = [name for name, r in refs.items() if vgs[p] <= r]
            said = f"do not beat {' or '.join(lost)} (" if lost else "beat raw inputs, the untrained extractor and "
            assert line.startswith(f"Phase {p}: the learned features {said}"), line
            assert f"VGS-ATD {vgs[p]:.3f}" in line and f"on W_p's features {pub[p]:.3f}" in line, line
