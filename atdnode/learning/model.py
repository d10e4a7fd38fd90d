"""timm ViTs for a node: config, construction, and the extractor / head split.

Everything goes through timm's own seams — `timm.create_model`, `forward_features`,
`forward_head(pre_logits=True)`, `pretrained_cfg["classifier"]` — never a
re-implemented ViT. The *extractor* is every parameter/buffer outside the classifier
(patch embedding, cls/reg tokens, position embedding, blocks, final norm, and fc_norm /
attention pooling where the model has them); the *head* is the classifier (`head.*`).

A `ModelConfig` (`protocols.vit_config`, pure data) is fully resolved by `resolve_config`:
fields the user did not override are read back from the model timm builds, so two nodes
compare configs field by field. ``stem = "conv"`` builds the same timm ViT with
`protocols.vit_stem.ConvStem` as its ``embed_layer``; the stem is part of the extractor.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from torch import nn

from atdnode.errors import ConfigError, WeightsError
from atdnode.models import PARTS
# the configuration dataclass lives at the ground floor (protocols import it too); it is
# re-exported here for the node's callers
from protocols.vit_config import CLASSIFIER, DEFAULT_MLP_RATIO, ModelConfig, ModelConfigError, check_field  # noqa: F401
from protocols.vit_stem import ConvStem


def resolve_config(name: str, **overrides: float | str | None) -> ModelConfig:
    """Config of `timm.create_model(name, **overrides)`; `None` overrides take timm's default.

    Each override is checked first (`protocols.vit_config.check_field`: ModelConfigError for
    a bad value, before timm sees it). The model is built on the meta device, so resolving
    even a ViT-Base allocates nothing; the answer depends only on the arguments (and the
    installed timm), so each is built once per process.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    for k, v in given.items():
        check_field(k, v)
    return _resolved(name, tuple(sorted(given.items())))


@functools.lru_cache(maxsize=64)
def _resolved(name: str, given: tuple[tuple[str, float | str], ...]) -> ModelConfig:
    """`resolve_config`'s checked arguments resolved (ModelConfig is frozen: one shared value;
    an argument timm refuses raises each time, nothing is kept)."""
    with torch.device("meta"):
        model = _create(name, dict(given))
    return ModelConfig(name=name, **_read_arch(model))


def _create(name: str, kwargs: dict, *, pretrained: bool = False) -> nn.Module:
    """timm's `name` with `kwargs` (ModelConfig fields; ``stem`` becomes timm's ``embed_layer``)."""
    import timm

    if not is_vit_name(name):
        from atdnode.data import did_you_mean

        what = f"model {name!r} is not a ViT" if name in timm.list_models() else f"unknown timm model {name!r}"
        hint = did_you_mean(name.replace("-", "_").lower(), timm.list_models("vit_*"))
        raise ConfigError(f"{what}{hint}: atd trains timm ViTs (vit_*, e.g. vit_tiny_patch16_224; "
                          f"timm.list_models('vit_*') lists them)")
    kwargs = dict(kwargs)
    if kwargs.pop("stem", "patch") == "conv":
        if pretrained:
            raise ConfigError(f"timm's pretrained {name!r} has a patch embedding: stem conv starts from random init "
                              f"or an atd weight set")
        kwargs["embed_layer"] = ConvStem
    try:
        model = timm.create_model(name, pretrained=pretrained, **kwargs)
    except ModelConfigError:  # the conv stem's own rule (patch size), one line as it stands
        raise
    except (TypeError, ValueError, AssertionError, RuntimeError) as exc:
        raise ConfigError(f"timm cannot build {name!r} with {kwargs}: {exc}") from None
    for attr in ("patch_embed", "blocks", "forward_features", "forward_head", "reset_classifier"):
        if not hasattr(model, attr):
            raise ConfigError(f"{name!r} is not a ViT with timm's split seams (no {attr})")
    return model


def is_vit_name(name: str) -> bool:
    """True for timm's ViTs: the `vit_*` models and the other models of its VisionTransformer
    module family (e.g. `deit_*`), whose split seams atd uses."""
    from timm.models import model_entrypoint

    if name not in _timm_names():
        return False
    return name.startswith("vit_") or model_entrypoint(name).__module__ in ("timm.models.vision_transformer",
                                                                             "timm.models.deit")


