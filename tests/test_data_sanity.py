"""Data sanity: one-class training is refused in one line; a small test split puts a warning
beside every metric it affects (train, classify, models); scikit-learn's warnings go to the
log, not stderr."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atdnode.data import caution_for, metric_text
from atdnode.node import NodeHome, init_home
from cli.app import run

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "vit_tiny_patch16_224", "--img-size", "16", "--patch-size", "8", "--embed-dim", "32",
        "--depth", "1", "--heads", "2", "--epochs", "1", "--batch-size", "16", "--seed", "0", "--device", "cpu"]
SHOWN = [("accuracy", "accuracy"), ("precision", "precision"), ("sensitivity", "recall"), ("f1", "f1")]


def _home(tmp_path: Path) -> str:
    h = NodeHome.at(tmp_path / "node")
    init_home(h, consortium="demo")
    return str(h.root)


def test_one_class_training_is_a_one_line_error(tmp_path, capsys):
    home = _home(tmp_path)
    assert run(["train", "--home", home, "--data", "digits?classes=3", *TINY]) == 1
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("error: digits?classes=3: the train split has only class '3'")
    assert "at least 2 classes" in err and "Traceback" not in out + err
    assert not list((tmp_path / "node" / "models").glob("*.json"))  # nothing registered


def test_caution_names_the_metrics_it_affects():
    assert caution_for({"a": 20, "b": 5}) is None  # 25 images, every class at 5: reliable enough
    small_class = caution_for({"a": 30, "b": 3, "c": 0})  # c: absent from the split, not small
    assert small_class.metrics == ("precision", "recall", "sensitivity", "f1") and "'b' 3" in small_class.reason
    line = metric_text({"accuracy": 0.9, "precision": 0.8, "recall": 0.7, "f1": 0.75,
                        "caution": small_class.to_json()}, SHOWN)
    assert line == "accuracy 0.9000  precision 0.8000 (!)  sensitivity 0.7000 (!)  f1 0.7500 (!)"
    tiny = caution_for({"a": 10, "b": 9})
    assert "accuracy" in tiny.metrics and "19 image(s) (under 20)" in tiny.reason


def test_small_test_split_warns_beside_every_metric(tmp_path, capsys):
    home = _home(tmp_path)
    spec = "digits?classes=0,1&shard=1/8"  # about 9 test images
    assert run(["train", "--home", home, "--data", spec, *TINY]) == 0
    out = capsys.readouterr().out
    for metric in ("accuracy", "balanced accuracy", "macro precision", "macro F1"):  # each with its interval
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(metric + " "))
        assert re.search(r"\d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] \(!\)", line), line
    assert "(!) unreliable: the test split has" in out and "(under 20)" in out
    assert run(["classify", "--home", home, "--data", spec]) == 0
    out = capsys.readouterr().out
    assert out.count("(!)") == 5 and "(!) unreliable" in out  # four metrics + the explanation
    assert run(["models", "--home", home]) == 0
    table = capsys.readouterr().out
    assert "! unreliable" in table and table.splitlines()[1].count("!") == 2  # acc and f1 columns
    # the same model on a large test split: no warning
    assert run(["classify", "--home", home, "--data", "digits?classes=0,1"]) == 0
    assert "(!)" not in capsys.readouterr().out


@pytest.mark.slow  # a Python process
def test_sklearn_warnings_go_to_the_log_not_stderr(tmp_path):
    home = _home(tmp_path)
    code = f"""
import warnings
import numpy as np
from sklearn.neural_network import MLPClassifier
from atdnode.node.home import NodeHome
from atdnode.node.logs import sklearn_warnings_to_log
sklearn_warnings_to_log(NodeHome.at({home!r}))
X = np.random.default_rng(0).normal(size=(40, 4)); y = (X[:, 0] > 0).astype(int)
MLPClassifier(max_iter=1, random_state=0).fit(X, y)
warnings.warn("a warning of atd's own", UserWarning)
"""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ConvergenceWarning" not in r.stderr and "a warning of atd's own" in r.stderr
    log = (Path(home) / "logs" / "cli.log").read_text()
    assert "ConvergenceWarning" in log and "atd.sklearn" in log


def test_data_inspect_says_what_training_would_refuse_or_caution(tmp_path, capsys):
    import numpy as np
    from PIL import Image

    root = tmp_path / "one"
    (root / "normal").mkdir(parents=True)
    for i in range(6):
        Image.fromarray(np.full((8, 8), i * 40, np.uint8)).save(root / "normal" / f"{i}.png")
    assert run(["data", "inspect", f"folder:{root}", "--img-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "warning: " in out and "only class 'normal'" in out and "at least 2 classes" in out
    assert "warning: test metrics (!) unreliable: the test split has 1 image(s)" in out
