"""`[scenario] val_fraction`: each netsim node holds out a stratified val split that
no method trains on; `atd aggregate` judges its candidates on it, and the VGS-ATD per-node
numbers (hence forgetting) score the model `atd classify` uses by default (`netsim.vgs_keep`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from atdnode.data import load_dataset
from atdnode.errors import DataError
from netsim.nodedata import load_scenario_data, node_spec, write_node_npz
from netsim.scenario import ScenarioError, scenario_from_dict
from tests.netsim_tiny import TINY

torch.set_num_threads(1)


def tiny(val_fraction: float | None = None, cohorts: int = 3, **scenario):
    raw = json.loads(json.dumps(TINY))
    raw["cohorts"] = raw["cohorts"][:cohorts]
    raw["scenario"].update(scenario)
    if val_fraction is not None:
        raw["scenario"]["val_fraction"] = val_fraction
    return scenario_from_dict(raw)


def test_val_split_is_held_out_stratified_and_reaches_the_npz(tmp_path: Path) -> None:
    plain, held = load_scenario_data(tiny()), load_scenario_data(tiny(0.25))
    for n, nd in held.nodes.items():
        tr, va = nd.source_index["train"], nd.source_index["val"]
        assert not set(tr) & set(va)  # disjoint rows of the data set's train split
        # the same partition as without a val split, divided: nothing added, nothing lost
        assert np.array_equal(np.sort(np.concatenate([tr, va])), plain.nodes[n].source_index["train"])
        assert len(nd.train) == len(tr) and len(nd.val) == len(va) and nd.test.images.shape == plain.nodes[n].test.images.shape
        # stratified: each class sends round(0.25 x its count) to val, keeping >= 1 for training
        full = np.bincount(plain.nodes[n].train.labels.numpy(), minlength=len(nd.classes))
        got = np.bincount(nd.val.labels.numpy(), minlength=len(nd.classes))
        assert got.tolist() == [min(int(np.floor(0.25 * c + 0.5)), max(c - 1, 0)) for c in full], (n, full, got)
        assert sum(nd.class_counts.values()) == len(nd.train)
        # the node's .npz: `atd` reads train / val / test back exactly (val disjoint from test:
        # test rows come from the data set's test split, held.test_index)
        spec = f"npz:{write_node_npz(nd, tmp_path / f'{n}.npz')}"
        for split, part in (("train", nd.train), ("val", nd.val), ("test", nd.test)):
            got_ = load_dataset(spec, 8, 1, split)
            assert torch.equal(got_.labels, part.labels) and torch.allclose(got_.images, part.images, atol=1e-5), split
    assert plain.nodes["a1"].val is None and "val" not in plain.nodes["a1"].source_index
    plain_spec = node_spec(plain.nodes["a1"], tmp_path / "plain.npz")
    with pytest.raises(DataError):  # no val split without the option: the node makes no choice (val=train)
        load_dataset(plain_spec, 8, 1, "val")
    assert len(load_dataset(plain_spec, 8, 1, "train")) == len(plain.nodes["a1"].train)  # trains on all its share
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ScenarioError, match="scenario.val_fraction"):
            tiny(bad)
    with pytest.raises(ScenarioError, match="val_fraction"):  # 0.01 of a few samples per class: no val sample
        load_scenario_data(tiny(0.01))


@pytest.mark.slow
def test_every_baseline_and_reference_trains_without_the_val_split(monkeypatch) -> None:
    """centralized / local / swarm (their `train_model` calls), fedavg (`atd rounds`' data) and
    the reference ensembles (their fit) see each node's train part only, never its val split."""
    import netsim.baselines as bl
    import netsim.fat as fat
    import netsim.references as refs

    scn = tiny(0.25, cohorts=2, methods=["vgs-atd", "centralized", "local", "swarm", "fedavg"])
    data = load_scenario_data(scn)
    seen: list[torch.Tensor] = []
    real = bl.train_model

    def spy_train(cfg, train, *a, **k):
        seen.append(train.images)
        return real(cfg, train, *a, **k)

    class Stop(Exception):
        pass

    def spy_rounds(train, **_k):
        seen.extend(t.images for t in train.values())
        raise Stop

    def spy_fit(kind, parts, *a, **k):
        seen.extend(p.images for p in parts)
        raise Stop

    monkeypatch.setattr(bl, "train_model", spy_train)
    monkeypatch.setattr(fat, "run_rounds_memnet", spy_rounds)
    monkeypatch.setattr(refs, "fit_reference", spy_fit)
    for method in ("centralized", "local", "swarm"):
        bl.run_baseline(method, scn, data, log=lambda _m: None)
    for run in (lambda: bl.run_baseline("fedavg", scn, data, log=lambda _m: None),
                lambda: refs.run_reference("ensemble-raw", scn, data, log=lambda _m: None)):
        with pytest.raises(Stop):
            run()
    val = {bytes(r.numpy().tobytes()) for nd in data.nodes.values() for r in nd.val.images}
    train = {bytes(r.numpy().tobytes()) for nd in data.nodes.values() for r in nd.train.images}
    only_val = val - train  # (an image that is also a training image of some node may be trained on)
    assert only_val and len(seen) >= 3 + 2 + 2 * 3 + 1  # centralized 2 phases, local 3 nodes, swarm 2x2x...
    for images in seen:
        assert not only_val & {bytes(r.numpy().tobytes()) for r in images}


@pytest.fixture(scope="module")
def val_run(tmp_path_factory) -> tuple[list[dict], object, Path]:
    from netsim.run import run_vgs_memory

    scn = tiny(0.25)
    data = load_scenario_data(scn)
    work = tmp_path_factory.mktemp("vgs-val")
    phases, _ = run_vgs_memory(scn, data, work)
    return [p.to_dict() for p in phases], data, work


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_per_node_scores_the_kept_model_and_says_why(val_run) -> None:
    """A node whose own model beats the consortium's on its val split keeps it (`[aggregate] keep
    = best`); its per-node accuracy and the forgetting score that model, overall the consortium's."""
    import torch

    from atdnode.aggregation.keep import short_class
    from atdnode.learning import class_probabilities, predict_names
    from atdnode.node import NodeHandle, NodeHome
    from atdnode.aggregation.candidates import consortium_classes
    from atdnode.models import answer_classes, default_model
    from atdnode.blobs import BlobStore
    from atdnode.models import ModelRegistry
    from netsim.learn import global_probs, score, score_probs, to_global
    from netsim.report import forgetting, kept_lines

    phases, data, work = val_run
    last = phases[-1]
    own_nodes, differs, subset_nodes, interim_passes = [], False, 0, 0
    for n, m in last["per_node"].items():
        home = NodeHome(work / "homes" / n)
        store, cons = BlobStore(home.blobs_dir), ModelRegistry(home).get("latest")
        nd = data.nodes[n]
        y = to_global(nd.test.labels.numpy(), nd.classes, data.label_space)

        def acc(rec) -> float:
            names, pred, _ = predict_names(store, rec, nd.test.images)
            return score(y, to_global(pred, names, data.label_space))["accuracy"]

        def auc(rec) -> float:
            names, probs, _ = class_probabilities(store, rec, nd.test.images, device=torch.device("cpu"))
            return score_probs(y, global_probs(probs, names, data.label_space))["auroc"]

        kept = default_model(home)
        assert m["accuracy"] == acc(kept), n  # the model `atd classify` uses by default
        assert m["auroc"] == pytest.approx(auc(kept)) and m["auroc_ci95"][0] <= m["auroc"] <= m["auroc_ci95"][1]
        prov = cons.provenance
        assert prov["candidates"]["scored_on"] == "val"  # judged on the held-out split, not on test
        # the too-few-images rule counts only where the node holds every class of the consortium's model
        # against the consortium's label space: every input's labels, also in a pass that fused
        # the peers' extractors before their features arrived (its ensemble answers only the
        # node's own classes); the record's labels are the node's own
        with NodeHandle.using(home) as node:
            for rec in ModelRegistry(home).list():
                if "candidates" not in rec.provenance:
                    continue
                covers = set(consortium_classes(node.ledger, rec)) <= set(nd.classes)
                assert ("val_class_counts" in rec.provenance["candidates"]) == covers, (n, rec.id)
                subset_nodes += not covers
                interim_passes += not covers and set(answer_classes(rec)) <= set(nd.classes)
        if prov["kept"] in ("own", "raw-pixels"):  # its own model, or its own raw-pixel ensemble
            by, k = "balanced_accuracy", prov["kept"]  # the judge (atdnode.aggregation.keep.SELECT_BY)
            own, con = prov["candidates"][k][by], prov["candidates"]["consortium"][by]
            what = "its own model" if k == "own" else "its raw-pixel ensemble"
            assert m["model"] == k and kept.id != cons.id and own > con
            assert any(note.startswith(f"{n} keeps {what}: {k} {own:.3f} > consortium {con:.3f}")
                       and "(balanced accuracy) on its val split" in note for note in last["notes"]), last["notes"]
            own_nodes.append(n)
            differs |= acc(cons) != m["accuracy"]
        elif short_class(prov["candidates"]):  # too few val images of a class to rank them: the consortium's, noted
            assert m["model"] == "consortium" and kept.id == cons.id and "too few to rank" in prov["kept_why"]
            assert any(note.startswith(f"{n} keeps the consortium's model: the split holds ") and
                       "too few to rank the candidates" in note for note in last["notes"]), last["notes"]
        else:  # the consortium's: a candidate that scored higher on val did so by no more than one SE, noted
            assert m["model"] == "consortium" and kept.id == cons.id
            c, by = prov["candidates"], "balanced_accuracy"
            higher = [k for k in ("own", "raw-pixels") if k in c and c[k][by] > c["consortium"][by]]
            assert all(c[k][by] - c["consortium"][by] <= c[k]["se"] for k in higher), c
            assert bool(higher) == any(note.startswith(f"{n} keeps the consortium's model: ") and
                                       "by no more than one SE" in note for note in last["notes"]), last["notes"]
    assert last["overall"]["auroc_ci95"][0] <= last["overall"]["auroc"] <= last["overall"]["auroc_ci95"][1]
    assert subset_nodes and interim_passes, "the tiny run must hold a node with only some of the consortium's " \
                                            "classes, and a pass of it that answered only its own"
    assert own_nodes and differs, "the tiny run (a node keeping its own model or raw-pixel ensemble) must exercise it"
    report = {"methods": {"vgs-atd": phases}}
    f = forgetting(report["methods"], ["a1", "a2"])["vgs-atd"]
    assert f[str(last["phase"])] == pytest.approx(np.mean([last["per_node"][n]["accuracy"] for n in ("a1", "a2")]))
    lines = kept_lines(report)
    for k in ("own", "raw-pixels"):
        mine = sorted(n for n in own_nodes if last["per_node"][n]["model"] == k)
        assert any(f"{'its own' if k == 'own' else 'its raw-pixel ensemble'} for {', '.join(mine) or 'no node'}" in line
                   for line in lines), lines
    # every trained VGS-ATD model saw the node's train part only
    for n, nd in data.nodes.items():
        trained = [r for r in ModelRegistry(NodeHome(work / "homes" / n)).list() if not r.provenance.get("kind")]
        assert trained and all(r.samples == len(nd.train) for r in trained), n
