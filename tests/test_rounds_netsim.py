"""An aggregate that arrives before its inputs, as netsim met it: the FedAvg baseline's phases back to back in one
process (netsim.baselines.run_rounds_method: one `atd rounds` campaign per phase among real
daemons on the in-memory network, each phase starting from the last one's global model).

With gossip loss, an entry can reach a node later than an aggregate naming it (it comes by
sync instead). Before the fix, the node adopting that aggregate failed at once with
`aggregate ...: input ... is not a weights entry of its round` (this test, on the old code,
in 2 runs of 2); now it waits for the input until the round's deadline."""
from __future__ import annotations

import json

import pytest
import torch

from netsim.baselines import run_rounds_method
from netsim.nodedata import load_scenario_data
from netsim.scenario import scenario_from_dict

pytestmark = pytest.mark.slow  # two campaigns of six daemons (about 20 s alone, 45 s on a loaded 2-core machine)

torch.set_num_threads(1)

TWO_PHASES = {
    "scenario": {"name": "fedavg-phases", "seed": 0, "methods": ["fedavg"], "step_deadline_s": 60},
    "model": {"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2},
    "train": {"epochs": 1, "lr": 3e-3},
    "baselines": {"rounds": 1},
    "network": {"latency_ms": 20, "loss": 0.4},  # gossip loss: entries also arrive by sync, out of order
    "datasets": [{"name": "digits", "spec": "digits"}],
    "cohorts": [{"name": "a", "phase": 1, "nodes": ["a1", "a2", "a3"], "dataset": "digits", "classes": ["0", "1", "2"],
                 "partition": "iid", "train_samples": 60, "test_samples": 20},
                {"name": "b", "phase": 2, "nodes": ["b1", "b2", "b3"], "dataset": "digits", "classes": ["3", "4", "5"],
                 "partition": "iid", "train_samples": 60, "test_samples": 20}],
}


def test_fedavg_baseline_phases_back_to_back_with_out_of_order_entries() -> None:
    scn = scenario_from_dict(json.loads(json.dumps(TWO_PHASES)))
    results = run_rounds_method("fedavg", scn, load_scenario_data(scn), log=lambda _m: None)
    assert [r.phase for r in results] == [1, 2]
    for r in results:
        assert not any("different global models" in n for n in r.notes), r.notes
        assert set(r.outcomes.values()) == {"global model"} and r.overall["nodes"] == len(r.per_node)
    assert len(results[1].per_node) == 6  # phase 2: the first cohort and the new one
