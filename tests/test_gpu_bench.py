"""bench/gpu_bench.py: its whole code path runs on the CPU (--dry-run, tiny model), and
without CUDA the real run is a one-line refusal."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "bench" / "gpu_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_prints_every_figure(capsys):
    assert _bench().main(["--dry-run"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dry_run"] and out["matmul_tflops"]["tflops"] > 0
    (m,) = out["models"].values()
    for k in ("atd_default", "atd_no_augment", "plain"):
        assert m[k]["images_per_s"] > 0 and m[k]["tflops"] >= 0
    assert m["atd_default"]["samples_per_epoch"] > m["atd_no_augment"]["samples_per_epoch"]  # the small class grew
    assert m["train_gflop_per_image"] > m["forward_gflop_per_image"] > 0
    assert set(m["inference_images_per_s"]) == {"features_atd", "features_plain", "classify_atd", "classify_plain"}
    assert m["pfesta"]["server_steps_per_s"] > 0 and m["pfesta"]["plain_steps_per_s"] > 0


def test_dry_run_builds_a_conv_stem_on_both_sides(capsys):
    """--stem conv: atd's side and the plain loop run the same conv-stem ViT (build_model)."""
    assert _bench().main(["--dry-run", "--stem", "conv"]) == 0
    (m,) = json.loads(capsys.readouterr().out)["models"].values()
    assert m["model"]["stem"] == "conv" and m["plain"]["images_per_s"] > 0
    assert m["inference_images_per_s"]["features_plain"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.slow  # a bench process
def test_without_cuda_it_refuses_in_one_line():
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_bench.py")], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "no CUDA device" in r.stderr
