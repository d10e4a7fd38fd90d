"""The VGS-ATD paper's accuracy claims on the shipped `three_phase` scenario, fixed seeds
(in-memory back-end: real daemons, real training, simulated network).

One run of the scenario as shipped (`atd netsim run three_phase`, minus the centralized
baseline, which no claim here compares with) gives, per phase, the overall accuracy of
VGS-ATD and of FedAvg, swarm and local-only training on the same partitions. Claims:

* VGS-ATD >= FedAvg, >= swarm and >= local-only in every phase (horizontal, vertical,
  hierarchical): the baselines are measured in the same run, so the thresholds are theirs;
* phase-1 nodes lose at most 2 points of accuracy on their own test data after phases 2
  and 3 (the vertical phase adds four classes they never saw, the hierarchical phase a
  second group) — the paper's "no forgetting";
* every `aggregate` entry of every phase re-verifies (`atd aggregate --verify`).

Measured (seed 0): VGS-ATD 0.954 / 0.883 / 0.925, FedAvg 0.759 / 0.476 / 0.557, swarm
0.810 / 0.351 / 0.866, local 0.438 / 0.232 / 0.347; phase-1 nodes 0.954 -> 0.940 -> 0.958.
The whole run takes about 60 s of compute on the 2-core machine.
"""
from __future__ import annotations

import pytest

from netsim.run import run_scenario
from netsim.scenario import load_scenario, shipped_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
BASELINES = ("fedavg", "swarm", "local")
MAX_FORGETTING = 0.02  # accuracy points (as a fraction) a phase-1 node may lose later


@pytest.fixture(scope="module")
def report() -> dict:
    scn = load_scenario(shipped_scenario("three_phase"))
    return run_scenario(scn.replace(methods=("vgs-atd", *BASELINES)))


def _overall(report: dict, method: str) -> dict[int, float]:
    return {ph["phase"]: ph["overall"]["accuracy"] for ph in report["methods"][method]}


def test_vgs_atd_at_least_every_baseline_in_every_phase(report: dict) -> None:
    vgs = _overall(report, "vgs-atd")
    assert sorted(vgs) == [1, 2, 3]
    for method in BASELINES:
        other = _overall(report, method)
        for p in (1, 2, 3):
            assert vgs[p] >= other[p], f"phase {p}: VGS-ATD {vgs[p]:.3f} < {method} {other[p]:.3f}"


def test_phase1_nodes_keep_their_accuracy_after_phases_2_and_3(report: dict) -> None:
    f = report["forgetting"]["vgs-atd"]  # mean own-test accuracy of h1-h3 after each phase
    assert None not in f.values(), f
    for p in ("2", "3"):
        assert f["1"] - f[p] <= MAX_FORGETTING, f"after phase {p}: {f[p]:.3f}, after phase 1: {f['1']:.3f}"


def test_every_aggregate_entry_verifies(report: dict) -> None:
    for ph in report["methods"]["vgs-atd"]:
        v = ph["verified"]
        assert v["aggregates"] > 0 and v["verified"] == v["aggregates"], (ph["phase"], v, ph["notes"])
