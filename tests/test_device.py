"""The one device rule (atdnode.learning.device): explicit choice > config.toml [compute] device > CUDA when present."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atdnode.node import NodeConfig, NodeHome, init_home
from atdnode.learning import DeviceError, parse_device, resolve_device
from atdnode.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()


def _home(tmp_path, device: str | None = None) -> NodeHome:
    home = NodeHome.at(tmp_path / "h")
    init_home(home, consortium="demo")
    if device is not None:
        cfg = NodeConfig.load(home)
        cfg.extra["compute"] = {"device": device}
        cfg.save(home)
    return home


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cpu:1", "cuda:-1", "", "mps"])
def test_bad_names_are_one_line_errors(bad):
    with pytest.raises(DeviceError, match="expected cpu, cuda or cuda:N"):
        parse_device(bad or " ")


def test_cpu_is_always_there():
    assert parse_device("CPU") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_default_is_cuda_when_present_else_cpu():
    assert resolve_device(None).type == ("cuda" if HAS_CUDA else "cpu")


def test_config_key_is_used_and_explicit_choice_wins(tmp_path):
    home = _home(tmp_path, "cpu")
    assert resolve_device(None, home=home) == torch.device("cpu")
    if not HAS_CUDA:
        with pytest.raises(DeviceError, match="CUDA is not available"):
            resolve_device("cuda", home=home)
    bad = _home(tmp_path / "b", "cuda:99")
    assert resolve_device("cpu", home=bad) == torch.device("cpu")  # the explicit choice wins
    with pytest.raises(DeviceError):
        resolve_device(None, home=bad)  # no machine has 100 GPUs here (nor CUDA, on CI)


def test_config_type_is_checked(tmp_path):
    home = _home(tmp_path)
    cfg = NodeConfig.load(home)
    cfg.extra["compute"] = {"device": 1}
    with pytest.raises(ConfigError, match="compute.device"):
        cfg.compute_device()
    cfg.extra["compute"] = "cuda"
    with pytest.raises(ConfigError, match=r"\[compute\]"):
        cfg.compute_device()


def test_index_past_the_last_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda", local_rank=1) == torch.device("cuda", 1)  # one GPU per torchrun rank
    assert resolve_device(None, local_rank=3) == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match="has 2 CUDA device"):
        resolve_device("cuda:2")


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
@pytest.mark.parametrize("cmd", [["train", "--data", "digits"], ["classify", "--data", "digits"],
                                 ["split", "join", "--server", "x", "--task", "t", "--data", "digits"]])
def test_cli_cuda_on_cpu_machine_is_one_line_error(tmp_path, cmd, capsys, monkeypatch):
    """Each command: the error comes before any data loads (no run dir), one line (`cli.app.run`,
    what the console script runs; the process itself is checked below)."""
    from atdnode.learning import ENV
    from cli.app import run

    monkeypatch.delenv(ENV, raising=False)  # whatever the command sets stays in this test
    home = _home(tmp_path)
    capsys.readouterr()
    assert run([*cmd, "--home", str(home.root), "--device", "cuda"]) != 0
    err = capsys.readouterr().err.strip()
    assert "CUDA is not available" in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not (home.root / "runs").exists() or not any((home.root / "runs").iterdir())


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
@pytest.mark.slow  # an atd process
def test_cli_cuda_on_cpu_machine_process_is_one_line_error(tmp_path):
    """As pip installs it: `atd train --device cuda` exits non-zero with one line on stderr."""
    home = _home(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "cli.app", "train", "--data", "digits", "--home", str(home.root),
                        "--device", "cuda"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode != 0
    err = r.stderr.strip()
    assert "CUDA is not available" in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not (home.root / "runs").exists() or not any((home.root / "runs").iterdir())


def test_env_sits_between_the_argument_and_the_config(tmp_path, monkeypatch):
    from atdnode.learning import ENV, apply_device

    home = _home(tmp_path, "cuda:99")
    monkeypatch.setenv(ENV, "cpu")
    assert resolve_device(None, home=home) == torch.device("cpu")  # $ATD_DEVICE beats the config
    monkeypatch.setenv(ENV, "")
    with pytest.raises(DeviceError):
        resolve_device(None, home=home)  # empty: the config's (impossible) choice applies
    assert apply_device("CPU", home) == torch.device("cpu")
    assert os.environ[ENV] == "cpu"  # a command's --device reaches the processes it starts
    with pytest.raises(DeviceError, match="expected"):
        apply_device("tpu", home)


def test_uint8_residency_only_when_lossless():
    from atdnode.data import MEAN, STD
    from atdnode.learning.devdata import DeviceImages, lossless_uint8

    q = torch.randint(0, 256, (10, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    x = (q.float() / 255.0 - MEAN) / STD  # the loader's normalisation of 8-bit data
    assert torch.equal(lossless_uint8(x, torch.device("cpu")), q)
    assert lossless_uint8(x + 1e-4, torch.device("cpu")) is None  # resized / windowed data stays float
    imgs = DeviceImages(x, torch.arange(10), torch.device("cpu"))  # on the CPU: the host tensor, as before
    src = torch.tensor([4, 0, 4])
    assert imgs.kind == "host" and torch.equal(imgs.gather(src), x[src]) and imgs.gather_labels(src).tolist() == [4, 0, 4]
