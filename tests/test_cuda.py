"""The node's learning steps on a CUDA device: train, classify, features, data
resident on the GPU, one split (p-FESTA) server step, one FESTA and one p-FESTA client step,
one rounds step. Each result is checked against the same step on the CPU in the same test.
Run with `pytest -m cuda` on a GPU machine; skipped where there is no CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from atdnode.blobs import BlobStore
from atdnode.data import MEAN, STD, LabeledImages, load_dataset
from atdnode.node import NodeHome, init_home
from atdnode.learning import TrainOptions, build_model, resolve_config, train
from atdnode.models import load_weights

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DATA = "digits?limit=300"
CFG = resolve_config("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)


def _home(tmp_path, name: str) -> NodeHome:
    home = NodeHome.at(tmp_path / name)
    init_home(home, consortium="demo")
    return home


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The same run on both devices: (cuda record, cpu record, cuda home, cpu home)."""
    tmp = tmp_path_factory.mktemp("cuda")
    out = []
    for i, dev in enumerate(("cuda", "cpu")):
        home = _home(tmp, f"{i}-{dev}")
        logs: list[str] = []
        rec = train(home, "digits?limit=600", CFG, TrainOptions(epochs=6, batch_size=16, lr=3e-3, seed=1, device=dev,
                                                               log=logs.append))  # augmentation on, as by default
        assert any(f"on {dev}" in m for m in logs), logs  # really on that device
        out.append((rec, home))
    return out


def test_train_on_cuda_learns_and_exports_cpu_safetensors(trained):
    (gpu, gh), (cpu, _) = trained
    chance = 1 / len(gpu.labels)
    assert gpu.metrics["accuracy"] > 2 * chance  # it learned (10 classes)
    assert gpu.metrics["accuracy"] > cpu.metrics["accuracy"] - 0.15  # about as well as the same run on the CPU
    tensors, _ = load_weights(BlobStore(gh.blobs_dir), gpu.blobs["full"])
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors.values())


def test_classify_on_cuda_agrees_with_cpu(trained):
    from atdnode.learning import run_classify as classify

    (_, gh), _ = trained
    a = classify(gh, DATA, device="cuda").metrics
    b = classify(gh, DATA, device="cpu").metrics
    assert abs(a["accuracy"] - b["accuracy"]) < 0.03  # bf16 on the GPU, float32 on the CPU


def test_features_on_cuda_match_cpu():
    from atdnode.learning import extract_features

    data = load_dataset(DATA, CFG.img_size, CFG.in_chans, "train")
    torch.manual_seed(0)
    model = build_model(CFG.with_classes(len(data.classes)))
    xc, yc = extract_features(model, data, 64, device="cpu")
    xg, yg = extract_features(model, data, 64, device="cuda")
    assert xg.dtype == np.float32 and xg.shape == xc.shape and (yg == yc).all()
    cos = (xc * xg).sum(1) / (np.linalg.norm(xc, axis=1) * np.linalg.norm(xg, axis=1))
    assert cos.min() > 0.99


def test_uint8_data_lives_on_the_gpu_and_comes_back_bit_for_bit():
    from atdnode.learning.devdata import DeviceImages

    q = torch.randint(0, 256, (40, 3, 8, 8), dtype=torch.uint8)
    x = (q.float() / 255.0 - MEAN) / STD
    imgs = DeviceImages(x, torch.zeros(40, dtype=torch.long), torch.device("cuda"))
    assert imgs.kind == "uint8"
    src = torch.tensor([3, 1, 39, 3])
    assert torch.equal(imgs.gather(src).cpu(), x[src])
    blurred = DeviceImages(x + 1e-3, torch.zeros(40, dtype=torch.long), torch.device("cuda"))
    assert blurred.kind == "float32" and torch.equal(blurred.gather(src).cpu(), (x + 1e-3)[src])


def test_one_pfesta_server_step_on_cuda_matches_cpu():
    from protocols import pfesta
    from protocols.split_parts import TaskSpec, split_config

    scfg = split_config()
    outs = {}
    for dev in ("cpu", "cuda"):
        srv = pfesta.PFestaServer(scfg, [TaskSpec("t", "classification", 3)], batch_size=8, seed=3, device=dev)
        srv.join("c", "t", 16)
        feats = torch.randn(16, *srv.token_shape, generator=torch.Generator().manual_seed(0))
        srv.receive_features("c", 0, feats)
        idx = srv.next_indices("c")
        out = srv.forward("c", idx)
        assert out.device.type == "cpu" and out.dtype == torch.float32  # what goes on the wire
        srv.backward("c", torch.ones_like(out) * 1e-2)
        after = srv.forward("c", idx)
        outs[dev] = (out, after)
    (o1, a1), (o2, a2) = outs["cpu"], outs["cuda"]
    assert (o1 - o2).abs().mean() < 0.05 and (o1 - o2).abs().max() < 0.5  # bf16 autocast on the GPU
    assert not torch.equal(a2, o2) and (a1 - a2).abs().mean() < 0.05  # the body stepped, alike on both


def test_one_split_client_step_on_cuda_matches_cpu():
    """`atd split join`'s FESTA and p-FESTA client parts on CUDA: one step each
    against a CPU server; what crosses the wire is CPU float32 either way, the loss is alike."""
    from protocols import festa, pfesta
    from protocols.split_parts import TaskSpec, build_plain_embedder, digits_images, split_config

    x, y = digits_images(16)
    cfg, t = split_config(), TaskSpec("t", "classification", 10)
    losses = {}
    for dev in ("cpu", "cuda"):
        c = festa.FestaClient("c", cfg, t, x[:32], y[:32], batch_size=8, seed=1, device=dev)
        srv = festa.FestaServer(cfg, [t], seed=1)
        srv.join("c", "t")
        srv.begin_round(1, deadline=1.0)
        feats = c.head_forward()
        assert next(c.head.parameters()).device.type == dev
        g, loss = c.tail_step(srv.forward("c", "t", feats))
        c.head_backward(srv.backward("c", g))
        assert all(v.device.type == "cpu" for v in (feats, g, *c.part_state().values()))
        p = pfesta.PFestaClient("c", cfg, t, x[:32], y[:32], build_plain_embedder(cfg), seed=1, device=dev)
        (_, up), = list(p.upload_chunks(64))
        psrv = pfesta.PFestaServer(cfg, [t], batch_size=8, seed=1)
        psrv.join("c", "t", 32)
        psrv.receive_features("c", 0, up)
        psrv.begin_round(1, deadline=1.0)
        idx = psrv.next_indices("c")
        pg, ploss = p.tail_step(idx, psrv.forward("c", idx))
        assert up.device.type == pg.device.type == "cpu" and next(p.tail.parameters()).device.type == dev
        losses[dev] = (loss, ploss)
    for a, b in zip(losses["cpu"], losses["cuda"]):
        assert abs(a - b) < 0.05 * max(1.0, abs(a)), losses


def test_one_rounds_step_trains_on_cuda(tmp_path):
    import trio

    from atdnode.rounds import RoundRunner, RoundsConfig
    from tests.vgs_homes import cfg, consortium

    (home,) = consortium(tmp_path, ["a"])
    r = RoundRunner(home, RoundsConfig(data="digits?limit=120", cfg=cfg(), rounds=1, lr=3e-3, device="cuda"))
    rec = r.train_round(0, trio.run(r.global_blob, 0))
    tensors, _ = load_weights(r.store, rec.blobs["full"])
    assert all(t.device.type == "cpu" for t in tensors.values())
    assert "round" in str(rec.provenance) or rec.provenance.get("run_key")
