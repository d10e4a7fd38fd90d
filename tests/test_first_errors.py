"""The errors a newcomer meets first are one clear line (stderr, rc != 0): a model that is not
a ViT, a near-miss ViT name, a device this machine lacks (before any data is read), a bad
`window=` and an unknown data-spec option."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atdnode.node import NodeHome, init_home
from cli.app import run

REPO = Path(__file__).resolve().parents[1]
TINY = ["--img-size", "16", "--patch-size", "8", "--embed-dim", "32", "--depth", "1", "--heads", "2", "--epochs", "1"]
# a device this machine does not have: CUDA on a CPU host, one index past the last GPU elsewhere
MISSING_DEVICE = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> str:
    h = NodeHome.at(tmp_path_factory.mktemp("first") / "node")
    init_home(h, consortium="demo")
    return str(h.root)


@pytest.mark.parametrize("args, expect", [
    (["--model", "resnet50"], ["model 'resnet50' is not a ViT", "atd trains timm ViTs (vit_*"]),
    (["--model", "vit_tiny_patch16"], ["unknown timm model 'vit_tiny_patch16'", "did you mean 'vit_tiny_patch16_224'"]),
    (["--model", "vit_tiny_patch16_224", "--device", MISSING_DEVICE, "--data", "folder:/no/such/folder"],
     [f"device '{MISSING_DEVICE}'", "this machine"]),
    (["--model", "vit_tiny_patch16_224", "--data", "digits?window=abc"],
     ["window=abc: expected lo,hi (numbers, lo < hi), auto or minmax"]),
    (["--model", "vit_tiny_patch16_224", "--data", "digits?windw=0,16"], ["unknown option 'windw' (did you mean 'window'?)"]),
    (["--model", "vit_tiny_patch16_224", "--data", "folders:/x"], ["did you mean 'folder'"]),
])
def test_first_errors_are_one_clear_line(home, args, expect, capsys):
    assert run(["train", "--home", home, *TINY, *args]) != 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in out + err, err
    for text in expect:
        assert text in err, err
    assert "/no/such/folder" not in err  # the device is checked before any data is read
    assert "unexpected keyword" not in err and "could not convert" not in err


@pytest.mark.slow  # atd as OS processes
def test_as_a_real_process(home):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "cli.app", "train", "--home", home, "--model", "resnet50", *TINY],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "is not a ViT" in r.stderr, r.stderr


def test_a_misspelt_class_name_gets_a_suggestion(tmp_path):
    import numpy as np
    from PIL import Image

    from atdnode.data import load_dataset
    from atdnode.errors import DataError

    for c in ("normal", "pneumonia"):
        (tmp_path / c).mkdir()
        for i in range(3):
            Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / c / f"{i}.png")
    with pytest.raises(DataError, match=r"unknown classes \['pneumona'\] \(did you mean 'pneumonia'\?\)"):
        load_dataset(f"folder:{tmp_path}?classes=pneumona,normal", 8, 1)
