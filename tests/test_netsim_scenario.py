"""netsim scenario files and partitions: validation errors name the key; partitions are
deterministic, disjoint and shaped as asked."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from netsim.partition import label_skew, partition_cohort, quantity_skew
from netsim.scenario import ScenarioError, load_scenario, scenario_from_dict, shipped_scenario

BASE = {"scenario": {"name": "t"}, "datasets": [{"name": "digits", "spec": "digits"}],
        "cohorts": [{"name": "a", "nodes": ["h1", "h2"], "dataset": "digits"}]}


def with_(**sections) -> dict:
    raw = {k: (dict(v) if isinstance(v, dict) else list(v)) for k, v in BASE.items()}
    for k, v in sections.items():
        raw[k] = v
    return raw


def test_shipped_scenarios_load() -> None:
    for name in ("three_phase", "demo", "demo_quick"):
        s = load_scenario(shipped_scenario(name))
        assert s.learning and s.phase_numbers() == [1, 2, 3]
        assert [s.phase(p).mode for p in (1, 2, 3)] == ["horizontal", "vertical", "hierarchical"]


@pytest.mark.parametrize("raw, where", [
    (with_(scenario={"name": "t", "backend": "cloud"}), "scenario.backend"),
    (with_(scenario={"name": "t", "methods": ["fedsgd"]}), "scenario.methods"),
    (with_(scenario={"seed": 1}), "missing required key name"),
    (with_(model={"img_size": 10, "patch_size": 4}), "model.patch_size"),
    (with_(model={"depth": "two"}), "model.depth"),
    (with_(model={"mlp_ratio": 0}), "model.mlp_ratio"),
    (with_(model={"stem": "cnn"}), "model.stem: must be one of patch, conv"),
    (with_(model={"stem": "conv", "img_size": 18, "patch_size": 6}), "model.patch_size: stem conv needs a patch_size"),
    (with_(scenario={"name": "t", "base": "msd"}, model={"stem": "conv"}), "model.stem: the MSD base"),
    (with_(train={"freeze_blocks": 9}), "train.freeze_blocks"),
    (with_(network={"loss": 1.5}), "network.loss"),
    (with_(cohorts=[{"name": "a", "nodes": ["h1"], "dataset": "mnist"}]), "cohorts[0].dataset"),
    (with_(cohorts=[{"name": "a", "nodes": ["h1"], "dataset": "digits", "partition": "dirichlet"}]),
     "cohorts[0].partition"),
    (with_(cohorts=[{"name": "a", "nodes": ["h1", "h1"], "dataset": "digits"}]), "used twice"),
    (with_(cohorts=[{"name": "a", "nodes": ["h1"], "dataset": "digits", "phase": 2}]), "phases must be 1, 2"),
    (with_(cohorts=[{"name": "a", "nodes": ["h1", "h2"], "dataset": "digits", "partition": "disjoint",
                     "class_sets": [["1"], ["1"]]}]), "disjoint"),
    (with_(faults=[{"kind": "kill", "at_s": 1}]), "needs node"),
    (with_(faults=[{"kind": "kill", "node": "zz", "at_s": 1}]), "unknown node"),
    (with_(faults=[{"kind": "kill", "node": "h1"}]), "exactly one of at_s"),
    (with_(faults=[{"kind": "partition", "groups": [["h1"]], "at_s": 0}]), "at least two groups"),
    (with_(faults=[{"kind": "slow_link", "a": "h1", "b": "h2", "at_s": 0}]), "needs latency_ms"),
    (with_(faults=[{"kind": "meteor", "at_s": 0}]), "faults[0].kind"),
    (with_(workload={"entries": 0}), "workload.entries"),
    (with_(bogus={}), "unknown section"),
    (with_(train={"epochz": 3}), "unknown key(s) epochz"),
    (with_(train={"seed": 3}), "unknown key(s) seed"),  # the scenario's seed decides each node's
    (with_(ensemble={"mlp_epochs": 30, "mlp_max_iter": 30}), "keep mlp_max_iter"),
    (with_(ensemble={"rf_trees": "many"}), "ensemble.rf_trees"),
])
def test_bad_scenarios_name_the_key(raw: dict, where: str) -> None:
    with pytest.raises(ScenarioError, match=None) as err:
        scenario_from_dict(raw, source="x.toml")
    assert where in str(err.value) and str(err.value).startswith("x.toml")


# one valid table of each array section, for a key of it to be set beside
VALID_ROW = {"datasets": BASE["datasets"][0], "cohorts": BASE["cohorts"][0], "phases": {"phase": 1, "mode": "horizontal"},
             "faults": {"kind": "kill", "node": "h1", "at_s": 0}, "network.links": {"a": "h1", "b": "h2"}}


def test_every_declared_key_refuses_a_wrong_value_naming_itself() -> None:
    """Each key of each section (the one declaration, netsim.scenario_spec.SECTIONS) is checked
    as it is read: a table where a value belongs is a one-line error naming file and key."""
    from netsim.scenario_spec import SECTIONS, keys_of

    seen = 0
    for sec in SECTIONS:
        for k in keys_of(sec):
            name = k.path.rpartition(".")[2]
            if sec.many:
                row = {**VALID_ROW[sec.name], name: {"x": 1}}
                raw = (with_(network={"links": [row]}) if sec.name == "network.links" else with_(**{sec.name: [row]}))
                where = k.path.replace("[]", "[0]")
            else:
                raw = with_(**{sec.name: {**BASE.get(sec.name, {}), name: {"x": 1}}})
                where = k.path
            with pytest.raises(ScenarioError) as err:
                scenario_from_dict(raw, source="x.toml")
            assert str(err.value).startswith(f"x.toml: {where}: must be "), (k.path, str(err.value))
            assert "\n" not in str(err.value)
            seen += 1
    assert seen > 90  # every section's keys, not a few


def test_a_scenario_changed_after_loading_is_checked_against_the_declaration() -> None:
    """`validate` (run by the CLI after --backend / --base / --method overrides) checks each key again."""
    from netsim.scenario import validate

    s = scenario_from_dict(BASE, source="x.toml")
    validate(s.replace(backend="process", methods=("local",)))
    for change, where in (({"backend": "cloud"}, "scenario.backend"), ({"methods": ("local", "fedsgd")}, "scenario.methods"),
                          ({"base": "imagenet"}, "scenario.base"), ({"deadline_s": 0.0}, "scenario.deadline_s")):
        with pytest.raises(ScenarioError, match=rf"^x\.toml: {where}: must be "):
            validate(s.replace(**change))


def test_model_stem_reads_into_the_config_the_nodes_build() -> None:
    """[model] stem = "conv" reaches the ModelConfig netsim's nodes resolve (netsim.learn)."""
    from netsim.learn import model_config

    s = scenario_from_dict(with_(model={"stem": "conv"}))
    assert s.model.stem == "conv" and scenario_from_dict(BASE).model.stem == "patch"
    assert model_config(s.model, 3).stem == "conv" and model_config(s.model, 3).to_dict()["stem"] == "conv"


