"""`atd train` and `atd models` through the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from atdnode.errors import ConfigError, DataError
from atdnode.node import NodeHome, init_home
from cli.app import app

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "vit_tiny_patch16_224", "--img-size", "16", "--patch-size", "4", "--embed-dim", "32",
        "--depth", "2", "--heads", "2", "--epochs", "1", "--batch-size", "32", "--seed", "0"]
runner = CliRunner()


def _home(tmp_path) -> Path:
    h = NodeHome.at(tmp_path / "node")
    init_home(h, consortium="demo")
    return h.root


def test_train_then_models_json_and_table(tmp_path):
    home = _home(tmp_path)
    r = runner.invoke(app, ["train", "--home", str(home), "--data", "digits?classes=0,1,2&limit=90", *TINY, "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout[r.stdout.index("{"):])
    assert rec["labels"] == ["0", "1", "2"] and rec["samples"] == 90 and rec["model"]["embed_dim"] == 32
    assert set(rec["blobs"]) == {"full", "extractor", "head"} and "accuracy" in rec["metrics"]
    assert (home / rec["files"]["confusion_png"]).is_file()

    r = runner.invoke(app, ["models", "--home", str(home), "--json"])
    assert r.exit_code == 0
    listed = json.loads(r.stdout)
    assert [m["id"] for m in listed] == [rec["id"]]
    assert listed[0]["metrics"]["f1"] == rec["metrics"]["f1"] and listed[0]["label_fp"] == rec["label_fp"]

    r = runner.invoke(app, ["models", "--home", str(home)])
    assert r.exit_code == 0 and rec["id"] in r.stdout and "vit_tiny_patch16_224" in r.stdout

    # plain output names the model and its metrics; a second run reuses the finished one
    r = runner.invoke(app, ["train", "--home", str(home), "--data", "digits?classes=0,1,2&limit=90", *TINY])
    assert r.exit_code == 0 and f"model {rec['id']}" in r.stdout and "sensitivity" in r.stdout


def test_models_empty_and_errors(tmp_path):
    home = _home(tmp_path)
    r = runner.invoke(app, ["models", "--home", str(home)])
    assert r.exit_code == 0 and "no models yet" in r.stdout
    r = runner.invoke(app, ["train", "--home", str(home), "--data", "digits?classes=x", *TINY])
    assert isinstance(r.exception, DataError)
    r = runner.invoke(app, ["train", "--home", str(tmp_path / "none"), *TINY])
    assert isinstance(r.exception, ConfigError)
    r = runner.invoke(app, ["train", "--home", str(home), "--model", "vit_nope", *TINY[2:]])
    assert isinstance(r.exception, ConfigError)


def test_errors_print_one_line_without_traceback(tmp_path, capsys):
    """`cli.app.run`, what the console script runs (its process: tests/test_device.py)."""
    from cli.app import run

    home = _home(tmp_path)
    capsys.readouterr()
    assert run(["train", "--home", str(home), "--data", f"folder:{tmp_path / 'missing'}", *TINY]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {tmp_path / 'missing'}: no such folder"]


def test_a_bad_model_config_is_one_typed_line(tmp_path, capsys):
    """A model option timm would choke on is a typed ModelConfigError, printed as one line."""
    from cli.app import run

    home = _home(tmp_path)
    rc = run(["train", "--home", str(home), "--data", "digits?limit=10", *TINY, "--mlp-ratio", "0"])
    assert rc == 1
    assert capsys.readouterr().err.strip().splitlines() == ["error: mlp_ratio must be a positive number, got 0.0"]


def test_train_with_a_conv_stem(tmp_path, capsys):
    """--stem conv trains a conv-stem ViT (protocols.vit_stem), recorded in the model config
    and so in the run key; a patch size it cannot halve to is one typed line."""
    from cli.app import run

    home = _home(tmp_path)
    data = ["--data", "digits?classes=0,1&limit=40"]
    r = runner.invoke(app, ["train", "--home", str(home), *data, *TINY, "--stem", "conv", "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout[r.stdout.index("{"):])
    assert rec["model"]["stem"] == "conv"
    r = runner.invoke(app, ["train", "--home", str(home), *data, *TINY, "--json"])
    patch = json.loads(r.stdout[r.stdout.index("{"):])
    assert "stem" not in patch["model"] and patch["id"] != rec["id"]  # another run, not the conv one reused
    r = runner.invoke(app, ["train", "--home", str(home), *data, *TINY, "--stem", "cnn"])
    assert r.exit_code == 2 and "patch" in r.output and "conv" in r.output  # a usage error naming the choices
    capsys.readouterr()
    assert run(["train", "--home", str(home), *data, *TINY[:2], "--img-size", "24", "--patch-size", "6",
                *TINY[6:], "--stem", "conv"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: stem conv needs a patch_size that is a power of two (2, 4, 8, 16, 32, ...), got 6"]


def test_help_documents_the_learning_rate():
    r = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    from atdnode.learning import FINETUNE_LR, SCRATCH_LR_192

    # the rates the help quotes are the code's (read from its constants, so they cannot drift)
    assert f"--lr {FINETUNE_LR}" in r.stdout and f"{SCRATCH_LR_192} x 192 / embed-dim" in r.stdout, r.stdout
    assert "--init-from" in r.stdout and "--freeze-blocks" in r.stdout


def test_adversarial_training_reports_robust_accuracy(tmp_path):
    home = _home(tmp_path)
    r = runner.invoke(app, ["train", "--home", str(home), "--data", "digits?classes=0,1&limit=40", *TINY,
                            "--adversarial", "--pgd-steps", "2", "--adv-ratio", "0.5", "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout[r.stdout.index("{"):])
    # PGD can only lower accuracy on the samples it attacks: robust <= clean, both recorded
    assert 0.0 <= rec["metrics"]["robust_accuracy"] <= rec["metrics"]["accuracy"]
    t = rec["provenance"]["options"]["transform"]
    assert t["adversarial"] == "pgd" and t["steps"] == 2 and t["ratio"] == 0.5 and abs(t["eps"] - 8 / 255) < 1e-12
    r = runner.invoke(app, ["train", "--home", str(home), *TINY, "--adversarial", "--pgd-eps", "x"])
    assert r.exit_code != 0 and "not a number" in str(r.exception)


@pytest.mark.slow  # an atd process, trained until interrupted
def test_ctrl_c_exits_130_and_keeps_the_finished_epochs(tmp_path):
    import signal

    home = _home(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "cli.app", "train", "--home", str(home), "--data", "digits?limit=60",
           *TINY[:-6], "--epochs", "200", "--batch-size", "30"]
    # Ctrl-C at a terminal: SIGINT at its default disposition. A shell's background job (`pytest &`)
    # ignores SIGINT and its children inherit that, and Python then installs no handler for it.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in p.stderr:  # readiness: an epoch is checkpointed
            if line.startswith("epoch 1/200 finished"):
                p.send_signal(signal.SIGINT)
                break
        _, err = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("error: interrupted; run the same command again")
    (state,) = list((home / "runs").glob("*/state.json"))
    st = json.loads(state.read_text())
    assert st["epoch"] >= 1 and st["done"] is False
