"""netsim's process back-end: real `atd node start` daemons as OS processes on 127.0.0.1,
driven through their ledgers and control sockets; faults with deadlines and outcomes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from netsim.netns import netns_available
from netsim.run import run_gossip_scenario
from netsim.scenario import scenario_from_dict

pytestmark = pytest.mark.slow


def scenario(faults: list, nodes: int = 3, entries: int = 18, **network) -> object:
    return scenario_from_dict({
        "scenario": {"name": "procs", "seed": 5, "backend": "process"},
        "network": network,
        "topology": {"nodes": nodes, "degree": 2, "sync_interval_s": 1},
        "workload": {"entries": entries, "entry_bytes": 128, "interval_s": 0.02, "deadline_s": 90},
        "faults": faults,
    })


def test_kill_restart_and_late_join_with_real_daemons(tmp_path: Path) -> None:
    rep = run_gossip_scenario(scenario([
        {"kind": "kill", "node": "n1", "at_s": 0.1},
        {"kind": "late_join", "node": "n3", "at_s": 0.5},
        {"kind": "restart", "node": "n1", "at_s": 1.0},
    ], nodes=4), tmp_path)
    assert [f["status"] for f in rep["faults"]] == ["done", "done", "done"], rep["faults"]
    assert rep["entries"] >= 14  # n3 publishes nothing before it joins
    assert rep["converged"], rep
    for name, n in rep["nodes"].items():
        assert n["status"] == "running" and n["complete"] and n["held"] == rep["entries"], name
        assert n["bytes"]["received"] > 0
    assert any("127.0.0.1" in note for note in rep["notes"])


def test_leave_and_network_faults_have_recorded_outcomes(tmp_path: Path) -> None:
    rep = run_gossip_scenario(scenario([
        {"kind": "partition", "groups": [["n0"], ["n1", "n2"]], "at_s": 0.0},
        {"kind": "heal", "at_s": 0.2},
        {"kind": "leave", "node": "n2", "at_s": 0.3},
    ], namespaces="auto"), tmp_path)
    statuses = {f["kind"]: f for f in rep["faults"]}
    ok, why = netns_available()
    if ok:
        assert statuses["partition"]["status"] == "done"
    else:  # said clearly, and the run goes on without
        assert statuses["partition"]["status"] == "unsupported"
        assert "namespaces" in statuses["partition"]["detail"]
        assert any("not available" in n and why.split(":")[0] in n for n in rep["notes"])
    assert statuses["leave"]["status"] == "done" and rep["nodes"]["n2"]["status"] == "left"
    assert rep["converged"] and rep["nodes"]["n0"]["complete"] and rep["nodes"]["n1"]["complete"]
    json.dumps(rep)  # the report is plain JSON


def test_vgs_horizontal_and_vertical_with_real_daemons(tmp_path: Path) -> None:
    """What `atd demo` does, at the smallest size: weights and sealed features move between
    daemon processes; the byte counts come from the daemons."""
    from netsim.nodedata import load_scenario_data
    from netsim.procnet import run_vgs_process

    scn = scenario_from_dict({
        "scenario": {"name": "procs-vgs", "seed": 2, "backend": "process", "methods": ["vgs-atd"],
                     "step_deadline_s": 60},
        "model": {"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2},
        "train": {"epochs": 1, "freeze_blocks": 0},
        "ensemble": {"pca_components": 6, "mlp_epochs": 20},
        "topology": {"sync_interval_s": 1},
        "datasets": [{"name": "digits", "spec": "digits"}],
        "cohorts": [{"name": "a", "nodes": ["a1", "a2"], "dataset": "digits", "classes": ["0", "1"],
                     "train_samples": 60, "test_samples": 20},
                    {"name": "b", "phase": 2, "nodes": ["b1"], "dataset": "digits", "classes": ["2", "3"],
                     "train_samples": 40, "test_samples": 20}],
    })
    phases, faults, notes = run_vgs_process(scn, load_scenario_data(scn), tmp_path)
    assert faults == [] and any("127.0.0.1" in n or "namespaces" in n for n in notes)
    p1, p2 = phases
    done = "global model, horizontal (2/2 inputs, features from 1 peer(s))"
    assert p1.outcomes == {"a1": done, "a2": done}
    assert all(o == "fused extractor, vertical (2/2 inputs, features from 2 peer(s))" for o in p2.outcomes.values()), p2.outcomes
    assert (p1.verified, p2.verified) == ({"aggregates": 4, "verified": 4}, {"aggregates": 6, "verified": 6})
    assert p2.overall["accuracy"] > 1.6 / 4  # 4 classes, balanced pooled test set
    assert all(b["received"] > 10_000 for b in p2.bytes.values())  # weights + sealed features arrived