@functools.cache
def _timm_names() -> frozenset[str]:
    """`timm.list_models()` once per process (each call sorts ~1,300 names: 14 ms, paid by every
    model built before)."""
    import timm

    return frozenset(timm.list_models())


def _read_arch(model: nn.Module) -> dict:
    pe = model.patch_embed
    img = pe.img_size
    patch = pe.patch_size
    if img is None:  # dynamic-size models keep no fixed image size
        raise ConfigError("model has no fixed img_size")
    if img[0] != img[1] or patch[0] != patch[1]:
        raise ConfigError(f"only square images/patches are supported (got {img}, {patch})")
    return dict(
        img_size=int(img[0]),
        patch_size=int(patch[0]),
        embed_dim=int(model.embed_dim),
        depth=len(model.blocks),
        num_heads=int(model.blocks[0].attn.num_heads),
        in_chans=int(pe.in_chans if isinstance(pe, ConvStem) else pe.proj.in_channels),
        num_classes=int(model.num_classes),
        mlp_ratio=_mlp_ratio(model),
        stem="conv" if isinstance(pe, ConvStem) else "patch",
    )


def _mlp_ratio(model: nn.Module) -> float:
    """Hidden width of the first block's MLP over embed_dim (timm's `mlp_ratio`)."""
    fc1 = getattr(getattr(model.blocks[0], "mlp", None), "fc1", None)
    if not isinstance(fc1, nn.Linear):  # e.g. SwiGLU blocks: keep the usual value
        return DEFAULT_MLP_RATIO
    return fc1.out_features / int(model.embed_dim)


def build_model(cfg: ModelConfig, checkpoint: str | Path | None = None, *, pretrained: bool = False) -> nn.Module:
    """Build `cfg` with timm from random init, a local checkpoint, or (hub needed) pretrained.

    `checkpoint` may be a `.safetensors` file or a torch checkpoint; either is read through
    timm's `load_state_dict(weights_only=True)` (no unpickling of arbitrary objects) and
    adapted by the model family's own `checkpoint_filter_fn` (position-embedding resampling,
    patch-embedding conversion). A classifier whose shape differs (other class count) is
    dropped and left at random init; every other mismatch is a WeightsError.
    """
    # an mlp_ratio of 4.0 is not passed: a config read from an entry written before the
    # field existed means "the named model's own", which timm builds (as it always did)
    kwargs = {k: v for k, v in cfg.to_dict().items() if k != "name"}
    model = _create(cfg.name, kwargs, pretrained=pretrained)
    got = ModelConfig(name=cfg.name, **_read_arch(model))
    diff = cfg.diff(got, ignore=() if "mlp_ratio" in kwargs else ("mlp_ratio",))
    if diff:
        raise ConfigError(f"timm built a different model than asked: {', '.join(diff)}")
    if checkpoint is not None:
        _load_checkpoint(model, Path(checkpoint))
    return model


def _load_checkpoint(model: nn.Module, path: Path) -> None:
    from timm.models import load_state_dict

    if not path.is_file():
        raise WeightsError(f"checkpoint {path} does not exist")
    if path.suffix.lower() in (".npz", ".npy"):
        raise WeightsError(f"{path}: numpy checkpoints are not supported (convert to safetensors)")
    try:
        sd = load_state_dict(str(path), use_ema=True, device="cpu", weights_only=True)
    except Exception as exc:  # safetensors / torch.load(weights_only) raise many types
        raise WeightsError(f"cannot read checkpoint {path}: {exc}") from None
    filter_fn = getattr(sys.modules[type(model).__module__], "checkpoint_filter_fn", None)
    if filter_fn is not None:
        try:
            sd = filter_fn(sd, model)
        except Exception as exc:
            raise WeightsError(f"{path}: timm's checkpoint filter failed: {exc}") from None
    own = model.state_dict()
    head = head_keys(model)
    for k in list(sd):  # a checkpoint for another class count: keep its extractor only
        if k in head and (k not in own or sd[k].shape != own[k].shape):
            del sd[k]
    missing = [k for k in own if k not in sd and k not in head]
    extra = [k for k in sd if k not in own]
    bad = [f"{k} {tuple(sd[k].shape)} != {tuple(own[k].shape)}" for k in sd if k in own and sd[k].shape != own[k].shape]
    if missing or extra or bad:
        raise WeightsError(f"{path} does not fit {type(model).__name__}: missing {missing[:5]}, "
                           f"unexpected {extra[:5]}, shape {bad[:5]}")
    _check_finite(sd, str(path))
    model.load_state_dict(sd, strict=False)


