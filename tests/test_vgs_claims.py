"""The VGS-ATD paper's accuracy claims on the shipped `three_phase` scenario, against every
baseline measured in the same run (in-memory back-end: real daemons, real training,
simulated network).

One run of the scenario as shipped (`atd netsim run three_phase`, seed 0, one torch thread as
`netsim.run` computes) gives, per phase, the overall accuracy of VGS-ATD, centralized training
on the pooled data, FedAvg, swarm, local-only, and the VGS-ATD ensemble on raw pixels and on an
untrained extractor of the same config (`netsim.references`). Its numbers, and those of the
settings tried before this recipe, are in RESULTS.md ("three_phase.toml").

Claims asserted:

* VGS-ATD >= FedAvg, >= swarm and >= local-only in every phase, and >= centralized - 2 points:
  the consortium does at least as well as the other ways to learn from the same partitions;
* in the hierarchical phase, where both groups start from the consortium's one base, VGS-ATD
  beats the same ensemble on an untrained extractor: the second group's training adds to the
  shared start (before the shared base, group B trained from its own random start and lost);
* phase-1 nodes lose at most 2 points on their own test data after phases 2 and 3 (joining
  label spaces do not make the founders forget theirs);
* every `aggregate` entry of every phase re-verifies (`atd aggregate --verify`);
* every baseline learns (beats the pooled test set's majority share by 5 points in phase 1)
  and its bytes are counted as its method sends them;
* the report's verdict sentence per phase says what its own numbers say.

Claims that do NOT hold at this size (8 px digits, 4 patches): VGS-ATD does not beat the
ensemble on raw pixels in any phase, nor the untrained extractor in phases 1-2; the images
are too small for learned features to matter. Each is a strict xfail (it fails the day it
starts to hold, so it gets promoted), and the verdict test fails if the report stops saying
so. The setting where learned features do win, with every claim checked over three seeds, is
`netsim/scenarios/jitter_public.toml` (tests/test_vgs_claims_public.py, `pytest --claims`).

Tier: `claims` (`pytest --claims tests/test_vgs_claims.py`). The default suite's claims test
is the one on real images (tests/test_claims_medmnist.py: every site better off than alone,
near centralized, worth more than its start); this synthetic run costs about three minutes of
CPU, and its forgetting bar holds at seed 0 but not at seed 1 (RESULTS.md), so one seed of it
is not a gate. One seed: the scenario's run is the whole cost of this module; a 4-node consortium at the same recipe does not hold these claims (RESULTS.md),
so the test keeps the shipped 8 nodes. To keep the run cheap without changing a number, the
simulated nodes that hold the same features share one ensemble fit (netsim.fit_share), the
simulation skips fsync (atdnode.blobs.fs.volatile_disk) and small blobs verify without large
buffers.
"""
from __future__ import annotations

import numpy as np
import pytest

from netsim.baselines import SERVER
from netsim.nodedata import load_scenario_data
from netsim.references import verdicts
from netsim.run import run_scenario
from netsim.scenario import load_scenario, shipped_scenario

pytestmark = [pytest.mark.slow, pytest.mark.claims, pytest.mark.timeout(1800)]
E2E = ("fedavg", "swarm", "local")
REFERENCES = ("ensemble-raw", "ensemble-untrained")
MAX_FORGETTING = 0.02  # accuracy points (as a fraction) a phase-1 node may lose later


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("three_phase")


@pytest.fixture(scope="module")
def report(out_dir) -> dict:
    return run_scenario(load_scenario(shipped_scenario("three_phase")), out_dir)


def _overall(report: dict, method: str) -> dict[int, float]:
    return {ph["phase"]: ph["overall"]["accuracy"] for ph in report["methods"][method]}


def test_every_baseline_is_measured_in_the_same_run(report: dict) -> None:
    assert set(report["methods"]) == {"vgs-atd", "centralized", *E2E, *REFERENCES, "ensemble-raw-own"}
    for m in report["methods"]:
        assert sorted(_overall(report, m)) == [1, 2, 3], m
        for ph in report["methods"][m]:  # every present node is scored
            assert ph["overall"]["nodes"] == len(ph["per_node"]), (m, ph["phase"])


