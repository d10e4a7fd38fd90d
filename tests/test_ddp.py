"""Two DDP processes (torchrun, gloo, CPU) train the same model as one process, within tolerance."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from atdnode.blobs import BlobStore
import pytest

from atdnode.learning import check_nproc
from atdnode.learning.ddp import DistContext
from atdnode.learning import DeviceError, TrainOptions, resolve_config, train
from atdnode.node import NodeHome, init_home
from atdnode.models import ModelRegistry, load_weights

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
# 200 samples, global batch 30: the last batch (20) splits 10/10, and 30 splits 15/15
DATA = "digits?limit=200"
ARGS = ["--data", DATA, "--model", "vit_tiny_patch16_224", "--img-size", "16", "--patch-size", "4",
        "--embed-dim", "32", "--depth", "2", "--heads", "2", "--epochs", "2", "--batch-size", "30",
        "--lr", "1e-3", "--seed", "3", "--device", "cpu"]  # gloo on CPU, also on a one-GPU machine


def test_rank_slices_cover_a_batch():
    for n in (1, 7, 30):
        for world in (1, 2, 3):
            parts = [DistContext(rank=r, world=world).slice(n) for r in range(world)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


@pytest.mark.slow  # torchrun: two training processes and one more
def test_two_process_ddp_matches_one_process(tmp_path):
    ddp_home = NodeHome.at(tmp_path / "ddp")
    init_home(ddp_home, consortium="demo")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python",
           sys.executable, "-m", "cli.app", "train", "--home", str(ddp_home.root), *ARGS, "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "on cpu x2" in r.stderr  # really two processes
    recs = ModelRegistry(ddp_home).list()
    assert len(recs) == 1  # only rank 0 registers
    multi = recs[0]

    one_home = NodeHome.at(tmp_path / "one")
    init_home(one_home, consortium="demo")
    cfg = resolve_config("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)
    single = train(one_home, DATA, cfg, TrainOptions(epochs=2, batch_size=30, lr=1e-3, seed=3, device="cpu"))

    for a, b in zip(multi.metrics["history"], single.metrics["history"]):
        assert abs(a["loss"] - b["loss"]) < 1e-4 and abs(a["accuracy"] - b["accuracy"]) < 0.02
    ta, _ = load_weights(BlobStore(ddp_home.blobs_dir), multi.blobs["full"])
    tb, _ = load_weights(BlobStore(one_home.blobs_dir), single.blobs["full"])
    worst = max((ta[k] - tb[k]).abs().max().item() for k in ta)
    assert worst < 1e-4, worst
    # and the weights did move away from each other's init: the comparison is not vacuous
    assert single.metrics["history"][0]["loss"] != single.metrics["history"][1]["loss"]


def test_more_ranks_than_gpus_is_one_line_error(monkeypatch):
    """NCCL stops with "Duplicate GPU detected" when two ranks share a GPU: refuse first."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DeviceError, match="needs 2 GPUs, this machine has 1"):
        check_nproc(2)
    with pytest.raises(DeviceError, match="every rank would use one GPU"):
        check_nproc(2, "cuda:0")
    check_nproc(2, "cpu")  # gloo on the CPU: any number of ranks
    check_nproc(1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_nproc(2)


@pytest.mark.slow  # an atd process
def test_nproc_on_cpu_machine_with_cuda_is_one_line_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    home = NodeHome.at(tmp_path / "h")
    init_home(home, consortium="demo")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "cli.app", "train", "--home", str(home.root), "--data", "digits?limit=1",
                        "--nproc-per-node", "2", "--device", "cuda"], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=120)
    assert r.returncode != 0
    assert "CUDA is not available" in r.stderr and "Traceback" not in r.stderr
    assert not (home.root / "runs").exists() or not any((home.root / "runs").iterdir())
