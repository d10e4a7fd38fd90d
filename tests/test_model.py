"""The timm ViT split: extractor + head reproduce the model, weight-set export/import, checkpoints."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from atdnode.blobs import BlobStore
from atdnode.data import label_fingerprint
from atdnode.errors import ConfigError, WeightsError
from atdnode.learning import (ModelConfig, build_model, export_part, extractor_state, freeze_blocks, load_part,
                              resolve_config)
from atdnode.learning.model import cls_features, head_state, import_part, part_state, split_at
from protocols.vit_config import ModelConfigError

torch.set_num_threads(1)
NAME = "vit_tiny_patch16_224"
LABELS = [str(i) for i in range(5)]
FP = label_fingerprint(LABELS)


def tiny(**kw) -> ModelConfig:
    base = dict(img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=2, num_classes=5)
    base.update(kw)
    return resolve_config(NAME, **base)


@pytest.fixture
def store(tmp_path):
    return BlobStore(tmp_path / "blobs")


def test_resolve_reads_timm_defaults_and_round_trips():
    cfg = resolve_config(NAME)
    assert (cfg.img_size, cfg.patch_size, cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.in_chans) == (224, 16, 192, 12, 3, 3)
    small = tiny(in_chans=1)
    assert small.in_chans == 1 and small.depth == 3
    assert ModelConfig.from_dict(small.to_dict()) == small
    assert small.diff(tiny(depth=2, in_chans=1)) == ["depth 3 != 2"]
    with pytest.raises(ModelConfigError, match="missing"):
        ModelConfig.from_dict({"name": NAME})


@pytest.mark.parametrize("field, value, match", [
    ("depth", 0, "depth must be a positive integer"), ("patch_size", 2.5, "patch_size must be a positive integer"),
    ("embed_dim", True, "embed_dim must be a positive integer"), ("num_classes", -1, "num_classes must be an integer >= 0"),
    ("mlp_ratio", float("nan"), "mlp_ratio must be a positive number"), ("name", "", "non-empty string"),
    ("num_heads", 5, "embed_dim 192 is not divisible by num_heads 5")])
def test_a_bad_config_value_is_a_typed_error_naming_the_field(field, value, match):
    with pytest.raises(ModelConfigError, match=match) as err:
        ModelConfig(**{field: value})
    assert err.value.field == field and isinstance(err.value, ValueError)
    assert ModelConfig(num_classes=0).num_classes == 0  # a classifier-less extractor is fine
    if field not in ("name", "num_heads"):  # resolve_config checks an override before timm sees it
        with pytest.raises(ModelConfigError, match=match):
            resolve_config(NAME, **{field: value})


def test_unknown_model_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown timm model"):
        resolve_config("vit_does_not_exist")
    with pytest.raises(ConfigError, match="not a ViT"):
        resolve_config("resnet18")


def test_extractor_plus_head_reproduce_full_forward_exactly():
    torch.manual_seed(0)
    cfg = tiny()
    m = build_model(cfg).eval()
    x = torch.randn(4, 3, 16, 16)
    full = m(x)
    feats = cls_features(m, x)
    assert feats.shape == (4, m.num_features) == (4, cfg.embed_dim)
    assert torch.equal(m.head(feats), full)
    for k in range(cfg.depth + 1):
        front, back = split_at(m, k)
        tokens = front(x)  # (B, T, D)
        assert tokens.shape == (4, (16 // 4) ** 2 + 1, cfg.embed_dim)
        assert torch.equal(back(tokens), m.forward_features(x))
        assert torch.equal(m.forward_head(back(tokens)), full)
    with pytest.raises(ConfigError):
        split_at(m, cfg.depth + 1)


def test_split_halves_share_and_partition_the_extractor_parameters():
    m = build_model(tiny())
    front, back = split_at(m, 1)
    fp = {id(p) for p in front.parameters()}
    bp = {id(p) for p in back.parameters()}
    hp = {id(p) for p in m.head.parameters()}
    assert not fp & bp and not (fp | bp) & hp
    assert fp | bp | hp == {id(p) for p in m.parameters()}
    assert {id(m.cls_token), id(m.pos_embed)} <= fp


def test_extractor_and_head_keys_partition_the_state():
    m = build_model(tiny())
    ex, hd = extractor_state(m), head_state(m)
    assert set(hd) == {"head.weight", "head.bias"}
    assert not set(ex) & set(hd) and set(ex) | set(hd) == set(m.state_dict())
    for prefix in ("patch_embed.", "cls_token", "pos_embed", "blocks.2.", "norm."):
        assert any(k.startswith(prefix) for k in ex), prefix


def test_export_import_round_trip_all_parts(store):
    torch.manual_seed(1)
    cfg = tiny()
    src = build_model(cfg)
    hashes = {p: export_part(store, src, cfg, p, labels=LABELS, label_fp=FP, samples=7) for p in ("full", "extractor", "head")}
    for part, h in hashes.items():
        torch.manual_seed(99)
        dst = build_model(cfg)
        meta = import_part(store, h, dst, cfg, label_fp=FP, labels=LABELS)
        assert meta["part"] == part and meta["model"] == cfg.to_dict() and meta["labels"] == LABELS
        assert meta["samples"] == 7
        want = part_state(src, part)
        got = part_state(dst, part)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # deterministic: the same weights + meta are the same blob
    assert export_part(store, src, cfg, "full", labels=LABELS, label_fp=FP, samples=7) == hashes["full"]


def test_extractor_fits_another_label_space_but_head_and_full_do_not(store):
    cfg = tiny()
    src = build_model(cfg)
    ex = export_part(store, src, cfg, "extractor", labels=LABELS, label_fp=FP)
    full = export_part(store, src, cfg, "full", labels=LABELS, label_fp=FP)
    other = ["a", "b", "c"]
    ocfg = cfg.with_classes(3)
    dst = build_model(ocfg)
    import_part(store, ex, dst, ocfg, label_fp=label_fingerprint(other), labels=other)
    assert torch.equal(dst.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)
    with pytest.raises(WeightsError, match=r"num_classes 5 \(weights\) vs 3 \(model\)"):
        import_part(store, full, dst, ocfg, label_fp=label_fingerprint(other), labels=other)
    same_k = ["x", "y", "z", "u", "v"]
    with pytest.raises(WeightsError, match="another label space"):
        import_part(store, full, build_model(cfg), cfg, label_fp=label_fingerprint(same_k), labels=same_k)
    # ... but the extractor inside a full set can be taken explicitly
    dst2 = build_model(ocfg)
    import_part(store, full, dst2, ocfg, label_fp=None, part="extractor")
    assert torch.equal(dst2.pos_embed, src.pos_embed)


def test_mismatched_config_names_the_difference(store):
    cfg = tiny()
    h = export_part(store, build_model(cfg), cfg, "extractor", labels=LABELS, label_fp=FP)
    deeper = tiny(depth=4)
    with pytest.raises(WeightsError, match=r"depth 3 \(weights\) vs 4 \(model\)"):
        import_part(store, h, build_model(deeper), deeper, label_fp=FP)
    wider = tiny(embed_dim=48)
    with pytest.raises(WeightsError, match=r"embed_dim 32 \(weights\) vs 48"):
        import_part(store, h, build_model(wider), wider, label_fp=FP)


def test_load_part_checks_keys_shapes_and_finiteness():
    m = build_model(tiny())
    hd = head_state(m)
    with pytest.raises(WeightsError, match="missing"):
        load_part(m, {"head.weight": hd["head.weight"]}, "head")
    with pytest.raises(WeightsError, match="shape"):
        load_part(m, {"head.weight": torch.zeros(3, 32), "head.bias": hd["head.bias"]}, "head")
    bad = dict(hd, **{"head.bias": torch.full((5,), float("nan"))})
    with pytest.raises(WeightsError, match="NaN"):
        load_part(m, bad, "head")
    with pytest.raises(WeightsError, match="unknown weight part"):
        load_part(m, hd, "tail")


def test_checkpoint_files_safetensors_and_torch(tmp_path):
    torch.manual_seed(2)
    cfg = tiny()
    src = build_model(cfg)
    st = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(st))
    pth = tmp_path / "m.pth"
    torch.save({"state_dict": src.state_dict()}, pth)
    for path in (st, pth):
        dst = build_model(cfg, checkpoint=path)
        assert all(torch.equal(dst.state_dict()[k], v) for k, v in src.state_dict().items())
    # another class count: the extractor loads, the head stays at its own init
    ten = cfg.with_classes(10)
    dst = build_model(ten, checkpoint=st)
    assert torch.equal(dst.blocks[1].mlp.fc1.weight, src.blocks[1].mlp.fc1.weight)
    assert dst.head.weight.shape == (10, 32)
    # another image size: timm's filter resamples the position embedding
    big = tiny(img_size=32)
    assert build_model(big, checkpoint=st).pos_embed.shape == (1, 65, 32)


def test_checkpoint_errors(tmp_path):
    cfg = tiny()
    st = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in build_model(cfg).state_dict().items()}, str(st))
    with pytest.raises(WeightsError, match="missing"):
        build_model(tiny(depth=4), checkpoint=st)
    with pytest.raises(WeightsError, match="does not exist"):
        build_model(cfg, checkpoint=tmp_path / "nope.pth")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00not safetensors")
    with pytest.raises(WeightsError, match="cannot read"):
        build_model(cfg, checkpoint=junk)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil.pth"
    torch.save({"state_dict": Evil()}, evil)
    with pytest.raises(WeightsError, match="cannot read"):  # weights_only refuses arbitrary objects
        build_model(cfg, checkpoint=evil)


def test_freeze_blocks():
    m = build_model(tiny())
    freeze_blocks(m, 2)
    assert not m.patch_embed.proj.weight.requires_grad and not m.cls_token.requires_grad
    assert not any(p.requires_grad for p in m.blocks[1].parameters())
    assert all(p.requires_grad for p in m.blocks[2].parameters())
    assert m.norm.weight.requires_grad and m.head.weight.requires_grad
    with pytest.raises(ConfigError):
        freeze_blocks(m, 4)


def test_extract_features_matches_cls_features_and_restores_mode():
    from atdnode.data import LabeledImages
    from atdnode.learning import extract_features

    torch.manual_seed(3)
    m = build_model(tiny())
    m.train()
    data = LabeledImages(images=torch.randn(10, 3, 16, 16), labels=torch.arange(10) % 5, classes=LABELS)
    feats, labels = extract_features(m, data, batch_size=4)
    assert m.training  # mode restored
    assert feats.dtype == np.float32 and feats.shape == (10, 32)
    assert labels.tolist() == (torch.arange(10) % 5).tolist()
    m.eval()
    with torch.no_grad():
        want = cls_features(m, data.images).numpy()
    assert np.allclose(feats, want, atol=1e-5)
