"""One shared base from a checkpoint file on disk (`--init-from FILE`): nodes that start from
it descend from the same base whatever their seeds, and `atd aggregate` warns only when an
input descends from another start (README, "One shared base")."""
from __future__ import annotations

import json
from dataclasses import replace

import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from atdnode.aggregation.aggregate import base_warning
from atdnode.learning import TrainOptions, build_model, train
from atdnode.models import publish_weights
from cli.app import app
from ledger import Ledger
from tests.vgs_homes import cfg, consortium, sync

runner = CliRunner()


def test_nodes_starting_from_one_checkpoint_file_share_their_base(tmp_path):
    torch.manual_seed(123)  # the "pretrained" checkpoint: a timm model of the same architecture, 10 classes
    ckpt_model = build_model(replace(cfg(), num_classes=10))
    st = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in ckpt_model.state_dict().items()}, str(st))
    pth = tmp_path / "base.pth"  # the same weights as a torch checkpoint (read with weights_only)
    torch.save(ckpt_model.state_dict(), pth)

    homes = consortium(tmp_path / "homes", ["x", "y", "z"])
    starts = (str(st), str(pth), None)  # z starts from random init
    ids, recs = [], []
    for h, init, seed in zip(homes, starts, (1, 2, 1)):
        recs.append(train(h, "digits?classes=0,1", cfg(), TrainOptions(
            epochs=1, batch_size=16, lr=3e-3, warmup_epochs=0.2, init_from=init, seed=seed, augment=False,
            device="cpu", plots=False)))
        ids.append(publish_weights(h, part="full").entry.id.hex())
    assert [r.provenance["init_part"] for r in recs] == ["checkpoint", "checkpoint", None]
    sync(homes)
    with Ledger.open(homes[0].ledger_db) as led:
        entries = [led.get(i) for i in ids]
    assert entries[0].body["base"] == entries[1].body["base"] != entries[2].body["base"]  # seeds, formats: one start
    assert base_warning(entries[:2]) is None  # what `atd aggregate` prints (tests/test_aggregate_cli.py)
    assert "2 different starts" in base_warning(entries)
    res = runner.invoke(app, ["aggregate", "--home", str(homes[0].root), "--classifier", "head", "--inputs",
                              ",".join(ids[:2]), "--json"])
    assert res.exit_code == 0 and "warnings" not in json.loads(res.stdout.strip().splitlines()[-1])
