"""A plan file as a netsim scenario (netsim.plan): the nodes carry it out with `atd plan`'s functions.

Three real daemons on the in-memory network (simulated time) carry out a small VGS-ATD plan
(a base, two fine-tunes from it, a horizontal aggregate on every member, a classify): the
report has every member's step, the aggregates verify, and the same aggregation called
directly on a node's home gives the very blob the plan signed. The scenario's evaluation
scores each node's resulting model, and node1's classify step reports the same accuracy.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli_w

from ledger import Ledger
from netsim.run import run_scenario
from netsim.scenario import ScenarioError, scenario_from_dict

NODES = ["node1", "node2", "node3"]
ENSEMBLE = {"pca_components": 8, "mlp_hidden": "16", "mlp_max_iter": 40, "rf_trees": 10}
PLAN = {
    "name": "netsim-plan",
    "model": {"name": "vit_tiny_patch16_224", "img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "heads": 2,
              "in_chans": 1},
    "steps": [
        {"id": "base", "kind": "train", "members": ["node1"], "data": "own", "epochs": 2, "lr": 3e-3,
         "augment": False},
        {"id": "base_pub", "kind": "publish", "members": ["node1"], "model": "base"},
        {"id": "tune", "kind": "train", "members": ["node2", "node3"], "data": "own", "init_from": "base_pub",
         "epochs": 1, "lr": 1e-3, "augment": False},
        {"id": "pub", "kind": "publish", "members": ["node2", "node3"], "model": "tune"},
        {"id": "h", "kind": "aggregate", "members": NODES, "mode": "horizontal", "inputs": ["base_pub", "pub"],
         **ENSEMBLE},
        {"id": "eval", "kind": "classify", "members": ["node1"], "data": "own"},
    ],
}
SCENARIO = {
    "scenario": {"name": "plan", "seed": 1, "methods": ["plan"], "plan": "plan.toml", "step_deadline_s": 30},
    "model": {"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2, "in_chans": 1},
    "topology": {"degree": 2, "poll_interval_s": 0.2},
    "datasets": [{"name": "digits", "spec": "digits"}],
    "cohorts": [{"name": "h", "nodes": NODES, "dataset": "digits", "partition": "iid", "train_samples": 450,
                 "test_samples": 60}],
}


def _scenario(tmp: Path, doc: dict = PLAN, **scenario):
    (tmp / "plan.toml").write_text(tomli_w.dumps(doc))
    raw = json.loads(json.dumps(SCENARIO))
    raw["scenario"].update(scenario)
    raw["scenario"] = {k: v for k, v in raw["scenario"].items() if v is not None}  # None: the key left out
    return scenario_from_dict(raw, source="plan.toml", base_dir=tmp)


@pytest.mark.slow  # three tiny trainings and three aggregations on three in-memory daemons
@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # the MLP's capped iterations
def test_plan_scenario_matches_the_steps_called_directly(tmp_path, short_tmp):
    from atdnode.aggregation import EnsembleOptions, run_aggregate
    from atdnode.node import NodeHome

    report = run_scenario(_scenario(tmp_path), tmp_path / "out", keep_homes=short_tmp)  # control sockets: short paths
    plan = report["plan"]
    assert plan["complete"] and plan["proposer"] == "node1"
    assert [(r["step"], r["member"], r["state"]) for r in plan["steps"]] == [
        ("base", "node1", "done"), ("base_pub", "node1", "done"), ("tune", "node2", "done"),
        ("tune", "node3", "done"), ("pub", "node2", "done"), ("pub", "node3", "done"), ("h", "node1", "done"),
        ("h", "node2", "done"), ("h", "node3", "done"), ("eval", "node1", "done")]
    rows = {(r["step"], r["member"]): r for r in plan["steps"]}
    homes = {n: NodeHome.at(next(short_tmp.glob(f"atd-netsim-*/plan/homes/{n}"))) for n in NODES}
    pubs = [rows[("base_pub", "node1")]["results"][0], rows[("pub", "node2")]["results"][0],
            rows[("pub", "node3")]["results"][0]]
    blobs = set()
    for n in NODES:  # every member fused the three published extractors, in the plan's order
        with Ledger.open(homes[n].ledger_db) as led:
            body = led.get(rows[("h", n)]["results"][0]).body
        assert body["inputs"] == pubs and body["mode"] == "horizontal"
        blobs.add(body["blob"])
    assert len(blobs) == 1  # the same inputs give every member the same fused extractor
    ph = report["methods"]["plan"][0]
    assert ph["verified"] == {"aggregates": 3, "verified": 3}
    # the same step called directly (`atd aggregate --mode horizontal --inputs ...`) on node2's home
    opts = EnsembleOptions(pca_components=8, mlp_hidden=(16,), mlp_max_iter=40, rf_trees=10)
    direct = run_aggregate(homes["node2"], "horizontal", inputs=pubs, options=opts)
    assert direct.blob in blobs
    # netsim's evaluation scores each node's resulting model: node1's is its aggregate's, which its
    # classify step scored on the same test split (the same number)
    assert plan["models"]["node1"] == rows[("h", "node1")]["model"] == rows[("eval", "node1")]["model"]
    assert ph["per_node"]["node1"]["accuracy"] == pytest.approx(rows[("eval", "node1")]["metrics"]["accuracy"])
    assert set(ph["per_node"]) == set(NODES) and all("accuracy" in m for m in ph["per_node"].values())
    assert ph["overall"]["accuracy"] > 3 * 0.1, ph["overall"]  # ten balanced classes: chance is 0.1
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Plan 'netsim-plan'" in md and "| h | aggregate | node3 | done |" in md


def test_plan_scenario_is_checked_at_load(tmp_path):
    """A plan no node can carry out, or one that does not fit the scenario, is refused with the key."""
    with pytest.raises(ScenarioError, match=r"scenario\.plan: plan\.toml: member 'node4' is not a node"):
        _scenario(tmp_path, dict(PLAN, steps=[dict(PLAN["steps"][0], members=["node4"])]))
    with pytest.raises(ScenarioError, match="unknown step kind 'shell'"):
        _scenario(tmp_path, dict(PLAN, steps=[dict(PLAN["steps"][0], kind="shell")]))
    with pytest.raises(ScenarioError, match=r"model\.img_size: 8 differs from the plan's ViT \(16\)"):
        _scenario(tmp_path, dict(PLAN, model=dict(PLAN["model"], img_size=16)))
    with pytest.raises(ScenarioError, match=r"scenario\.plan: add \"plan\" to \[scenario\] methods"):
        _scenario(tmp_path, methods=["local"])
    with pytest.raises(ScenarioError, match=r"scenario\.methods: \"plan\" carries out a plan file"):
        _scenario(tmp_path, plan=None)
    with pytest.raises(ScenarioError, match="elsewhere.toml: no such plan file"):
        _scenario(tmp_path, plan="elsewhere.toml")
    scn = _scenario(tmp_path)
    assert scn.plan == str(tmp_path / "plan.toml")  # relative to the scenario file
    from netsim.scenario import load_scenario

    example = Path(__file__).resolve().parents[1] / "examples" / "netsim_vgs_plan.toml"
    assert load_scenario(example).plan == str(example.parent / "vgs.toml")  # the README's example loads


def test_cli_plan_option_refuses_a_plan_the_nodes_cannot_carry_out(tmp_path, capsys):
    """`atd netsim run SCENARIO --plan FILE`: a plan naming a node the scenario lacks is one line, exit 1."""
    from cli.app import run

    raw = json.loads(json.dumps(SCENARIO))
    raw["scenario"].pop("plan")
    raw["scenario"]["methods"] = ["local"]
    (tmp_path / "scn.toml").write_text(tomli_w.dumps(raw))
    (tmp_path / "bad.toml").write_text(tomli_w.dumps(dict(PLAN, steps=[dict(PLAN["steps"][0], members=["h9"])])))
    capsys.readouterr()
    assert run(["netsim", "run", str(tmp_path / "scn.toml"), "--plan", str(tmp_path / "bad.toml"),
                "--out", str(tmp_path / "out")]) == 1
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1 and "member 'h9' is not a node of this scenario" in err
    assert not (tmp_path / "out").exists()  # refused before anything ran
