"""Where a new group of a hierarchical phase starts (`[[phases]] group_start`, netsim.vgs):
the paper's shared base by default, or the consortium's latest fused extractor."""
from __future__ import annotations

import json

import pytest

from atdnode.node import NodeHome, NodeIdentity
from atdnode.models import ModelRegistry
from ledger import Ledger
from netsim.nodedata import load_scenario_data
from netsim.run import run_vgs_memory
from netsim.scenario import ScenarioError, scenario_from_dict
from tests.netsim_tiny import TINY


def _raw(**phase2) -> dict:
    """TINY cut to two phases (cheaper): founders a1, a2 (group A, horizontal), then c1 alone
    as group B (hierarchical)."""
    raw = json.loads(json.dumps(TINY))
    raw["cohorts"] = [raw["cohorts"][0], {**raw["cohorts"][2], "phase": 2, "nodes": ["c1"]}]
    raw["phases"] = [{"phase": 1, "mode": "horizontal"},
                     {"phase": 2, "mode": "hierarchical", "weighting": "sqrt-classes", **phase2}]
    return raw


def test_group_start_is_validated() -> None:
    assert scenario_from_dict(_raw()).phase(2).group_start == "base"  # the paper's default
    with pytest.raises(ScenarioError, match=r"phases\[1\]\.group_start: must be one of base, consortium \(got 'latest'\)"):
        scenario_from_dict(_raw(group_start="latest"))
    raw = _raw()
    raw["phases"][0]["group_start"] = "consortium"
    with pytest.raises(ScenarioError, match=r"phases\[0\]\.group_start: only a hierarchical phase"):
        scenario_from_dict(raw)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_new_group_starts_from_the_consortium_model(tmp_path) -> None:
    """group_start = "consortium": group B's first node trains from group A's fused extractor,
    published by an A member (its model record names that blob as its start; by default it
    names the consortium's base file)."""
    scn = scenario_from_dict(_raw(group_start="consortium"))
    phases, _ = run_vgs_memory(scn, load_scenario_data(scn), tmp_path)
    notes = phases[1].notes
    start = [n for n in notes if n.startswith("group B starts from group A's extractor")]
    assert start, notes
    assert phases[1].outcomes["c1"].startswith("combined 2 groups"), phases[1].outcomes
    homes = {n: NodeHome.at(tmp_path / "homes" / n) for n in ("a1", "a2", "c1")}
    keys = {NodeIdentity.load(h).public_key: n for n, h in homes.items()}
    with Ledger.open(homes["c1"].ledger_db) as led:  # the extractors group A's members published
        a_extractors = {e.body["blob"] for e in led.query(kind="weights")
                        if keys.get(e.author) in ("a1", "a2") and e.body["part"] == "extractor"}
    assert a_extractors
    starts = {r.provenance.get("init_from") for r in ModelRegistry(homes["c1"]).list()
              if r.provenance.get("run_key")}  # its trained models (aggregates have none)
    # c1 trained from group A's horizontal model (published by a1 or a2), not from the base file
    assert starts and starts <= a_extractors, (starts, a_extractors)
