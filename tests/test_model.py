"""The timm ViT split: extractor + head reproduce the model, weight-set export/import, checkpoints."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from atdnode.blobs import BlobStore
from atdnode.data import label_fingerprint
from atdnode.errors import ConfigError, WeightsError
from atdnode.learning import (ModelConfig, build_model, export_part, extractor_state, freeze_blocks, load_part,
                              resolve_config)
from atdnode.learning.model import cls_features, head_state, hold_frozen_norms, import_part, part_state, split_at
from protocols.vit_config import ModelConfigError
from protocols.vit_stem import ConvStem

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


# --- a conv stem (stem = "conv", protocols.vit_stem) -------------------------------------

def test_conv_stem_is_built_read_back_and_part_of_the_extractor(store):
    cfg = tiny(stem="conv", in_chans=1)
    assert cfg.stem == "conv" and cfg.in_chans == 1  # read back (proj sees the stem's 16 channels)
    assert tiny().stem == "patch" and "stem" not in tiny().to_dict()
    m = build_model(cfg)  # its "timm built a different model" check reads the stem back too
    assert isinstance(m.patch_embed, ConvStem) and m.patch_embed.num_patches == 16
    assert [c.out_channels for c in m.patch_embed.stem if isinstance(c, nn.Conv2d)] == [8, 16]
    assert m.patch_embed.proj.kernel_size == (1, 1) and m.patch_embed.proj.out_channels == 32
    assert m(torch.randn(2, 1, 16, 16)).shape == (2, 5)
    stem = {k for k in m.state_dict() if k.startswith("patch_embed.")}
    assert {"patch_embed.stem.0.weight", "patch_embed.stem.1.running_var", "patch_embed.proj.weight"} <= stem
    assert stem <= set(extractor_state(m)) and not stem & set(head_state(m))
    with torch.no_grad():
        m.patch_embed.stem[1].running_mean.add_(0.5)  # a trained stem's statistics travel with it
    h = export_part(store, m, cfg, "extractor", labels=LABELS, label_fp=FP)
    dst = build_model(cfg)
    import_part(store, h, dst, cfg, label_fp=None)
    assert torch.equal(dst.patch_embed.stem[1].running_mean, m.patch_embed.stem[1].running_mean)
    bad = extractor_state(m)
    bad["patch_embed.stem.1.running_var"][0] = float("nan")
    with pytest.raises(WeightsError, match="patch_embed.stem.1.running_var has NaN"):
        load_part(dst, bad, "extractor")


@pytest.mark.parametrize("kw, match", [({"stem": "cnn"}, "stem must be one of patch, conv, got 'cnn'"),
                                       ({"stem": "conv", "img_size": 24, "patch_size": 6}, "power of two"),
                                       ({"stem": "conv", "patch_size": 6}, "power of two")])  # timm's 224 px
def test_a_bad_stem_is_a_model_config_error(kw, match):
    with pytest.raises(ModelConfigError, match=match):
        resolve_config(NAME, **kw)


def test_conv_stem_has_no_pretrained_weights():
    with pytest.raises(ConfigError, match="stem conv starts from random init"):
        build_model(tiny(stem="conv"), pretrained=True)  # refused before any hub is asked


def test_conv_stem_weights_do_not_enter_a_patch_model(store, tmp_path):
    conv, patch = tiny(stem="conv"), tiny()
    src = build_model(conv)
    h = export_part(store, src, conv, "extractor", labels=LABELS, label_fp=FP)
    with pytest.raises(WeightsError, match=r"stem conv \(weights\) vs patch \(model\)"):
        import_part(store, h, build_model(patch), patch, label_fp=FP)
    h = export_part(store, build_model(patch), patch, "full", labels=LABELS, label_fp=FP)
    with pytest.raises(WeightsError, match=r"stem patch \(weights\) vs conv \(model\)"):
        import_part(store, h, build_model(conv), conv, label_fp=FP, labels=LABELS)
    with pytest.raises(WeightsError, match="unexpected.*patch_embed.stem"):
        load_part(build_model(patch), extractor_state(src), "extractor")
    path = tmp_path / "conv.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    with pytest.raises(WeightsError, match="does not fit"):
        build_model(patch, checkpoint=path)
    assert build_model(conv, checkpoint=path) is not None  # its own model takes it


def test_freezing_holds_a_conv_stem_batch_norm():
    """A frozen stem stays as it was while the model trains: its BatchNorm layers go to eval
    mode (`hold_frozen_norms`, after each `model.train()` of the trainer)."""
    m = build_model(tiny(stem="conv"))
    norms = [x for x in m.patch_embed.stem if isinstance(x, nn.BatchNorm2d)]
    m.train()
    hold_frozen_norms(m)
    assert len(norms) == 2 and all(b.training for b in norms)  # trainable: batch statistics, as usual
    freeze_blocks(m, 1)
    assert not any(p.requires_grad for p in m.patch_embed.parameters())
    m.train()
    hold_frozen_norms(m)
    assert not any(b.training for b in norms) and m.blocks[0].training
    before = {k: v.clone() for k, v in m.patch_embed.state_dict().items()}
    m(torch.randn(4, 3, 16, 16))
    assert all(torch.equal(before[k], v) for k, v in m.patch_embed.state_dict().items())