# --- the split --------------------------------------------------------------------------

def head_prefix(model: nn.Module) -> str:
    """The classifier's module name according to timm (`protocols.vit_config.CLASSIFIER`,
    "head", for ViTs)."""
    cls = getattr(model, "pretrained_cfg", {}).get("classifier", CLASSIFIER)
    return cls if isinstance(cls, str) else cls[0]


def head_keys(model: nn.Module) -> set[str]:
    p = head_prefix(model) + "."
    return {k for k in model.state_dict() if k.startswith(p)}


def extractor_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of every tensor outside the classifier."""
    hk = head_keys(model)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k not in hk}


def head_state(model: nn.Module) -> dict[str, torch.Tensor]:
    hk = head_keys(model)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k in hk}


def part_state(model: nn.Module, part: str) -> dict[str, torch.Tensor]:
    if part == "extractor":
        return extractor_state(model)
    if part == "head":
        return head_state(model)
    if part == "full":
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    raise WeightsError(f"unknown weight part {part!r} (one of {', '.join(PARTS)})")


def part_spec(model: nn.Module, part: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected key -> (shape, dtype) of a part, for `weights.load_weights(expect=...)`."""
    return {k: (tuple(v.shape), v.dtype) for k, v in part_state(model, part).items()}


def load_part(model: nn.Module, tensors: dict[str, torch.Tensor], part: str) -> None:
    """Copy `tensors` (exactly the keys of `part`) into `model`; WeightsError names any misfit."""
    want = part_spec(model, part)
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    bad = [f"{k} {tuple(tensors[k].shape)} != {want[k][0]}" for k in sorted(set(want) & set(tensors))
           if tuple(tensors[k].shape) != want[k][0]]
    if missing or extra or bad:
        raise WeightsError(f"{part} weights do not fit the model: missing {missing[:5]}, "
                           f"unexpected {extra[:5]}, shape {bad[:5]}")
    _check_finite(tensors, f"{part} weights")
    model.load_state_dict(tensors, strict=False)


def _check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    for k, v in tensors.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise WeightsError(f"{what}: tensor {k} has NaN/inf")


def cls_features(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """CLS (pre-logits) representation: (B, C, H, W) -> (B, D)."""
    return model.forward_head(model.forward_features(x), pre_logits=True)


def freeze_blocks(model: nn.Module, k: int) -> None:
    """Freeze the embeddings (a conv stem's too) and the first `k` blocks (VGS-ATD node-to-node
    transfer). A frozen stem's BatchNorm statistics are held as well while training
    (`hold_frozen_norms`, which the trainer applies after each ``model.train()``)."""
    if not 0 <= k <= len(model.blocks):
        raise ConfigError(f"--freeze-blocks {k} out of range 0..{len(model.blocks)}")
    if k == 0:
        return
    front, _ = split_at(model, k)
    for p in front.parameters():
        p.requires_grad_(False)


def hold_frozen_norms(model: nn.Module) -> None:
    """Put every BatchNorm whose parameters are all frozen (`freeze_blocks`) in eval mode, so
    that training leaves it unchanged: in training mode it would normalise by batch statistics
    and move its running statistics, though its weights stay put. Call after ``model.train()``."""
    for m in model.modules():
        params = list(m.parameters(recurse=False))
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and params and not any(p.requires_grad for p in params):
            m.eval()


# --- the cut for split learning ---------------------------------------------------------

class _Front(nn.Module):
    """Embedding + the first k blocks of a timm ViT (shares the model's parameters)."""

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        self.vit = [model]  # a list: keep the parent out of this module's parameters
        self.patch_embed = model.patch_embed
        self.patch_drop = model.patch_drop
        self.norm_pre = model.norm_pre
        self.blocks = model.blocks[:k]
        # the tokens are direct nn.Parameters of the ViT; register them here too
        for name in ("cls_token", "reg_token", "pos_embed"):
            t = getattr(model, name, None)
            if t is not None:
                self.register_parameter(name, t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, T, D)
        vit = self.vit[0]
        x = self.patch_embed(x)
        x = vit._pos_embed(x)  # timm has no public name for this step of forward_features
        x = self.patch_drop(x)
        x = self.norm_pre(x)
        return self.blocks(x)


class _Back(nn.Module):
    """Blocks k.. plus the final norm: (B, T, D) -> (B, T, D)."""

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        self.blocks = model.blocks[k:]
        self.norm = model.norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x))