def test_every_baseline_learns_and_counts_its_bytes(report: dict) -> None:
    """Each baseline on its own terms (on this run's 8 nodes):
    every present node is scored; in phase 1 the mean over nodes on the pooled test set beats
    the majority share there (a constant predictor's score) by 5 points; local-only sends
    nothing; FedAvg is `atd rounds` among the daemons (no server, every node publishes); in
    centralized training only the nodes that join a phase upload their data, raw."""
    scn = load_scenario(shipped_scenario("three_phase"))
    data = load_scenario_data(scn)
    pooled = data.pooled_test(1).labels.numpy()
    majority = float(np.bincount(pooled).max() / len(pooled))
    for m in ("centralized", *E2E):
        res = report["methods"][m]
        assert [r["phase"] for r in res] == [1, 2, 3], m
        for r in res:
            assert set(r["per_node"]) == set(data.present(r["phase"])), (m, r["phase"])
        assert res[0]["overall"]["accuracy"] > majority + 0.05, (m, res[0]["overall"], majority)
        for r in res[1:]:
            sent = {n: b["sent"] for n, b in r["bytes"].items()}
            if m == "local":
                assert sum(sent.values()) == 0, sent
            else:
                assert sum(sent.values()) > 0, (m, r["phase"])
            if m == "fedavg":
                assert SERVER not in sent and all(sent[n] > 0 for n in data.present(r["phase"])), sent
            if m == "centralized":
                for n in data.present(r["phase"]):
                    joined = data.nodes[n].phase == r["phase"]
                    assert sent[n] == (data.nodes[n].raw_bytes if joined else 0), (r["phase"], n, sent)


def test_vgs_atd_at_least_every_end_to_end_baseline_in_every_phase(report: dict) -> None:
    vgs = _overall(report, "vgs-atd")
    for method in E2E:
        other = _overall(report, method)
        for p in (1, 2, 3):
            assert vgs[p] >= other[p], f"phase {p}: VGS-ATD {vgs[p]:.3f} < {method} {other[p]:.3f}"


def test_vgs_atd_within_2_points_of_centralized_and_above_the_untrained_extractor_in_phase_3(report: dict
                                                                                            ) -> None:
    vgs, central, unt = (_overall(report, m) for m in ("vgs-atd", "centralized", "ensemble-untrained"))
    for p in (1, 2, 3):
        assert vgs[p] >= central[p] - 0.02, f"phase {p}: VGS-ATD {vgs[p]:.3f}, centralized {central[p]:.3f}"
    assert vgs[3] > unt[3], f"phase 3: VGS-ATD {vgs[3]:.3f} <= untrained-extractor ensemble {unt[3]:.3f}"


def test_the_report_says_whether_learned_features_beat_the_references(report: dict, out_dir) -> None:
    vgs, raw, unt = (_overall(report, m) for m in ("vgs-atd", *REFERENCES))
    lines = report["feature_verdicts"]
    assert lines == verdicts(report["methods"]) and len(lines) == 3
    for p, line in zip((1, 2, 3), lines):
        beats = vgs[p] > raw[p] and vgs[p] > unt[p]
        assert line.startswith(f"Phase {p}: the learned features {'beat' if beats else 'do not beat'} "), line
        assert f"VGS-ATD {vgs[p]:.3f}" in line and f"raw inputs {raw[p]:.3f}" in line
        assert line in report["notes"] and f"- {line}." in (out_dir / "report.md").read_text()
    # the references are real classifiers, not placeholders: each beats the majority share
    # of the balanced pooled test sets (1/6, 1/10, 1/10) by far
    for m in REFERENCES:
        for p, chance in zip((1, 2, 3), (1 / 6, 1 / 10, 1 / 10)):
            assert _overall(report, m)[p] > 3 * chance, (m, p)


def test_phase1_nodes_keep_their_accuracy_after_phases_2_and_3(report: dict) -> None:
    f = report["forgetting"]["vgs-atd"]  # mean own-test accuracy of h1-h3 after each phase
    assert None not in f.values(), f
    for p in ("2", "3"):
        assert f["1"] - f[p] <= MAX_FORGETTING, f"after phase {p}: {f[p]:.3f}, after phase 1: {f['1']:.3f}"


def test_every_aggregate_entry_verifies(report: dict) -> None:
    for ph in report["methods"]["vgs-atd"]:
        v = ph["verified"]
        assert v["aggregates"] > 0 and v["verified"] == v["aggregates"], (ph["phase"], v, ph["notes"])


@pytest.mark.parametrize("kind", REFERENCES)
@pytest.mark.xfail(strict=True, reason="at 8 px the learned features lose to raw pixels in every phase "
                                       "and to the untrained extractor in phases 1-2 (module docstring)")
def test_learned_features_beat_the_reference_in_every_phase(report: dict, kind: str) -> None:
    vgs, ref = _overall(report, "vgs-atd"), _overall(report, kind)
    for p in (1, 2, 3):
        assert vgs[p] > ref[p], f"phase {p}: VGS-ATD {vgs[p]:.3f} <= {kind} {ref[p]:.3f}"