def test_unset_and_float_keys_read_as_declared() -> None:
    s = scenario_from_dict(with_(network={"bandwidth_mbps": "none", "latency_ms": 3},
                                 cohorts=[{"name": "a", "nodes": ["h1", "h2"], "dataset": "digits",
                                           "partition": "quantity_skew", "fractions": [1, 3]}]))
    assert s.network.bandwidth_mbps is None and s.network.latency_ms == 3.0 and type(s.network.latency_ms) is float
    assert s.cohorts[0].fractions == (1.0, 3.0) and s.cohorts[0].nodes == ("h1", "h2")


def test_train_and_ensemble_are_the_node_option_types() -> None:
    """[train] / [ensemble] fill the node's own TrainOptions / EnsembleOptions (one type, one
    name per knob): netsim's defaults below the scenario's keys; the older key mlp_epochs is read."""
    from atdnode.aggregation import EnsembleOptions
    from atdnode.learning import TrainOptions
    from netsim.scenario import NETSIM_ENSEMBLE, NETSIM_TRAIN

    s = scenario_from_dict(with_(train={"epochs": 2, "warmup_epochs": 0.0}, ensemble={"mlp_epochs": 30}))
    assert isinstance(s.train, TrainOptions) and isinstance(s.ensemble, EnsembleOptions)
    assert (s.train.epochs, s.train.warmup_epochs, s.train.lr) == (2, 0.0, NETSIM_TRAIN.lr)
    assert s.ensemble.mlp_max_iter == 30 and s.ensemble.pca_components == NETSIM_ENSEMBLE.pca_components
    assert scenario_from_dict(with_(ensemble={"mlp_max_iter": 30})).ensemble == s.ensemble
    assert scenario_from_dict(BASE).train.epochs == NETSIM_TRAIN.epochs and NETSIM_TRAIN.epochs == 3


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="no such scenario"):
        load_scenario(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[scenario\nname=")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(bad)


def test_relative_npz_paths_resolve_against_the_file(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text('[scenario]\nname="t"\n[[datasets]]\nname="m"\nspec="npz:data/x.npz?limit=5"\n'
                 '[[cohorts]]\nname="a"\nnodes=["h1"]\ndataset="m"\n')
    s = load_scenario(f)
    assert s.datasets[0].spec == f"npz:{tmp_path / 'data' / 'x.npz'}?limit=5"


LABELS = np.repeat(np.arange(10), 50)
NAMES = [str(i) for i in range(10)]


@pytest.mark.parametrize("scheme", ["iid", "label_skew", "quantity_skew", "disjoint"])
def test_partitions_are_deterministic_and_disjoint(scheme: str) -> None:
    kw = dict(nodes=("a", "b", "c"), train_labels=LABELS, test_labels=LABELS, names=NAMES, scheme=scheme,
              seed=7, salt="c", alpha=0.5)
    one, two = partition_cohort(**kw), partition_cohort(**kw)
    assert all(np.array_equal(x.train, y.train) for x, y in zip(one, two))
    seen = np.concatenate([s.train for s in one])
    assert len(seen) == len(set(seen.tolist())) == len(LABELS)  # disjoint and complete
    other = partition_cohort(**{**kw, "seed": 8})
    if scheme != "disjoint":
        assert any(not np.array_equal(x.train, y.train) for x, y in zip(one, other))
    if scheme == "disjoint":
        sets = [set(LABELS[s.train].tolist()) for s in one]
        assert not (sets[0] & sets[1]) and not (sets[1] & sets[2])


def test_skews_have_the_asked_shape() -> None:
    rng = np.random.default_rng(0)
    idx = np.arange(len(LABELS))
    parts = label_skew(idx, LABELS, 4, rng, alpha=0.1)
    # strong skew: most nodes are dominated by few classes
    top = [np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts]
    assert np.mean(top) > 0.3
    sizes = [len(p) for p in quantity_skew(idx, 3, rng, fractions=(0.6, 0.3, 0.1), min_per_node=0)]
    assert sizes == [300, 150, 50]


def test_cohorts_sharing_a_dataset_get_disjoint_samples() -> None:
    from netsim.nodedata import load_scenario_data

    raw = with_(model={"img_size": 8, "patch_size": 4},
                cohorts=[{"name": "a", "nodes": ["h1", "h2"], "dataset": "digits", "classes": ["0", "1"]},
                         {"name": "b", "phase": 2, "nodes": ["h3"], "dataset": "digits", "classes": ["1", "2"]}])
    data = load_scenario_data(scenario_from_dict(raw))
    assert data.nodes["h3"].classes == ["1", "2"] and data.nodes["h1"].classes == ["0", "1"]
    a = {tuple(x.flatten().tolist()) for n in ("h1", "h2") for x in data.nodes[n].train.images}
    b = {tuple(x.flatten().tolist()) for x in data.nodes["h3"].train.images}
    assert len(a & b) <= 2  # the digits set has a few exact duplicate images, nothing more
    assert data.classes_at(1) == ["0", "1"] and data.classes_at(2) == ["0", "1", "2"]


def test_an_npz_dataset_mixes_with_digits(tmp_path: Path) -> None:
    """MedMNIST-style .npz files named in a scenario join the embedded digits; with
    `namespace = true` a data set's class names are prefixed so they never merge."""
    from netsim.baselines import run_baseline
    from netsim.nodedata import load_scenario_data

    rng = np.random.default_rng(0)
    labels = np.tile(np.arange(3), 40)  # interleaved: train and test splits both balanced
    images = np.clip(rng.normal(60 + 60 * labels[:, None, None, None], 20, (120, 12, 12, 3)), 0, 255).astype(np.uint8)
    np.savez(tmp_path / "med.npz", train_images=images[:90], train_labels=labels[:90, None],
             test_images=images[90:], test_labels=labels[90:, None], classes=np.array(["a", "b", "c"]))
    raw = with_(model={"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1},
                train={"epochs": 8, "lr": 3e-3, "batch_size": 16},
                datasets=[{"name": "digits", "spec": "digits"}, {"name": "med", "spec": "npz:med.npz", "namespace": True}],
                cohorts=[{"name": "a", "nodes": ["h1"], "dataset": "digits", "classes": ["0", "1"]},
                         {"name": "b", "phase": 2, "nodes": ["m1"], "dataset": "med", "role": "imaging"}])
    f = tmp_path / "mix.toml"
    import tomli_w
    f.write_bytes(tomli_w.dumps(raw).encode())
    scn = load_scenario(f)
    assert scn.node_roles() == {"h1": "hospital", "m1": "imaging"}
    data = load_scenario_data(scn)
    assert data.label_space == ["0", "1", "med:a", "med:b", "med:c"]
    assert data.nodes["m1"].classes == ["med:a", "med:b", "med:c"] and len(data.nodes["m1"].test) == 30
    res = run_baseline("local", scn, data, log=lambda _m: None)
    # three balanced test classes: chance (and any constant predictor) is 1/3; they are easy
    assert res[1].per_node["m1"]["accuracy"] > 1.5 * (1 / 3)


def test_data_sets_sharing_class_names_share_the_classes(tmp_path: Path) -> None:
    """Three hospitals' own .npz files naming the same two classes make a two-class task
    (classes are matched by name), and a model trained on their union covers those two only."""
    from netsim.baselines import run_baseline
    from netsim.nodedata import load_scenario_data
    from netsim.partition import write_npz

    rng = np.random.default_rng(1)
    datasets, cohorts = [], []
    for k in range(3):
        labels = np.tile(np.arange(2), 40)  # interleaved: 30/30 train, 10/10 test
        images = np.clip(rng.normal(70 + 110 * labels[:, None, None], 25, (80, 8, 8)), 0, 255).astype(np.uint8)
        order = ["normal", "pneumonia"] if k != 1 else ["pneumonia", "normal"]  # same names, other order
        lab = labels if k != 1 else 1 - labels
        write_npz(tmp_path / f"h{k}.npz", images[:60], lab[:60], order, images[60:], lab[60:])
        datasets.append({"name": f"site{k}", "spec": f"npz:{tmp_path / f'h{k}.npz'}"})
        cohorts.append({"name": f"c{k}", "nodes": [f"h{k}"], "dataset": f"site{k}"})
    raw = with_(model={"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "in_chans": 1},
                train={"epochs": 6, "lr": 3e-3, "batch_size": 16}, datasets=datasets, cohorts=cohorts)
    data = load_scenario_data(scenario_from_dict(raw))
    assert sorted(data.label_space) == ["normal", "pneumonia"]
    assert all(sorted(d.classes) == ["normal", "pneumonia"] for d in data.nodes.values())
    pooled = data.pooled_test(1)
    assert pooled.classes == data.label_space and len(pooled) == 60
    res = run_baseline("centralized", scenario_from_dict(raw), data, log=lambda _m: None)
    assert pooled.labels.bincount().tolist() == [30, 30]  # both classes in the pooled test set
    # one model over the 2 shared classes, well above chance (0.5, any constant predictor) on the pooled test set
    assert res[0].overall["accuracy"] > 0.5 + 0.25


def test_interfaces_scenario_options_table_is_current():
    """INTERFACES.md's scenario-keys table is generated from their declaration (netsim.scenario_doc)."""
    from netsim import scenario_doc

    doc = Path(__file__).resolve().parent.parent / "INTERFACES.md"
    assert scenario_doc.update_doc(doc.read_text()) == doc.read_text(), "run: python -m netsim.scenario_doc INTERFACES.md"
    table = scenario_doc.options_markdown()
    assert "| `ensemble.mlp_max_iter` | int | `200` | an integer > 0 |" in table
    assert "| `cohorts[].partition` | str | `\"iid\"` | one of iid, label_skew," in table
    with pytest.raises(ValueError, match="no generated scenario-options section"):
        scenario_doc.update_doc("# no section\n")


def test_score_split_val_deals_and_scores_inside_the_training_split_and_never_reads_test() -> None:
    from atdnode.data import load_dataset, without_val
    from netsim.nodedata import load_scenario_data, to_uint8

    scn = load_scenario(shipped_scenario("demo_quick"))
    m = scn.model

    def rows(x) -> set[bytes]:  # uint8 pixels: what the nodes' files hold
        return {r.tobytes() for r in to_uint8(x.images)}

    train = rows(load_dataset(without_val("digits"), m.img_size, m.in_chans, "train", seed=scn.seed))
    test = rows(load_dataset("digits", m.img_size, m.in_chans, "test", seed=scn.seed))
    usual, sel = load_scenario_data(scn), load_scenario_data(scn.replace(score_split="val"))
    assert rows(usual.tests["digits"]) <= test  # the report's run scores on the test split
    scored = rows(sel.tests["digits"])
    dealt = set().union(*(rows(d.train) for d in sel.nodes.values()))
    assert scored and scored <= train and not scored & test  # a selection run scores inside train
    assert not scored & dealt and dealt <= train  # on images no node trains on
    with pytest.raises(ScenarioError, match="score_split"):
        bad = scn.replace(score_split="val", datasets=(replace(scn.datasets[0], spec="digits?val=train"),))
        load_scenario_data(bad)
