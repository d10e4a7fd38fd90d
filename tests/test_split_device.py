"""The split clients follow the one device rule: `atd split join` resolves the node's
device (`--device`, $ATD_DEVICE, `[compute] device`, else CUDA when present) and the FESTA /
p-FESTA client parts run there, while what they send is CPU float32 tensors. On this CPU
machine the `meta` device stands in for an accelerator: the parts really move there. The
same step on CUDA is in tests/test_cuda.py (marker `cuda`)."""
from __future__ import annotations

import torch

from atdnode.node import NodeHome, init_home
from atdnode.split import JoinOptions
from atdnode.split.client import _make_role
from atdnode.split import SplitSettings
from protocols import festa, pfesta
from protocols.split_parts import TaskSpec, build_plain_embedder, digits_images, split_config


def test_join_builds_the_pfesta_client_on_the_resolved_device(tmp_path, monkeypatch):
    import atdnode.split.client as client_mod

    home = NodeHome.at(tmp_path / "h")
    init_home(home, consortium="demo")
    offer = SplitSettings().offer("pfesta")
    cfg = split_config(offer["body"])
    seen = []

    def resolve(pref=None, *, home=None, local_rank=0):  # what `--device X` resolved to
        seen.append(home)
        return torch.device("meta")

    monkeypatch.setattr(client_mod, "resolve_device", resolve)
    task = offer["tasks"][0]["name"]
    opts = JoinOptions(server="x", task=task, data="digits?limit=40", evaluate=False)
    role = _make_role(home, "me", offer, opts, build_plain_embedder(cfg).state_dict())
    assert seen and seen[0] is home  # the node's own [compute] device takes part
    c = role.client
    assert role.t.device == c.device == torch.device("meta")
    assert {p.device.type for p in [*c.embedder.parameters(), *c.tail.parameters()]} == {"meta"}
    assert next(role.embedder.parameters()).device.type == "cpu"  # the campaign's secret stays as loaded
    assert c.images.device.type == "cpu" and c.keys.device.type == "cpu"  # data and keys stay here


def test_festa_client_parts_on_the_device_and_cpu_on_the_wire():
    x, y = digits_images(16)
    cfg, t = split_config(), TaskSpec("cls", "classification", 10)
    on_meta = festa.FestaClient("a", cfg, t, x[:32], y[:32], batch_size=8, device="meta")
    assert {p.device.type for p in [*on_meta.head.parameters(), *on_meta.tail.parameters()]} == {"meta"}
    c = festa.FestaClient("a", cfg, t, x[:32], y[:32], batch_size=8, device="cpu")
    srv = festa.FestaServer(cfg, [t], lr=3e-3)
    srv.join("a", "cls")
    srv.begin_round(1, deadline=1.0)
    feats = c.head_forward()
    g, loss = c.tail_step(srv.forward("a", "cls", feats))
    c.head_backward(srv.backward("a", g))
    assert feats.dtype == g.dtype == torch.float32
    assert all(sent.device.type == "cpu" for sent in (feats, g, *c.part_state().values()))
    assert loss > 0


def test_pfesta_client_sends_cpu_tensors():
    x, y = digits_images(16)
    cfg, t = split_config(), TaskSpec("cls", "classification", 10)
    c = pfesta.PFestaClient("a", cfg, t, x[:32], y[:32], build_plain_embedder(cfg), device="cpu")
    (start, feats), = list(c.upload_chunks(64))
    g, _ = c.tail_step([0, 1], torch.randn(2, cfg.num_patches, cfg.embed_dim))
    assert feats.dtype == g.dtype == torch.float32
    assert all(sent.device.type == "cpu" for sent in (feats, g, *c.part_state().values()))
