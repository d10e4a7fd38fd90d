"""The VGS-ATD three-phase runner and the baselines on a tiny scenario (in-memory back-end:
real daemons, real training, simulated network)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from atdnode.blobs.fs import durable
from netsim.nodedata import load_scenario_data
from netsim.report import strip_timing
from netsim.run import run_scenario, run_vgs_memory
from netsim.scenario import scenario_from_dict
from tests.netsim_tiny import TINY

# every test here runs netsim's learning (several trained ViTs per scenario): 28 s of CPU in all
# (the per-baseline runs are checked on tests/test_vgs_claims.py's run, in the claims tier)
pytestmark = pytest.mark.slow

torch.set_num_threads(1)


def tiny(**scenario) -> object:
    raw = json.loads(json.dumps(TINY))
    raw["scenario"].update(scenario)
    return scenario_from_dict(raw)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[dict, dict]:
    """One VGS-ATD run with an observer counting every byte the simulated links carry."""
    seen: dict[str, dict[str, int]] = {}

    def observe(src: str, dst: str, kind: str, nbytes: int, delivered: bool) -> None:
        if delivered:
            seen.setdefault(src, {"sent": 0, "received": 0})["sent"] += nbytes
            seen.setdefault(dst, {"sent": 0, "received": 0})["received"] += nbytes

    scn = tiny()
    data = load_scenario_data(scn)
    phases, faults = run_vgs_memory(scn, data, tmp_path_factory.mktemp("vgs"), observer=observe)
    return {"phases": [p.to_dict() for p in phases], "faults": faults}, seen


def test_three_phases_produce_predictors_and_metrics(first_run) -> None:
    rep, _ = first_run
    ph = rep["phases"]
    assert [p["phase"] for p in ph] == [1, 2, 3]
    assert set(ph[0]["per_node"]) == {"a1", "a2"} and set(ph[2]["per_node"]) == {"a1", "a2", "b1", "c1", "c2"}
    assert ph[0]["outcomes"]["a1"] == "global model, horizontal (2/2 inputs, features from 1 peer(s))"
    assert ph[1]["outcomes"]["b1"] == "fused extractor, vertical (2/2 inputs, features from 2 peer(s))"
    assert ph[2]["outcomes"]["c1"] == "combined 2 groups (sqrt-classes) (2/2 inputs, features from 4 peer(s))"
    # C_i and n_i come from the signed entries: group A is the phase-2 vertical aggregate over
    # a's phase-1 model (2 base models) and b1's extractor; group B is c's horizontal aggregate
    assert "group sizes (from the signed entries): A (5 classes, 3 models), B (5 classes, 2 models)" in ph[2]["notes"]
    # both groups start from the consortium's shared base: no aggregation warned about bases
    assert not any("shared base" in n or "different starts" in n for p in ph for n in p["notes"]), ph[2]["notes"]
    # every aggregate entry (two per aggregating node: before and after the features round)
    # re-verifies with `atd aggregate --verify`
    assert [p["verified"] for p in ph] == [{"aggregates": n, "verified": n} for n in (4, 6, 14)]
    data = load_scenario_data(tiny())
    for p, chance in zip(ph, (1 / 3, 1 / 5, 1 / 5)):
        for n, m in p["per_node"].items():
            assert set(m) >= {"accuracy", "precision", "sensitivity", "f1"}
            # a constant predictor scores at most the majority share of the node's test labels
            majority = float(np.bincount(data.nodes[n].test.labels.numpy()).max() / len(data.nodes[n].test))
            assert m["accuracy"] > majority, (p["phase"], n, m["accuracy"], majority)
        # measured 0.83 / 0.88 / 0.85 (rf_trees 100: 0.85 / 0.90 / 0.86): at least twice chance (balanced test sets)
        assert p["overall"]["accuracy"] > 2 * chance
        assert p["compute_s"] > 0 and p["ready_s"] > 0
    assert not any("no " in n and "from" in n for p in ph for n in p["notes"])  # no wait ran out
    # no val split (the default): every number scores the consortium's model, untagged (netsim.vgs_keep)
    assert not any("model" in m for p in ph for m in p["per_node"].values())
    assert durable()  # the simulation's volatile disk (no fsync) ended with it


def test_report_bytes_match_the_transport(first_run) -> None:
    rep, seen = first_run
    from netsim.homes import node_seed
    from ledger import Signer

    pid = {n: Signer.from_seed(node_seed(1, n)).peer_id for n in ("a1", "a2", "b1", "c1", "c2")}
    for n, p in pid.items():
        total = {k: sum(ph["bytes"].get(n, {}).get(k, 0) for ph in rep["phases"]) for k in ("sent", "received")}
        assert total == seen[p], n
        assert total["sent"] > 0 and total["received"] > 0
    # weights and sealed features are far bigger than the gossip around them
    assert sum(v["received"] for v in rep["phases"][2]["bytes"].values()) > 100_000


def test_a_killed_node_is_waited_for_with_a_deadline(tmp_path: Path) -> None:
    raw = json.loads(json.dumps(TINY))
    raw["cohorts"] = raw["cohorts"][:2]
    raw["scenario"]["step_deadline_s"] = 20
    raw["faults"] = [{"kind": "partition", "groups": [["a1", "a2"], ["b1"]], "at_phase": 2},
                     {"kind": "kill", "node": "a2", "at_phase": 2}]
    scn = scenario_from_dict(raw)
    phases, faults = run_vgs_memory(scn, load_scenario_data(scn), tmp_path)
    assert [f["status"] for f in faults] == ["done", "done"]
    p2 = phases[1]
    assert p2.outcomes["a2"] == "killed before phase 2"
    assert "status" in p2.per_node["a2"]  # no metrics for a dead node
    assert any("b1: no" in n for n in p2.notes)  # b1 could not get the base extractor: recorded
    assert "accuracy" in p2.per_node["a1"]  # a1 still predicts (its own features only)


def test_same_seed_same_report_and_run_scenario_writes_it(first_run, tmp_path: Path) -> None:
    """`run_scenario` (the API of `atd netsim run`) on the same scenario runs VGS-ATD again:
    the same seed gives the same report, byte counts included; it adds the honest baselines
    and writes the report files."""
    rep, _ = first_run
    raw = json.loads(json.dumps(TINY))
    raw["scenario"]["methods"] = ["vgs-atd", "local"]
    out = tmp_path / "out"
    again = run_scenario(scenario_from_dict(raw), out)
    assert strip_timing(again["methods"]["vgs-atd"]) == strip_timing(rep["phases"])
    assert again["vgs_faults"] == rep["faults"]
    for f in ("report.json", "report.md", "accuracy.png", "bytes.png", "forgetting.png"):
        assert (out / f).stat().st_size > 0, f
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    assert "| vgs-atd | 1 |" in md and "| local | 1 |" in md
    assert "VGS-ATD phase 1: 4/4 aggregate entries verified" in md  # 2 nodes x 2 passes
    # the honest baselines travel with the claim: centralized, local, the same
    # ensemble on raw inputs and on an untrained extractor, and one verdict sentence per phase
    assert {"centralized", "local", "ensemble-raw", "ensemble-untrained"} <= set(again["methods"])
    for m in ("ensemble-raw", "ensemble-untrained"):
        assert f"| {m} | 1 |" in md and again["methods"][m][0]["overall"]["nodes"] == 2
    verdicts = again["feature_verdicts"]
    assert len(verdicts) == 3
    for p, verdict in zip((1, 2, 3), verdicts):
        assert verdict.startswith(f"Phase {p}: the learned features ") and verdict in md
    assert json.loads((out / "report.json").read_text())["forgetting"]["vgs-atd"]["1"] is not None
    assert set(again["nodes"]) == {"a1", "a2", "b1", "c1", "c2"}


def test_cli_netsim_run_and_errors(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.app import app
    from netsim.scenario import ScenarioError

    f = tmp_path / "s.toml"
    f.write_text('[scenario]\nname = "cli"\nmethods = ["local", "centralized"]\n'
                 '[model]\nimg_size = 8\npatch_size = 4\nembed_dim = 16\ndepth = 1\n[train]\nepochs = 1\n'
                 '[[datasets]]\nname = "digits"\nspec = "digits"\n'
                 '[[cohorts]]\nname = "a"\nnodes = ["h1", "h2"]\ndataset = "digits"\ntrain_samples = 100\n')
    runner = CliRunner()
    res = runner.invoke(app, ["netsim", "run", str(f), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "centralized" in res.output and (tmp_path / "out" / "report.md").is_file()
    res = runner.invoke(app, ["netsim", "run", str(f), "--backend", "cloud"])  # a usage error listing the choices
    assert res.exit_code == 2 and "'cloud' is not one of 'memory', 'process'" in res.output, res.output
    res = runner.invoke(app, ["netsim", "run", "no_such_scenario"])
    assert isinstance(res.exception, ScenarioError) and "no shipped scenario" in str(res.exception)
