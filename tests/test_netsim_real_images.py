"""The real-image scenarios (netsim/scenarios/breastmnist.toml, retinamnist.toml): sites with
given class shares (`class_shares` partition), each site's val split carved from its share,
and a one-line error naming the file when the shared data set is missing."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from atdnode.errors import DataError
from netsim.nodedata import load_scenario_data
from netsim.partition import partition_cohort
from netsim.scenario import ScenarioError, load_scenario, scenario_from_dict

SCENARIOS = Path(__file__).resolve().parents[1] / "netsim" / "scenarios"


def test_class_shares_give_each_site_its_class_ratio_and_equal_sizes() -> None:
    labels = np.repeat([0, 1], [170, 460])  # BreastMNIST's train + val counts
    shares = ((0.4, 0.6), (0.1, 0.9), (0.9, 0.1))
    parts = partition_cohort(nodes=("s1", "s2", "s3"), train_labels=labels, test_labels=np.array([0, 1]),
                             names=["0", "1"], scheme="class_shares", seed=0, shares=shares)
    sizes = [len(p.train) for p in parts]
    assert len(set(sizes)) == 1 and int(170 / 1.4) - 2 <= sizes[0] <= int(170 / 1.4)  # the most class 0 allows
    for p, (neg, _) in zip(parts, shares):
        assert abs((labels[p.train] == 0).mean() - neg) < 0.02, p.node
    flat = np.concatenate([p.train for p in parts])
    assert len(np.unique(flat)) == len(flat)  # disjoint
    with pytest.raises(ScenarioError, match="class_shares needs 3 lists of 2"):
        partition_cohort(nodes=("s1", "s2", "s3"), train_labels=labels, test_labels=labels, names=["0", "1"],
                         scheme="class_shares", seed=0, shares=((1.0,), (1.0,), (1.0,)))


@pytest.mark.parametrize("name", ["breastmnist", "retinamnist"])
def test_shipped_scenarios_read_the_shared_sets_and_carve_val_per_site(name: str) -> None:
    scn = load_scenario(SCENARIOS / f"{name}.toml")
    assert scn.val_fraction > 0 and len(scn.cohorts[0].nodes) == 3
    assert scn.datasets[0].spec.endswith(f"shared/data/medmnist/{name}.npz")


def test_a_missing_data_set_is_one_line_naming_the_file(tmp_path: Path) -> None:
    scn = scenario_from_dict({
        "scenario": {"name": "m", "val_fraction": 0.2},
        "model": {"img_size": 8, "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2, "in_chans": 1},
        "datasets": [{"name": "b", "spec": f"npz:{tmp_path / 'breastmnist.npz'}"}],
        "cohorts": [{"name": "s", "dataset": "b", "partition": "class_shares", "class_shares": [[1, 1], [1, 3]],
                     "nodes": ["s1", "s2"]}],
        "phases": [{"phase": 1, "mode": "vertical"}]})
    with pytest.raises(DataError) as exc:
        load_scenario_data(scn)
    assert str(exc.value) == f"{tmp_path / 'breastmnist.npz'}: no such file"
    with pytest.raises(ScenarioError, match="class_shares"):  # shares without the scheme
        scenario_from_dict({"scenario": {"name": "m"}, "datasets": [{"name": "b", "spec": "digits"}],
                            "cohorts": [{"name": "s", "dataset": "b", "class_shares": [[1, 1]], "nodes": ["s1"]}],
                            "phases": [{"phase": 1, "mode": "vertical"}]})


@pytest.mark.slow  # fits an ensemble per site
@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_each_sites_own_raw_ensemble_is_scored_with_intervals_and_auroc() -> None:
    import json

    from netsim.references import OWN_RAW, run_reference
    from tests.netsim_tiny import TINY

    raw = json.loads(json.dumps(TINY))
    raw["cohorts"] = raw["cohorts"][:1]  # one phase, two sites
    scn = scenario_from_dict(raw)
    data = load_scenario_data(scn)
    own, pooled = (run_reference(k, scn, data, log=lambda _m: None) for k in (OWN_RAW, "ensemble-raw"))
    for res_own, res_pooled in zip(own, pooled):
        for n, m in res_own.per_node.items():
            chance = 1 / len(data.nodes[n].classes)
            assert m["balanced_accuracy"] > chance + 0.2, (n, m)  # real pixels of its own data carry signal
            lo, hi = m["accuracy_ci95"]
            assert 0 <= lo <= m["accuracy"] <= hi <= 1
            assert m["balanced_accuracy_ci95"][0] <= m["balanced_accuracy"] <= m["balanced_accuracy_ci95"][1]
            assert m["auroc"] > 0.7 and m["auroc_ci95"][0] <= m["auroc"] <= m["auroc_ci95"][1], (n, m)  # chance 0.5
            assert "own" in res_own.outcomes[n] and "pooled" in res_pooled.outcomes[n]
    for res in own + pooled:
        assert res.overall["auroc_ci95"][0] <= res.overall["auroc"] <= res.overall["auroc_ci95"][1]
    # fitted on less data than the pooled reference: not the same numbers
    assert [r.overall["accuracy"] for r in own] != [r.overall["accuracy"] for r in pooled]
