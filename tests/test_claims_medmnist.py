"""Claims on real images, one seed: the shipped MedMNIST scenarios (netsim/scenarios/
retinamnist.toml: three sites with Dirichlet(0.5) shares of the five RetinaMNIST grades;
breastmnist.toml: class shares 40/60, 10/90, 90/10 of BreastMNIST), scored on each set's
official test split. The three seeds are `python bench/medmnist_bench.py --scenario NAME
--seeds 0 1 2`.

Every margin is against a baseline measured in the same run, judged by balanced accuracy
(`bench.medmnist_bench.JUDGED_BY`; why: that module's doc — on BreastMNIST's 73 %-benign test
split a constant "benign" scores 0.731 accuracy, above centralized - 2 points):

* every site's default model (what `atd classify` uses after keep = best) scores at least its
  own raw-pixel ensemble (same class-prior correction) and its own local model;
* VGS-ATD (overall) is at least centralized minus 2 points;
* VGS-ATD beats the shared start's features alone (the same ensemble on the untrained
  extractor) — so the tests fail when VGS-ATD is replaced by the untrained extractor.

RetinaMNIST, where every bar holds at seed 0, is in the default suite (slow tier, about two
minutes of CPU); BreastMNIST, where the per-site bar does not (a strict xfail), is in the
`claims` tier (`pytest --claims`). Each run leaves out FedAvg, which no claim here reads (the
bench reports it).
"""
from __future__ import annotations

import pytest

from bench.medmnist_bench import GAP_POINTS, JUDGED_BY
from netsim.run import run_scenario
from netsim.scenario import load_scenario, shipped_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _run(name: str, out) -> dict:
    scn = load_scenario(shipped_scenario(name))
    return run_scenario(scn.replace(methods=tuple(m for m in scn.methods if m != "fedavg")), out)


@pytest.fixture(scope="module")
def retina(tmp_path_factory) -> dict:
    return _run("retinamnist", tmp_path_factory.mktemp("retinamnist"))


@pytest.fixture(scope="module")
def breast(tmp_path_factory) -> dict:
    return _run("breastmnist", tmp_path_factory.mktemp("breastmnist"))


def _overall(report: dict, method: str) -> float:
    return report["methods"][method][0]["overall"][JUDGED_BY]


def _every_site_is_better_off_than_alone(report: dict) -> None:
    vgs = report["methods"]["vgs-atd"][0]["per_node"]
    for alone in ("ensemble-raw-own", "local"):
        theirs = report["methods"][alone][0]["per_node"]
        for site, m in vgs.items():
            assert m[JUDGED_BY] >= theirs[site][JUDGED_BY], (site, alone, m[JUDGED_BY], theirs[site][JUDGED_BY])


def _near_centralized_and_worth_more_than_its_start(report: dict, classes: int) -> None:
    vgs = _overall(report, "vgs-atd")
    assert vgs >= _overall(report, "centralized") - GAP_POINTS / 100
    assert vgs > _overall(report, "ensemble-untrained")
    # the judge's floor: a constant answer scores 1 / classes balanced accuracy
    assert vgs > 1 / classes + 0.05 and _overall(report, "centralized") > 1 / classes


def test_retina_every_site_is_better_off_than_alone(retina: dict) -> None:
    _every_site_is_better_off_than_alone(retina)


def test_retina_consortium_is_near_centralized_and_worth_more_than_its_start(retina: dict) -> None:
    _near_centralized_and_worth_more_than_its_start(retina, classes=5)


@pytest.mark.claims
@pytest.mark.xfail(strict=True, reason="not met at seed 0: s1 keeps the consortium's model (the best of its "
                   "candidates on its val split), which scores 1.6 points of balanced accuracy under s1's local "
                   "model on the test split; every other site and bar holds (RESULTS.md)")
def test_breast_every_site_is_better_off_than_alone(breast: dict) -> None:
    _every_site_is_better_off_than_alone(breast)


@pytest.mark.claims
def test_breast_consortium_is_near_centralized_and_worth_more_than_its_start(breast: dict) -> None:
    _near_centralized_and_worth_more_than_its_start(breast, classes=2)