def split_at(model: nn.Module, k: int) -> tuple[nn.Module, nn.Module]:
    """Cut a ViT after block `k`: `back(front(x))` equals `model.forward_features(x)` exactly.

    Both halves share the model's parameters (training them trains the model).
    """
    if not 0 <= k <= len(model.blocks):
        raise ConfigError(f"cut point {k} out of range 0..{len(model.blocks)}")
    return _Front(model, k), _Back(model, k)


# --- weight sets in the blob store ------------------------------------------------------

WEIGHTS_FORMAT = "atd-weights-v1"


def export_part(store, model: nn.Module, cfg: ModelConfig, part: str, *, labels: list[str],
                label_fp: str, samples: int = 0, extra: dict | None = None) -> str:
    """Store one part of `model` as a safetensors blob whose meta carries the model config,
    label space and fingerprint; returns the blob hash."""
    from atdnode.models import save_weights

    meta = {"format": WEIGHTS_FORMAT, "part": part, "model": cfg.to_dict(), "labels": list(labels),
            "label_fp": label_fp, "samples": int(samples)}
    meta.update(extra or {})
    return save_weights(store, part_state(model, part), meta)


def check_meta(meta: dict, cfg: ModelConfig, *, label_fp: str | None, labels: list[str] | None = None,
               what: str = "weights") -> str:
    """Check a weight set's meta against the model it is about to enter; return its part.

    Extractors fit any model of the same architecture (class count and label space are
    irrelevant to them); heads and full sets also need the same label space.
    """
    part = meta.get("part")
    if part not in PARTS:
        raise WeightsError(f"{what}: not an atd weight set (part {part!r})")
    try:
        theirs = ModelConfig.from_dict(meta.get("model") or {})
    except ModelConfigError as exc:
        raise WeightsError(f"{what}: {exc}") from None
    ignore = ("num_classes",) if part == "extractor" else ()
    # the model's dict fields, and stem always (a patch model's dict leaves it out)
    d = [f"{f} {getattr(theirs, f)} (weights) vs {getattr(cfg, f)} (model)"
         for f in dict.fromkeys([*cfg.to_dict(), "stem"]) if f not in ignore and getattr(theirs, f) != getattr(cfg, f)]
    if d:
        raise WeightsError(f"{what} ({part}) were made for another model: {', '.join(d)}")
    if part != "extractor" and label_fp is not None and meta.get("label_fp") != label_fp:
        raise WeightsError(f"{what} ({part}) have another label space: "
                           f"{meta.get('labels')} != {labels if labels is not None else label_fp}")
    return part


def import_part(store, h: str, model: nn.Module, cfg: ModelConfig, *, label_fp: str | None,
                labels: list[str] | None = None, part: str | None = None) -> dict:
    """Load blob `h` into `model` after checking config, label space, keys, shapes, dtypes
    and finiteness; returns the blob's meta. `part="extractor"` takes only the extractor
    tensors out of a full set (e.g. a peer's model over another label space)."""
    from atdnode.models import load_weights, read_meta

    meta = read_meta(store, h)
    stored = meta.get("part")
    want = part or stored
    if want == "extractor" and stored == "full":
        check_meta({**meta, "part": "extractor"}, cfg, label_fp=None, what=f"blob {h[:12]}")
        tensors, _ = load_weights(store, h, expect=None)
        hk = head_keys(model)
        tensors = {k: v for k, v in tensors.items() if k not in hk}
    else:
        if want != stored:
            raise WeightsError(f"blob {h[:12]} holds {stored} weights, not {want}")
        check_meta(meta, cfg, label_fp=label_fp, labels=labels, what=f"blob {h[:12]}")
        tensors, _ = load_weights(store, h, expect=part_spec(model, want))
    load_part(model, tensors, want)
    return meta
