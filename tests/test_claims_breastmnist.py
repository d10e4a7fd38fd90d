"""Claims on real images, one seed, in the default suite: netsim/scenarios/breastmnist.toml
(three sites with class shares 40/60, 10/90, 90/10 of the shared BreastMNIST, scored on its
official test split; about a minute of CPU on the memory back-end). The three seeds are
`python bench/medmnist_bench.py --scenario breastmnist --seeds 0 1 2`.

Every margin is against a baseline measured in the same run, judged by balanced accuracy
(`bench.medmnist_bench.JUDGED_BY`; why: that module's doc — on this 73 %-benign test split a
constant "benign" scores 0.731 accuracy, above centralized - 2 points):

* every site's default model (what `atd classify` uses after keep = best) scores at least its
  own raw-pixel ensemble (same class-prior correction) and its own local model;
* VGS-ATD (overall) is at least centralized minus 2 points;
* VGS-ATD beats the shared start's features alone (the same ensemble on the untrained
  extractor) — so the test fails when VGS-ATD is replaced by the untrained extractor.
"""
from __future__ import annotations

import pytest

from bench.medmnist_bench import GAP_POINTS, JUDGED_BY
from netsim.run import run_scenario
from netsim.scenario import load_scenario, shipped_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """The shipped scenario's run, less FedAvg (no claim here reads it; the bench reports it)."""
    scn = load_scenario(shipped_scenario("breastmnist"))
    scn = scn.replace(methods=tuple(m for m in scn.methods if m != "fedavg"))
    return run_scenario(scn, tmp_path_factory.mktemp("breastmnist"))


def _overall(report: dict, method: str) -> float:
    return report["methods"][method][0]["overall"][JUDGED_BY]


@pytest.mark.xfail(strict=True, reason="not met at seed 0: s1's own raw-pixel ensemble beats the consortium's "
                   "model it keeps, and s2 keeps its own model, better on its val split by more than one SE "
                   "(the one-SE rule) but a constant answer on the test split")
def test_every_site_is_better_off_than_alone(report: dict) -> None:
    vgs = report["methods"]["vgs-atd"][0]["per_node"]
    for alone in ("ensemble-raw-own", "local"):
        theirs = report["methods"][alone][0]["per_node"]
        for site, m in vgs.items():
            assert m[JUDGED_BY] >= theirs[site][JUDGED_BY], (site, alone, m[JUDGED_BY], theirs[site][JUDGED_BY])


def test_the_consortium_is_near_centralized_and_worth_more_than_its_start(report: dict) -> None:
    vgs = _overall(report, "vgs-atd")
    assert vgs >= _overall(report, "centralized") - GAP_POINTS / 100
    assert vgs > _overall(report, "ensemble-untrained")


def test_every_method_is_above_chance(report: dict) -> None:
    """The judge's floor: a constant answer scores 1/2 balanced accuracy on two classes."""
    assert _overall(report, "vgs-atd") > 0.5 + 0.05
    assert _overall(report, "centralized") > 0.5
