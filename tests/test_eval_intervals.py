"""The one scorer says how sure it is: Wilson and bootstrap 95 % intervals with n, the binary
figures (sensitivity, specificity, AUROC), calibration (ECE) -- each against a known answer
or an independent implementation; and the pieces around it: model sizes chosen from the
data, sizes that do not divide refused, a repeated warning logged once with a count, the
demo's table inside 80 columns."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from atdnode.learning import classification_metrics
from atdnode.learning import named_metrics, wilson
from atdnode.learning.metrics import auroc, calibration


def test_wilson_matches_newcombe_1998():
    # Newcombe, Stat Med 1998, Table I: 81/263 -> 0.2553-0.3662; 15/148 -> 0.0624-0.1605
    assert wilson(81, 263) == pytest.approx([0.2553, 0.3662], abs=5e-5)
    assert wilson(15, 148) == pytest.approx([0.0624, 0.1605], abs=5e-5)
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and 0.25 < hi < 0.35  # never a zero-width interval at 0 successes (Wald's would be)


def test_auroc_equals_sklearn_with_ties_and_bootstrap_is_seeded():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 300)
    score = np.round(np.clip(0.3 * y + rng.random(300) * 0.7, 0, 1), 1)  # many ties
    assert auroc(y, score) == pytest.approx(roc_auc_score(y, score), abs=1e-12)
    probs = np.stack([1 - score, score], 1)
    a = classification_metrics(y, probs.argmax(1), labels=[0, 1], probs=probs, seed=0)
    b = classification_metrics(y, probs.argmax(1), labels=[0, 1], probs=probs, seed=0)
    c = classification_metrics(y, probs.argmax(1), labels=[0, 1], probs=probs, seed=1)
    assert a["binary"]["ci"]["auroc"] == b["binary"]["ci"]["auroc"] != c["binary"]["ci"]["auroc"]
    lo, hi = a["binary"]["ci"]["auroc"]
    assert lo < a["binary"]["auroc"] < hi and hi - lo < 0.2
    assert auroc(np.ones(5, dtype=int), np.arange(5.0)) is None  # one class: no AUROC


def test_each_bootstrap_auroc_is_sklearns_with_the_resample_as_weights():
    from sklearn.metrics import roc_auc_score

    from atdnode.learning.metrics import _resamples

    rng = np.random.default_rng(4)
    y = rng.integers(0, 2, 60)
    score = np.round(0.4 * y + rng.random(60) * 0.6, 1)  # ties within and across the classes
    counts = _resamples(len(y), 7, 50)
    boot = auroc(y, score, counts)
    assert boot.shape == (50,) and not counts.flags.writeable  # the shared table cannot be changed
    for w, a in zip(counts, boot):
        assert a == pytest.approx(roc_auc_score(y, score, sample_weight=w), abs=1e-12)
    assert _resamples(len(y), 7, 50) is counts and not np.array_equal(_resamples(len(y), 8, 50), counts)
    one = np.zeros((1, 60), dtype=np.int64)
    one[0, y == 1] = 1  # a resample of positives only: no AUROC
    assert np.isnan(auroc(y, score, one)[0])


def test_binary_figures_and_per_class_n_from_a_known_confusion():
    # 40 positives (30 found), 60 negatives (54 cleared)
    y = np.array([1] * 40 + [0] * 60)
    pred = np.array([1] * 30 + [0] * 10 + [0] * 54 + [1] * 6)
    m = named_metrics(y, pred, classes=["benign", "malignant"])
    b = m["binary"]
    assert b["positive_class"] == "malignant" and (b["n_positive"], b["n_negative"]) == (40, 60)
    assert b["sensitivity"] == 0.75 and b["specificity"] == 0.9
    assert b["ci"]["sensitivity"] == wilson(30, 40) and b["ci"]["specificity"] == wilson(54, 60)
    assert m["per_class"] == {"benign": {"n": 60, "recall": 0.9, "recall_ci": wilson(54, 60)},
                              "malignant": {"n": 40, "recall": 0.75, "recall_ci": wilson(30, 40)}}
    assert m["ci"]["accuracy"] == wilson(84, 100) and m["balanced_accuracy"] == pytest.approx(0.825)
    lo, hi = m["ci"]["balanced_accuracy"]
    assert lo < 0.825 < hi
    assert "binary" not in classification_metrics([0, 1, 2], [0, 1, 1], labels=range(3))


def test_auroc_summary_is_the_positive_class_or_the_one_vs_rest_macro():
    from sklearn.metrics import roc_auc_score

    from atdnode.learning import auroc_summary

    rng = np.random.default_rng(2)
    y = rng.integers(0, 4, 400)
    p = rng.dirichlet([1, 1, 1, 1], 400)
    p[np.arange(400), y] += rng.random(400)  # informative, not perfect
    p /= p.sum(1, keepdims=True)
    s = auroc_summary(y, p)
    assert s["auroc"] == pytest.approx(roc_auc_score(y, p, multi_class="ovr", average="macro"), abs=1e-12)
    assert 0.5 < s["ci"][0] < s["auroc"] < s["ci"][1] < 1
    # a class absent from y_true is left out of the macro (its column is all negatives)
    wide = np.c_[p, np.zeros(400)]
    assert auroc_summary(y, wide)["auroc"] == pytest.approx(s["auroc"])
    # two classes: the positive class's AUROC; a one-class test set has none
    yb = (y > 1).astype(int)
    pb = np.c_[p[:, :2].sum(1), p[:, 2:].sum(1)]
    assert auroc_summary(yb, pb)["auroc"] == pytest.approx(roc_auc_score(yb, pb[:, 1]), abs=1e-12)
    assert auroc_summary(np.zeros(5, dtype=int), np.tile([0.6, 0.4], (5, 1))) is None
    with pytest.raises(ValueError, match="shape"):
        auroc_summary(y, p[:10])


def test_expected_calibration_error_known_answers():
    n = 1000
    y = np.zeros(n, dtype=int)
    # confidence 0.8 and right 80 % of the time: calibrated
    probs = np.tile([0.8, 0.2], (n, 1))
    y[: n // 5] = 1
    cal = calibration(y, probs)
    assert cal["ece"] == pytest.approx(0.0, abs=1e-12) and cal["table"][0]["n"] == n
    # always certain (1.0), right half the time: ECE 0.5
    y2 = np.array([0, 1] * (n // 2))
    cal2 = calibration(y2, np.tile([1.0, 0.0], (n, 1)))
    assert cal2["ece"] == pytest.approx(0.5) and cal2["ci"][0] < 0.5 < cal2["ci"][1] + 1e-9


def test_reliability_png(tmp_path):
    from atdnode.learning import save_reliability_png

    rng = np.random.default_rng(0)
    p = rng.dirichlet([1, 1, 1], 200)
    path = save_reliability_png(calibration(rng.integers(0, 3, 200), p), tmp_path / "r.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_model_size_follows_the_data():
    from atdnode.learning import choose_size

    small = choose_size(28, 600, "cpu")
    assert (small.img_size, small.patch_size) == (28, 4) and small.img_size % small.patch_size == 0
    assert small.threads == 1 and "28-px" in small.why and "CPU" in small.why
    xray = choose_size(512, 600, "cpu")
    assert xray.img_size == 128 and xray.img_size % xray.patch_size == 0  # never 224 px on a CPU
    gpu = choose_size(512, 20000, "cuda:0")
    assert gpu.img_size == 224 and gpu.depth > xray.depth and gpu.threads is None
    odd = choose_size(30, 100, "cpu")
    assert odd.img_size <= 30 and odd.img_size % odd.patch_size == 0


def test_sizes_that_do_not_divide_are_refused():
    from protocols.vit_config import ModelConfig, ModelConfigError

    with pytest.raises(ModelConfigError, match="img_size 30 is not a multiple of patch_size 4.*28 or 32"):
        ModelConfig(img_size=30, patch_size=4)
    assert "28px/patch 4" in ModelConfig(img_size=28, patch_size=4).arch()


def test_a_repeated_warning_is_logged_once_with_a_count(caplog):
    from atdnode import repeats

    log = logging.getLogger("atd.test.repeats")
    t = [0.0]
    with caplog.at_level(logging.WARNING, logger="atd.test.repeats"):
        for i in range(50):
            repeats.warn_once(log, "test-key", f"entry {i} cannot widen", clock=lambda: t[0])
        assert [r.getMessage() for r in caplog.records] == [
            "entry 0 cannot widen (further warnings like it are counted, not repeated)"]
        t[0] = repeats.EVERY_S + 1
        repeats.warn_once(log, "test-key", "entry 50", clock=lambda: t[0])
    assert caplog.records[-1].getMessage() == "test-key: 50 more like it (51 in all)"
    assert repeats.counts()["test-key"] == 51


def test_demo_table_fits_80_columns(capsys, monkeypatch):
    from cli.commands.netsim_cmd import print_summary

    monkeypatch.setenv("COLUMNS", "80")
    phase = {"phase": 3, "overall": {"accuracy": 0.954321, "auroc": 0.987654, "precision": 0.951234, "sensitivity": 0.949876,
                                     "f1": 0.950123}, "bytes": {"h1": {"sent": 999_900_000}},
             "ready_s": 1234.5, "compute_s": 12345.6}  # a long run on a slow machine: the widest cells
    report = {"scenario": {"name": "atd-demo"}, "backend": "process", "wall_s": 300.0,
              "methods": {m: [phase] for m in ("vgs-atd", "centralized", "fedavg", "swarm", "local")}}
    print_summary(report, None)
    out = capsys.readouterr().out
    assert "0.954" in out and "0.988" in out and "0.950" in out and "12345.6" in out and "auc" in out and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_run_eta_from_the_rate_so_far():
    from atdnode.progress import RunEta

    t = [0.0]
    eta = RunEta(epochs=3, per_epoch=100, clock=lambda: t[0])
    assert eta.text() == "run ETA ..."  # nothing done yet: no guess
    t[0] = 10.0
    assert eta.advance(50) == "run ETA 50s"  # 50 units in 10 s, 250 left
    t[0] = 20.0
    eta.epoch_done()  # an epoch finished (also without per-batch callbacks): 100 done in 20 s
    assert eta.remaining_s() == pytest.approx(40.0) and eta.text() == "run ETA 40s"
    t[0] = 400.0
    assert eta.text() == "run ETA 13m 20s"


@pytest.mark.slow
def test_train_without_size_flags_sizes_the_model_from_the_data(tmp_path):
    from typer.testing import CliRunner

    from atdnode.node import NodeHome, init_home
    from cli.app import app
    from tests.vgs_homes import latest

    import torch

    home = NodeHome.at(tmp_path / "n")
    init_home(home, consortium="demo")
    threads = torch.get_num_threads()
    try:  # the small CPU model sets one thread for the process: not for the tests after this one
        r = CliRunner().invoke(app, ["train", "--home", str(home.root), "--data", "digits?classes=0,1&limit=40",
                                     "--epochs", "1", "--device", "cpu", "--no-augment"])
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 0, (r.output, r.exception)
    assert "model size from the data: 8-px images, 40 for training, CPU: img 8, patch 4" in r.output
    m = latest(home).model
    assert (m["img_size"], m["patch_size"], m["embed_dim"], m["depth"]) == (8, 4, 64, 4)  # not 224 px, 12 blocks
    assert "ViT 8px/patch 4, embed 64, depth 4" in r.output  # named as built
    r = CliRunner().invoke(app, ["train", "--home", str(home.root), "--data", "digits", "--img-size", "30",
                                 "--patch-size", "4"])
    assert r.exit_code != 0 and "not a multiple of patch_size 4" in str(r.exception)
