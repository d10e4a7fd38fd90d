"""One ViT configuration class: split-learning parts are shaped by `protocols.vit_config.ModelConfig`."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from atdnode.learning import ModelConfig, build_model, resolve_config
from atdnode.split import DEFAULT_BODY, SplitSettings
from protocols.split_parts import SPLIT_MODEL, SplitBody, build_head, split_config, split_dict
from protocols.vit_config import ModelConfigError


def test_split_body_is_the_blocks_of_the_timm_model_of_the_same_config():
    """A split body's state loads into `build_model(cfg).blocks` and computes the same thing,
    so a body trained by FESTA / MSD can be assembled into the node's timm ViT."""
    cfg = split_config(embed_dim=16, depth=1, num_heads=2, mlp_ratio=3.0)
    body = SplitBody(cfg, seed=1).eval()
    model = build_model(replace(cfg, num_classes=3)).eval()
    assert model.blocks[0].mlp.fc1.out_features == 48  # mlp_ratio reached timm
    model.blocks.load_state_dict(body.blocks.state_dict(), strict=True)
    x = torch.randn(2, cfg.num_patches + 1, cfg.embed_dim)
    assert torch.allclose(model.blocks(x), body(x))
    # and a different config does not fit
    other = build_model(replace(cfg, mlp_ratio=2.0, num_classes=3))
    with pytest.raises(RuntimeError):
        other.blocks.load_state_dict(body.blocks.state_dict(), strict=True)


def test_split_wire_form_round_trips_and_matches_the_settings_default():
    assert split_dict(SPLIT_MODEL) == DEFAULT_BODY
    assert SplitSettings().vit_config() == SPLIT_MODEL
    cfg = split_config(img_size=8, patch_size=4, embed_dim=8, depth=1, mlp_ratio=1)
    assert split_config(split_dict(cfg)) == cfg and isinstance(cfg.mlp_ratio, float)
    # a newer peer may add keys: ignored, as before
    assert split_config({**split_dict(cfg), "future_field": 1}) == cfg


@pytest.mark.parametrize("body, match", [({"img_size": 15}, "multiple of patch_size"),
                                         ({"embed_dim": 30, "num_heads": 4}, "divisible by num_heads"),
                                         ({"depth": 0}, "depth must be a positive"),
                                         ({"mlp_ratio": "2"}, "mlp_ratio must be a positive"),
                                         ({"patch_size": 2.5}, "patch_size must be a positive integer")])
def test_split_config_rejects_unusable_shapes(body, match):
    with pytest.raises(ValueError, match=match):
        split_config(body)


def test_model_config_dict_leaves_out_the_usual_mlp_ratio():
    """Entries written before mlp_ratio existed (no such key) read back; 4.0 is not written,
    so their run keys and bodies are unchanged; any other ratio is written and read back."""
    old = {"name": "vit_tiny_patch16_224", "img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 1,
           "num_heads": 2, "in_chans": 1, "num_classes": 3}
    cfg = ModelConfig.from_dict(old)
    assert cfg.mlp_ratio == 4.0 and cfg.to_dict() == old
    two = replace(cfg, mlp_ratio=2.0)
    assert two.to_dict()["mlp_ratio"] == 2.0 and ModelConfig.from_dict(two.to_dict()) == two
    assert two.diff(cfg) == ["mlp_ratio 2.0 != 4.0"]
    with pytest.raises(ModelConfigError, match="bad model config"):
        ModelConfig.from_dict({**old, "mlp_ratio": "wide"})
    assert resolve_config("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=1,
                           num_heads=2, mlp_ratio=2.0).mlp_ratio == 2.0


def test_model_config_dict_leaves_out_the_patch_stem():
    """Entries written before stem existed read back as "patch", and a patch config writes no
    stem key (its run key and bodies unchanged); a conv config writes it and reads it back."""
    old = {"name": "vit_tiny_patch16_224", "img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 1,
           "num_heads": 2, "in_chans": 1, "num_classes": 3}
    cfg = ModelConfig.from_dict(old)
    assert cfg.stem == "patch" and cfg.to_dict() == old
    conv = replace(cfg, stem="conv")
    assert conv.to_dict() == {**old, "stem": "conv"} and ModelConfig.from_dict(conv.to_dict()) == conv
    assert conv.diff(cfg) == ["stem conv != patch"]
    assert "conv stem" in conv.arch() and "stem" not in cfg.arch()
    with pytest.raises(ModelConfigError, match="stem must be one of patch, conv, got 'cnn'"):
        ModelConfig.from_dict({**old, "stem": "cnn"})


@pytest.mark.parametrize("kw, match, field", [
    ({"stem": "Conv"}, "stem must be one of patch, conv, got 'Conv'", "stem"),
    ({"stem": "conv", "img_size": 24, "patch_size": 6}, r"power of two \(2, 4, 8, 16, 32, \.\.\.\), got 6", "patch_size"),
    ({"stem": "conv", "img_size": 16, "patch_size": 1}, "power of two", "patch_size"),
    ({"stem": "conv", "img_size": 32, "patch_size": 16, "embed_dim": 8, "num_heads": 2}, "embed_dim >= patch_size",
     "embed_dim")])
def test_a_bad_stem_is_one_line_naming_its_field(kw, match, field):
    with pytest.raises(ModelConfigError, match=match) as err:
        ModelConfig(**kw)
    assert err.value.field == field and "\n" not in str(err.value)


def test_split_parts_refuse_a_conv_stem():
    """The split parts build timm's patch embedding only (protocols.split_parts): a conv-stem
    config is refused by name, not built as a patch model."""
    conv = replace(split_config(), stem="conv")
    for make in (split_dict, lambda c: SplitBody(c, seed=0), build_head):
        with pytest.raises(ModelConfigError, match="stem 'conv' is not supported") as err:
            make(conv)
        assert err.value.field == "stem"
    with pytest.raises(ModelConfigError, match="stem 'conv'"):
        split_config({"stem": "conv"})
    assert split_config({"stem": "patch"}) == split_config()
