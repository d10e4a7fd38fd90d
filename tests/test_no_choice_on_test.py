"""No choice is ever made on test data.

A data set without a val split gets one carved from its training split (seeded,
stratified, recorded in the run and the model's record), and keep = best judges on it.
The test split here is the training task with its labels flipped: a judge that looked at
test would keep the model trained on flipped labels; the carved val split keeps the one
trained on the true labels. Forcing selection on test (`val=test`) flags every number it
chose. And the judge is balanced accuracy: on a val split that is 96 % one class, accuracy
keeps a model that always answers the majority class, balanced accuracy does not.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from atdnode.aggregation import TEST_WARNING
from atdnode.aggregation.candidates import judge_candidates
from atdnode.aggregation.keep import choose
from atdnode.blobs import BlobStore
from atdnode.data import load_dataset
from atdnode.learning import classification_metrics
from atdnode.node import NodeHome, init_home
from tests.vgs_homes import train_node


def _npz(path: Path, *, flip_train: bool) -> str:
    """digits 0 vs 1 (8 px): train (labels flipped when `flip_train`) and a test split whose
    labels are flipped — no val split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    keep = d.target < 2
    images = np.clip(np.round(d.images[keep] * (255 / 16)), 0, 255).astype(np.uint8)
    y = d.target[keep].astype(np.int64)
    test = np.arange(len(y)) % 4 == 0
    tr_y = 1 - y[~test] if flip_train else y[~test]
    np.savez(path, train_images=images[~test], train_labels=tr_y, test_images=images[test],
             test_labels=1 - y[test], classes=np.array(["zero", "one"]))
    return f"npz:{path}"


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("nochoice")
    h = NodeHome.at(root / "n")
    init_home(h, consortium="demo")
    spec = _npz(root / "task.npz", flip_train=False)
    right = train_node(h, spec, epochs=2)
    wrong = train_node(h, _npz(root / "flipped.npz", flip_train=True), epochs=2)
    return h, spec, right, wrong


@pytest.mark.slow  # trains two small models (module fixture)
def test_a_source_without_val_split_gets_one_carved_from_train(two_models) -> None:
    _, spec, right, _ = two_models
    tr, va, te = (load_dataset(spec, 8, 1, s) for s in ("train", "val", "test"))
    assert va.report.val_origin.startswith("carved from train") and len(tr) + len(va) == 270
    assert abs(len(va) - 54) <= 2 and sorted(set(va.labels.tolist())) == [0, 1]  # stratified: both classes
    # disjoint from what the model trained on, and the same rows every time (seeded)
    rows = {tuple(x.flatten().tolist()) for x in tr.images}
    assert not any(tuple(x.flatten().tolist()) in rows for x in va.images)
    assert np.array_equal(load_dataset(spec, 8, 1, "val").labels.numpy(), va.labels.numpy())
    # recorded in the model's record, and the run's per-epoch figure is named for its split
    assert right.provenance["val_split"]["origin"] == va.report.val_origin
    assert sum(right.provenance["val_split"]["counts"].values()) == len(va)
    assert "val_accuracy" in right.metrics["history"][-1]
    assert len(load_dataset(spec + "?val=train", 8, 1, "train")) == 270  # val=train: nothing carved


@pytest.mark.slow
def test_keep_best_judges_on_the_carved_val_split_never_on_test(two_models) -> None:
    h, spec, right, wrong = two_models
    store = BlobStore(h.blobs_dir)
    got = judge_candidates(h, store, wrong, right, spec)
    c = got["candidates"]
    assert c["scored_on"] == "val" and c["val_from"].startswith("carved") and "warning" not in c
    # the flipped model is wrong on val, right on the (flipped) test split: kept by val, not test
    assert c["consortium"]["balanced_accuracy"] > 0.8 > 0.2 > c["own"]["balanced_accuracy"], c
    best = max(("consortium", "own", "raw-pixels"), key=lambda k: c[k]["balanced_accuracy"])  # the best on val
    assert got["kept"] != "own" and c[got["kept"]]["balanced_accuracy"] == c[best]["balanced_accuracy"], got
    # forced on test: the choice flips, and every output of it carries the warning
    forced = judge_candidates(h, store, wrong, right, spec + "?val=test")
    assert forced["candidates"]["scored_on"].startswith("test") and forced["kept"] == "own", forced
    assert forced["warning"] == TEST_WARNING and "WARNING" in forced["kept_why"]
    # a node that kept a model chosen on test: `atd classify` on test says so, kept model or not
    from dataclasses import replace

    from atdnode.learning import run_classify as classify
    from atdnode.models import register_model

    import time

    agg = replace(right, id="", created=time.time() + 1, provenance={**right.provenance, **forced})
    register_model(h, agg)  # the newest record: an aggregate whose keep was judged on test, and kept own
    shown = classify(h, spec, split="test")  # the default: the own (flipped) model it kept
    assert shown.model_id == wrong.id and shown.to_json()["warning"] == TEST_WARNING
    assert "warning" not in classify(h, spec, split="val").to_json()  # on val: not the split it chose on
    # no val split at all (val=train): no choice is made
    none = judge_candidates(h, store, wrong, right, spec + "?val=train")
    assert none["kept"] == "consortium" and "no val split" in none["kept_why"] and "candidates" not in none


def test_a_skewed_val_split_fools_accuracy_not_balanced_accuracy() -> None:
    y = np.array([0] * 48 + [1] * 2)  # 96 % one class
    majority = np.zeros(50, dtype=np.int64)  # always answers the majority class
    useful = y.copy()
    useful[:4] = 1  # misses 4 of the majority class, finds both of the minority
    own, cons = (classification_metrics(y, p, labels=[0, 1]) for p in (majority, useful))
    scores = {"scored_on": "val", "own": own, "consortium": cons}
    assert own["accuracy"] > cons["accuracy"]  # accuracy would keep the useless model ...
    by_accuracy = {**scores, "own": {"accuracy": own["accuracy"]}, "consortium": {"accuracy": cons["accuracy"]}}
    assert choose("best", by_accuracy)[0] == "own"
    kept, why = choose("best", scores)  # ... balanced accuracy keeps the one that finds the minority
    assert kept == "consortium" and "balanced accuracy" in why and own["balanced_accuracy"] == 0.5
