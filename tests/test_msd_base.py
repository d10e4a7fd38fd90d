"""The consortium's own base: an MSD campaign on the in-memory network, then
`atd base build` on its clients assembles a timm ViT extractor equal to the campaign's
embedder + distilled body; a member that is no client cannot; `atd base publish` shares it
with the clients only; `atd train --init-from <model id>` starts from it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as Fn
import trio

from atdnode.blobs import BlobStore
from atdnode.node import NodeIdentity
from atdnode.learning import ModelConfig, build_model, resolve_config
from atdnode.learning.model import cls_features, import_part
from atdnode.split import BaseBuildError, build_base, publish_base
from atdnode.split.base import assemble, base_config
from atdnode.split.secret import open_secret
from atdnode.learning import TrainOptions, train
from atdnode.transport import MemoryNetwork
from atdnode.models import load_weights
from cli.app import run
from ledger import Ledger
from protocols.split_parts import SplitBody, build_plain_embedder, digits_images, split_config
from tests.factories import daemon_on, make_consortium
from tests.split_checks import spread
from tests.splitnet import BODY, client, configure, data

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    """Server n0, clients n1 and n2, and n3: a member that took no part (no key announced)."""
    homes = make_consortium(tmp_path_factory.mktemp("msdbase"), 4)
    configure(homes[0], "msd-server", msd={"steps": 10, "batch_size": 64})  # the split default: MLP ratio 2
    net = MemoryNetwork(seed=31)

    async def main() -> None:
        server = daemon_on(net, homes[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, [], [])
            async with trio.open_nursery() as clients:
                for home, i in ((homes[1], 1), (homes[2], 2)):
                    clients.start_soon(lambda h=home, i=i: client(net, h, server, "digit", data(i, limit=80),
                                                                  finetune_steps=0, evaluate=False))
            server.stop()

    trio.run(main)
    spread(homes)
    return homes


def test_assembled_extractor_is_embedder_plus_body(campaign) -> None:
    homes = campaign
    rec = build_base(homes[1])
    assert rec.provenance["kind"] == "msd-base" and rec.labels == []
    with Ledger.open(homes[1].ledger_db) as led:
        (w,) = [e for e in led.query(kind="weights") if e.body.get("part") == "body"]
        service = w.body["model"]["service"]
        embedder_state = open_secret(NodeIdentity.load(homes[1]), led, w.body["model"]["secret"], service,
                                     split_config(w.body["model"]["split"]))
    assert rec.provenance["campaign"] == service and rec.provenance["body_entry"] == w.id.hex()
    store = BlobStore(homes[1].blobs_dir)
    cfg = split_config(w.body["model"]["split"])
    body = SplitBody(cfg)
    body.load_state_dict(load_weights(store, w.body["blob"])[0])
    embedder = build_plain_embedder(cfg, state=embedder_state)
    # the registered weight set, loaded as `atd train --init-from` loads it
    mcfg = ModelConfig.from_dict(rec.model)
    model = build_model(mcfg).eval()
    import_part(store, rec.blobs["extractor"], model, mcfg, label_fp=None, part="extractor")
    x = digits_images(cfg.img_size)[0][:40]
    with torch.no_grad():
        tokens = body.eval()(embedder(x))  # the campaign's own forward pass (MSDNet's first stage)
        assert torch.allclose(model.blocks(model._pos_embed(model.patch_embed(x))), tokens, atol=1e-5)
        normed = Fn.layer_norm(tokens, (cfg.embed_dim,), eps=1e-6)
        assert torch.allclose(model.forward_features(x), normed, atol=1e-5)
        assert torch.allclose(cls_features(model, x), normed.mean(1), atol=1e-5)
        # and not trivially: another body gives other features
        assert not torch.allclose(SplitBody(cfg, seed=5).eval()(embedder(x)), tokens, atol=1e-3)
    # the other client assembles the same weight set (here through the CLI)
    assert run(["base", "build", "--home", str(homes[2].root), "--campaign", service[:16]]) == 0
    from atdnode.models import ModelRegistry

    assert ModelRegistry(homes[2]).get("latest").blobs["extractor"] == rec.blobs["extractor"]


def test_non_client_member_cannot_assemble(campaign) -> None:
    homes = campaign
    with pytest.raises(BaseBuildError, match="not a recipient"):
        build_base(homes[3])
    with pytest.raises(BaseBuildError, match="not a recipient"):
        build_base(homes[0])  # the server least of all
    assert run(["base", "build", "--home", str(homes[3].root)]) != 0


def test_unfinished_campaign_and_shape_mismatch(campaign) -> None:
    homes = campaign
    ident = NodeIdentity.load(homes[3])
    with Ledger.open(homes[3].ledger_db) as led:
        pending = led.append(ident.signer, "service", {"role": "msd-server", "protocol": "x"}).id.hex()
    with pytest.raises(BaseBuildError, match="has not finished"):
        build_base(homes[3], pending[:16])
    with pytest.raises(BaseBuildError, match="no finished MSD campaign"):
        build_base(homes[3], "ab" * 8)
    assert base_config(split_config(BODY)).mlp_ratio == 2.0  # timm builds the body's shape
    cfg = split_config(BODY)
    emb = build_plain_embedder(cfg, seed=1)
    from protocols.split_parts import embedder_state

    other = split_config(BODY, depth=1)
    with pytest.raises(BaseBuildError, match="shape mismatch"):
        assemble(cfg, embedder_state(emb), SplitBody(other).state_dict())
    wide = split_config(BODY, embed_dim=48)
    with pytest.raises(BaseBuildError, match="shape mismatch"):
        assemble(cfg, embedder_state(emb), SplitBody(wide).state_dict())


def test_publish_to_clients_only_and_train_from_it(campaign) -> None:
    homes = campaign
    rec = build_base(homes[1])
    pub = publish_base(homes[1])
    c2, server = NodeIdentity.load(homes[2]).peer_id, NodeIdentity.load(homes[0]).peer_id
    assert pub.readers == [c2] and server not in pub.readers
    assert not BlobStore(homes[0].blobs_dir).has(rec.blobs["extractor"])  # the server never held it
    b = pub.entry.body
    assert b["part"] == "extractor" and b["blob"] == rec.blobs["extractor"]
    assert rec.provenance["campaign"] in b["provenance"] and b["readers"] == [c2]
    with pytest.raises(BaseBuildError, match="not an MSD base"):
        publish_base(homes[1], model=_trained(homes[1], None).id)
    got = _trained(homes[1], rec.id)
    assert got.provenance["init_from"] == rec.blobs["extractor"]
    assert got.provenance["base"] == rec.provenance["base"]  # every follower shares the campaign's base


def _trained(home, init):
    cfg = resolve_config("vit_base_patch16_gap_224", img_size=16, patch_size=4, embed_dim=32, depth=2,
                          num_heads=2, in_chans=1, mlp_ratio=2.0)
    return train(home, "digits?shard=1/2&limit=80", cfg, TrainOptions(epochs=1, batch_size=32, init_from=init,
                                                                       augment=False, epoch_eval=False, plots=False))


# ---------------------------------------------------------------------------- netsim

def _tiny_raw(**scenario) -> dict:
    import json

    from tests.netsim_tiny import TINY

    raw = json.loads(json.dumps(TINY))
    raw["scenario"].update({"methods": ["vgs-atd", "centralized"], **scenario})
    raw["cohorts"] = raw["cohorts"][:1]  # phase 1 only: two nodes
    raw["msd"] = {"steps": 8, "batch_size": 64, "finetune_lr": 2e-3}
    return raw


def test_scenario_base_option_validates() -> None:
    from netsim.scenario import ScenarioError, load_scenario, scenario_from_dict, shipped_scenario

    assert scenario_from_dict(_tiny_raw()).base == "scratch"  # the default: nothing changes
    scn = scenario_from_dict(_tiny_raw(base="msd"))
    assert scn.base == "msd" and scn.msd.steps == 8
    assert load_scenario(shipped_scenario("three_phase")).replace(base="msd").msd.teacher_keep == 0.75
    for change, where in (({"scenario": {"base": "imagenet"}}, "scenario.base"),
                          ({"msd": {"student_keep": 0.0}}, "msd.student_keep"),
                          ({"msd": {"student_keep": 0.9, "teacher_keep": 0.5}}, "msd.student_keep"),
                          ({"msd": {"teacher_views": 1, "student_views": 0}}, "msd.student_views"),
                          ({"msd": {"steps": 0}}, "msd.steps"), ({"msd": {"finetune_lr": 0}}, "msd.finetune_lr"),
                          ({"msd": {"views": 3}}, "msd")):
        raw = _tiny_raw(base="msd")
        for k, v in change.items():
            raw[k].update(v)
        with pytest.raises(ScenarioError, match=where.replace(".", r"\.")):
            scenario_from_dict(raw)
    assert run(["netsim", "run", "three_phase", "--base", "msd,imagenet"]) != 0  # refused before anything runs


def test_base_comparison_rows() -> None:
    from netsim.run import base_comparison

    ph = lambda p, a: {"phase": p, "overall": {"accuracy": a}}  # noqa: E731
    rows = base_comparison({"vgs-atd (scratch)": [ph(1, 0.5), ph(2, 0.6)], "vgs-atd (msd)": [ph(1, 0.7)]})
    assert rows == [{"phase": 1, "vgs-atd (scratch)": 0.5, "vgs-atd (msd)": 0.7},
                    {"phase": 2, "vgs-atd (scratch)": 0.6, "vgs-atd (msd)": None}]


def test_netsim_base_msd_runs_campaign_then_vgs_from_the_base(short_tmp: Path) -> None:
    _netsim_base_msd(short_tmp)


def _netsim_base_msd(tmp_path: Path) -> None:
    from atdnode.node import NodeHome
    from atdnode.models import ModelRegistry
    from netsim.run import run_scenario
    from netsim.scenario import scenario_from_dict

    rep = run_scenario(scenario_from_dict(_tiny_raw(base="msd")), keep_homes=tmp_path)
    msd = rep["msd_base"]
    assert msd["model"]["name"] == "vit_base_patch16_gap_224" and set(msd["bytes_per_client"]) == {"a1", "a2"}
    assert all(b["up"] > 0 and b["down"] > 0 for b in msd["bytes_per_client"].values())
    (work,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    files = sorted((work / "msd" / "base").glob("*.safetensors"))
    assert [f.stem for f in files] == ["a1", "a2"] and files[0].read_bytes() == files[1].read_bytes()
    _assert_seeded_embedder(files[0], scenario_from_dict(_tiny_raw(base="msd")))
    for n in ("a1", "a2"):  # every VGS-ATD model descends from the campaign's base
        recs = ModelRegistry(NodeHome.at(work / "vgs" / "homes" / n)).list()
        trained = [r for r in recs if r.provenance.get("run_key")]
        assert trained and all(r.provenance["base"] == f"msd:{_body_entry(work)[:32]}" for r in trained)
        assert all(r.provenance["options"]["lr"] == 2e-3 for r in trained)  # [msd] finetune_lr, not [train] lr
    assert [p["phase"] for p in rep["methods"]["centralized-msd"]] == [1]
    from netsim.nodedata import load_scenario_data

    pooled = load_scenario_data(scenario_from_dict(_tiny_raw(base="msd"))).pooled_test(1).labels.numpy()
    majority = max(np.bincount(pooled)) / len(pooled)  # what a constant predictor scores
    assert rep["methods"]["vgs-atd"][0]["overall"]["accuracy"] > majority


def _assert_seeded_embedder(base_file: Path, scn) -> None:
    """netsim's campaign draws its embedder secret from the scenario seed (a reproducible run;
    `JoinOptions.secret_seed`): the base's patch projection and position table are that draw."""
    from safetensors.torch import load_file

    from protocols.split_parts import new_embedder_state, split_dict

    tensors = load_file(str(base_file))
    cfg = split_config(split_dict(scn.model))
    for k, v in new_embedder_state(cfg, seed=scn.seed).items():
        assert torch.equal(tensors[k.removeprefix("vit.")], v), k


def test_embedder_secret_seed_is_for_simulation_only() -> None:
    """A seeded secret is reproducible (netsim); the default draws from the OS every time."""
    from protocols.split_parts import new_embedder_state

    cfg = split_config(BODY)
    a, b, c = new_embedder_state(cfg, seed=3), new_embedder_state(cfg, seed=3), new_embedder_state(cfg)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["vit.pos_embed"], c["vit.pos_embed"])


def _body_entry(work: Path) -> str:
    from atdnode.node import NodeHome
    from atdnode.models import ModelRegistry

    (rec,) = [r for r in ModelRegistry(NodeHome.at(work / "msd" / "h" / "a1")).list()]
    return rec.provenance["body_entry"]
