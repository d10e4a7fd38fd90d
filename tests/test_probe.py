"""LP-FT's probe (`atdnode.learning.probe`): the fresh head alone on the frozen start, then fine-tuning.

What each test pins: the probe moves the head and nothing of the extractor; the caller's
freeze setting survives it; it runs only where the head is fresh (an extractor start), both
in netsim's trainer and in `atd train`; it is part of the run key (and an old run key does
not change); and it keeps more of the start's features than one-stage fine-tuning.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atdnode.learning import ddp
from atdnode.data import LabeledImages
from atdnode.node import NodeHome, init_home
from atdnode.learning import (TrainOptions, build_model, extractor_state, freeze_blocks, probe_head, resolve_config,
                              train)
from atdnode.learning.probe import fresh_head, probe_lr
from atdnode.learning.train_options import run_key
from netsim.learn import full_state, train_model

torch.set_num_threads(1)
ARCH = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)


def cfg(classes: int = 3, **kw):
    return resolve_config("vit_tiny_patch16_224", num_classes=classes, **ARCH, **kw)


def data(n: int = 96, classes: int = 3, seed: int = 0) -> LabeledImages:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    x = torch.randn(n, 3, 16, 16, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float()  # learnable: class shifts the mean
    return LabeledImages(x, y, [str(c) for c in range(classes)])


def opts(**kw) -> TrainOptions:
    return TrainOptions(**{"epochs": 1, "batch_size": 16, "lr": 1e-3, "seed": 0, "augment": False, "plots": False,
                           **kw})


@pytest.mark.parametrize("stem", ["patch", "conv"])  # conv: the stem's BatchNorm statistics stay too
def test_probe_moves_the_head_only_and_restores_what_trains(stem):
    torch.manual_seed(0)
    model = build_model(cfg(stem=stem))
    freeze_blocks(model, 1)  # the caller's setting: embeddings + block 0 frozen
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {k: p.requires_grad for k, p in model.named_parameters()}
    stats = probe_head(model, data(), opts(probe_epochs=2), ddp.DistContext(device=torch.device("cpu")))
    assert [s["epoch"] for s in stats] == [1, 2]
    after = model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert "head.weight" in moved and "head.bias" in moved
    assert not {k for k in moved if k.startswith(("blocks.", "patch_embed.", "pos_embed", "cls_token"))}, moved
    assert {k: p.requires_grad for k, p in model.named_parameters()} == grads


def test_no_probe_epochs_is_a_no_op():
    model = build_model(cfg())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert probe_head(model, data(), opts(), ddp.DistContext(device=torch.device("cpu"))) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_probe_refuses_several_processes():
    from atdnode.errors import ConfigError

    ctx = ddp.DistContext(world=2, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="--nproc-per-node > 1"):
        probe_head(build_model(cfg()), data(), opts(probe_epochs=1), ctx)


def test_probe_rate_defaults_to_five_times_the_fine_tuning_rate():
    assert probe_lr(opts(lr=2e-3), 32) == pytest.approx(1e-2)
    assert probe_lr(opts(lr=2e-3, probe_lr=5e-3), 32) == 5e-3
    from atdnode.errors import ConfigError

    for bad in (0.0, -1e-3, float("nan")):
        with pytest.raises(ConfigError, match="--probe-lr must be a positive rate"):
            probe_lr(opts(probe_lr=bad), 32)


def test_fresh_head_rule():
    assert fresh_head({"init_part": "extractor"}, opts())
    assert not fresh_head({"init_part": "full"}, opts())  # a same-label full set brings its head
    assert not fresh_head({"init_part": None}, opts())  # from scratch: nothing to keep
    assert fresh_head({"init_part": None}, opts(pretrained=True))


def test_run_key_names_the_probe_and_keeps_old_keys():
    c = cfg()
    plain = run_key("digits", c, opts())
    assert run_key("digits", c, opts(probe_epochs=0, probe_lr=1e-2)) == plain  # no probe: the key of before
    assert run_key("digits", c, opts(probe_epochs=3)) != plain
    assert run_key("digits", c, opts(probe_epochs=3)) != run_key("digits", c, opts(probe_epochs=3, probe_lr=1e-2))


def test_netsim_trainer_probes_a_fresh_head_only():
    torch.manual_seed(1)
    start = build_model(cfg())
    d = data()
    with_probe, without = opts(probe_epochs=1, lr=1e-3), opts(lr=1e-3)
    ext = extractor_state(start)
    a = train_model(cfg(), d, with_probe, seed=0, init=ext, init_part="extractor")
    b = train_model(cfg(), d, without, seed=0, init=ext, init_part="extractor")
    assert not torch.equal(a.model.head.weight, b.model.head.weight)  # the probe ran
    full = full_state(start)  # a full start brings its head: the probe must not run
    c = train_model(cfg(), d, with_probe, seed=0, init=full, init_part="full")
    e = train_model(cfg(), d, without, seed=0, init=full, init_part="full")
    assert all(torch.equal(v, e.model.state_dict()[k]) for k, v in c.model.state_dict().items())


def test_lp_ft_keeps_more_of_the_start_than_one_stage_fine_tuning():
    """Kumar et al.'s claim, at test scale: from a trained start, after the same fine-tuning
    steps on a new task, the two-stage run's blocks are nearer the start than the one-stage
    run's (the random head's early gradients are what pull them away)."""
    pre = train_model(cfg(), data(n=128, seed=3), opts(epochs=3, lr=3e-3), seed=0)  # the "public" start
    start = extractor_state(pre.model)
    d = data(n=128, classes=4, seed=4)  # another task: four classes
    dist = {}
    for probe in (0, 3):
        t = train_model(cfg(4), d, opts(epochs=2, lr=3e-3, probe_epochs=probe, probe_lr=3e-2), seed=0, init=start)
        got = extractor_state(t.model)
        body = [k for k in start if k.startswith(("blocks.", "patch_embed.", "pos_embed", "cls_token"))]
        dist[probe] = float(sum((got[k] - start[k]).double().pow(2).sum() for k in body) ** 0.5)
    assert dist[3] < dist[0], dist


def test_atd_train_probes_from_an_extractor_and_logs_it(tmp_path: Path):
    a_home, b_home = NodeHome.at(tmp_path / "a"), NodeHome.at(tmp_path / "b")
    init_home(a_home, consortium="demo")
    init_home(b_home, consortium="demo")
    c = resolve_config("vit_tiny_patch16_224", **ARCH)
    a = train(a_home, "digits?classes=0,1,2&limit=90", c, opts(epochs=1))
    from atdnode.blobs import BlobStore

    b_store = BlobStore(b_home.blobs_dir)
    b_store.put_bytes(BlobStore(a_home.blobs_dir).get_bytes(a.blobs["extractor"]))
    logs: list[str] = []
    b = train(b_home, "digits?classes=3,4,5&limit=90", c,
              opts(epochs=1, init_from=a.blobs["extractor"], probe_epochs=2, log=logs.append))
    assert sum(m.startswith("probe epoch") for m in logs) == 2
    assert b.provenance["init_part"] == "extractor"
    # from scratch there is no start to keep: no probe, even when asked
    logs.clear()
    train(b_home, "digits?classes=3,4,5&limit=90", c, opts(epochs=1, probe_epochs=2, log=logs.append))
    assert not any("probe epoch" in m for m in logs)
