"""Vertical mode: three nodes with disjoint digit classes end up, each,
with one classifier over all ten classes built from features the others sealed to them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from atdnode.aggregation import AggregateError, FeaturesError
from atdnode.blobs import BlobStore
from atdnode.learning import ClassifyError
from atdnode.models import load_weights, publish_weights
from cli.app import app
from tests.vgs_homes import ENSEMBLE_ARGS, copy_homes, latest, peer_ids, sync

runner = CliRunner()
pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")


@pytest.fixture
def trio(vgs_template, tmp_path):
    template = vgs_template("disjoint")
    return copy_homes(template, tmp_path / "homes")


def cli(*args: str) -> dict:
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    return json.loads(r.stdout.strip().splitlines()[-1])


def vertical(home, *extra: str) -> dict:
    return cli("aggregate", "--home", str(home.root), "--mode", "vertical", *ENSEMBLE_ARGS, *extra)


@pytest.mark.slow  # six ensemble fits (PCA, MLP, RF, SVM), six scorings; the fast tier keeps the cheaper tests
def test_disjoint_labels_give_every_node_one_ten_class_classifier(trio):
    pids = peer_ids(trio)
    first = [vertical(h) for h in trio]
    # the same published extractors, fused the same way: one fused extractor everywhere
    assert len({r["blob"] for r in first}) == 1 and all(len(r["inputs"]) == 3 for r in first)
    assert [r["classes"] for r in first] == [["0", "1", "2"], ["3", "4", "5"], ["6", "7", "8", "9"]]
    for h, me in zip(trio, pids):
        shared = cli("share-features", "--home", str(h.root), "--to", ",".join(p for p in pids if p != me))
        assert shared["recipients"] == sorted(p for p in pids if p != me) and shared["shape"][1] == 32
    sync(trio)
    second = [vertical(h) for h in trio]
    assert {r["blob"] for r in second} == {first[0]["blob"]}
    for r in second:
        assert r["classes"] == [str(i) for i in range(10)] and len(r["features"]) == 2 and not r["skipped"]
    # canonical order + fixed seed: every node fits the very same ensemble (the default
    # class-prior correction, balanced, depends on the pooled counts only)
    assert len({r["ensemble"] for r in second}) == 1
    # each node scored its own model and the consortium's on its own data and kept by the one-SE rule
    # (`[aggregate] keep = best`); `atd classify` uses what it kept by default
    for h, r in zip(trio, second):
        c = r["candidates"]
        # digits has no val split: the loader carved one from training; never judged on test
        assert c["scored_on"] == "val" and c["val_from"].startswith("carved from train"), c
        assert c["own"]["model"] != r["model"] and "warning" not in c, c
        # ... or its own raw-pixel ensemble: the consortium's unless another beats it by more than one SE
        # of the paired difference, else the best of the others (ties go to the learned model)
        ba = {k: c[k]["balanced_accuracy"] for k in ("consortium", "own", "raw-pixels")}
        beat = [k for k in ("own", "raw-pixels") if ba[k] - ba["consortium"] > c[k]["se"]]
        better = max(("own", "raw-pixels"), key=lambda k: (ba[k], k == "own")) if beat else "consortium"
        assert r["kept"] == better, r
        out = cli("classify", "--home", str(h.root), "--data", "digits")
        assert out["model"] == (r["model"] if better == "consortium" else c[better]["model"])
    accs = []
    for h, r in zip(trio, second):
        out = cli("classify", "--home", str(h.root), "--data", "digits", "--model", r["model"])
        assert out["model"] == r["model"] and out["kind"] == "ensemble" and out["n"] == 359
        assert out["unknown_classes"] == [] and Path(out["png"]).read_bytes()[:4] == b"\x89PNG"
        accs.append(out["accuracy"])
    r = runner.invoke(app, ["classify", "--home", str(trio[0].root), "--data", "digits", "--robust"])
    assert isinstance(r.exception, ClassifyError) and "ensemble" in str(r.exception)
    print(f"vertical ensemble accuracy on the digits test split (10 classes): {accs}")
    assert min(accs) > 0.4, accs  # chance is 0.1; measured 0.61
    # any peer holding the inputs can check the fusion
    sync(trio)
    assert cli("aggregate", "--home", str(trio[2].root), "--verify", second[0]["entry"])["verified"]


def test_features_from_another_extractor_are_skipped_or_refused(trio):
    pids = peer_ids(trio)
    # b shares features of its own trained model (not the fused extractor) with a
    stale = cli("share-features", "--home", str(trio[1].root), "--to", pids[0])
    sync(trio)
    r = vertical(trio[0])
    assert r["features"] == [] and [s["entry"] for s in r["skipped"]] == [stale["entry"]]
    assert "extractor" in r["skipped"][0]["why"] and r["classes"] == ["0", "1", "2"]
    bad = runner.invoke(app, ["aggregate", "--home", str(trio[0].root), "--mode", "vertical", *ENSEMBLE_ARGS,
                              "--features", stale["entry"]])
    assert isinstance(bad.exception, FeaturesError) and "extractor" in str(bad.exception)


def test_vertical_inputs_and_option_errors(trio):
    # a full set named explicitly is fused without its head
    full = [publish_weights(h, part="full").entry.id.hex() for h in trio[:2]]
    sync(trio)
    r = vertical(trio[0], "--inputs", ",".join(full))
    assert r["head"] is False and r["inputs"] == full
    assert "head.weight" not in load_weights(BlobStore(trio[0].blobs_dir), r["blob"])[0]
    bad = runner.invoke(app, ["aggregate", "--home", str(trio[0].root), "--mode", "vertical", "--group", "g=" + full[0]])
    assert bad.exit_code != 0 and "--group" in str(bad.exception)
    bad = runner.invoke(app, ["aggregate", "--home", str(trio[0].root), "--mode", "sideways"])
    assert bad.exit_code == 2 and "'sideways' is not one of" in bad.output, bad.output
    bad = runner.invoke(app, ["aggregate", "--home", str(trio[0].root), "--mode", "vertical", "--data", "digits?classes=0",
                              *ENSEMBLE_ARGS])
    assert isinstance(bad.exception, AggregateError) and "2 classes" in str(bad.exception)
    assert latest(trio[0]).provenance["kind"] == "global-vertical"
