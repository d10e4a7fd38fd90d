"""Claims on real images, one seed: netsim/scenarios/breastmnist.toml (three sites with class
shares 40/60, 10/90, 90/10 of the shared BreastMNIST, scored on its official test split).

Its own tier (`claims`, `pytest --claims tests/test_claims_breastmnist.py`): one run of the
scenario trains VGS-ATD's daemons, centralized, FedAvg, local and the reference ensembles,
minutes on 2 cores — over the suite's budget. Every margin is against a baseline measured in
the same run:

* every site's default model (what `atd classify` uses after keep = best) scores at least its
  own raw-pixel ensemble (same class-prior correction) and its own local model;
* VGS-ATD (overall) is at least centralized minus 2 points;
* VGS-ATD beats the shared start's features alone (the same ensemble on the untrained
  extractor) — so the test fails when VGS-ATD is replaced by the untrained extractor.
"""
from __future__ import annotations

import pytest

from netsim.run import run_scenario
from netsim.scenario import load_scenario, shipped_scenario

pytestmark = [pytest.mark.slow, pytest.mark.claims, pytest.mark.timeout(3600)]
GAP_TO_CENTRALIZED = 0.02


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_scenario(load_scenario(shipped_scenario("breastmnist")), tmp_path_factory.mktemp("breastmnist"))


def _overall(report: dict, method: str) -> float:
    return report["methods"][method][0]["overall"]["accuracy"]


@pytest.mark.xfail(strict=True, reason="not met yet: a site with a 40/60 share keeps below its own raw-pixel "
                   "ensemble, and a site's val split of two minority images cannot tell its models apart")
def test_every_site_is_better_off_than_alone(report: dict) -> None:
    vgs = report["methods"]["vgs-atd"][0]["per_node"]
    for alone in ("ensemble-raw-own", "local"):
        theirs = report["methods"][alone][0]["per_node"]
        for site, m in vgs.items():
            assert m["accuracy"] >= theirs[site]["accuracy"], (site, alone, m["accuracy"], theirs[site]["accuracy"])


def test_the_consortium_is_near_centralized_and_worth_more_than_its_start(report: dict) -> None:
    vgs = _overall(report, "vgs-atd")
    assert vgs >= _overall(report, "centralized") - GAP_TO_CENTRALIZED
    assert vgs > _overall(report, "ensemble-untrained")
