"""The ViT configuration: a timm ViT by name plus the architecture fields atd exposes.

The one ViT configuration class of the project: nodes' models (`atdnode.learning.model`), netsim's
``[model]`` and the split-learning parts (`protocols.split_parts`, which build the same timm
blocks) all use it. It is pure data and lives at the ground floor so that `protocols`
imports nothing above it; asking timm what a named model's fields are
(`atdnode.learning.model.resolve_config`) and building the model stay in `atdnode.learning.model`.

Invariants, checked when a config is constructed (`ModelConfigError` otherwise): the name
is a non-empty string; every size is a positive integer (``num_classes`` may be 0, a
classifier-less extractor, as timm's ``reset_classifier(0)``); ``mlp_ratio`` is a positive
finite number; ``num_heads`` divides ``embed_dim`` (timm's attention needs it); ``patch_size``
divides ``img_size`` (otherwise timm's patch embedding silently crops the border).

``stem`` is how images become tokens: ``"patch"``, timm's patch embedding (one patch-size
convolution), or ``"conv"``, a small convolutional stem in its place (`protocols.vit_stem.ConvStem`:
Xiao et al., *Early Convolutions Help Transformers See Better*, NeurIPS 2021). A conv stem
halves the image log2(patch_size) times, so its ``patch_size`` is a power of two >= 2 and
``embed_dim`` at least ``patch_size`` (its first convolution has embed_dim / patch_size channels).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

# mlp_ratio of the ViT paper and of every timm ViT atd used before the field existed. A
# config's dict leaves mlp_ratio out when it has this value, so `weights` entries, registry
# records and training run keys written before the field existed read back unchanged.
DEFAULT_MLP_RATIO = 4.0

# the token embeddings (see the module doc). "patch" is every ViT atd built before the field
# existed; a config's dict leaves stem out when it is "patch" (as mlp_ratio at 4.0).
STEMS = ("patch", "conv")
DEFAULT_STEM = "patch"
# the fields a config's dict leaves out at these values (entries written before each field
# existed have none, and read back unchanged)
OPTIONAL = {"mlp_ratio": DEFAULT_MLP_RATIO, "stem": DEFAULT_STEM}

# timm's ViT classifier module ("head": pretrained_cfg["classifier"]); its tensors are
# `head.weight` / `head.bias`, everything else is the extractor. The one spelling of it:
# `protocols.aggregation.HEAD_PREFIXES`, `protocols.fedwavg`, `atdnode.learning.model.head_prefix`.
CLASSIFIER = "head"

# the integer fields and their least allowed value
INT_FIELDS = {"img_size": 1, "patch_size": 1, "embed_dim": 1, "depth": 1, "num_heads": 1, "in_chans": 1,
              "num_classes": 0}


class ModelConfigError(ValueError):
    """A model configuration has a bad value, or its dict form unknown or missing fields.

    ``field`` names the offending field when there is one (e.g. for a message keyed by the
    path of a scenario file); the message is one line meant for a human."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def check_field(name: str, value: Any) -> None:
    """ModelConfigError unless `value` is allowed for field `name` on its own (the per-field
    rules of the module doc; the divisibility rule needs both fields, see `ModelConfig`)."""
    if name == "name":
        if not isinstance(value, str) or not value:
            raise ModelConfigError(f"model name must be a non-empty string, got {value!r}", field=name)
    elif name in INT_FIELDS:
        least = INT_FIELDS[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            kind = "a positive integer" if least else "an integer >= 0"
            raise ModelConfigError(f"{name} must be {kind}, got {value!r}", field=name)
    elif name == "mlp_ratio":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ModelConfigError(f"mlp_ratio must be a positive number, got {value!r}", field=name)
    elif name == "stem":
        if value not in STEMS:
            raise ModelConfigError(f"stem must be one of {', '.join(STEMS)}, got {value!r}", field=name)
    else:
        raise ModelConfigError(f"unknown model config field {name!r}", field=name)


def conv_stem_depth(patch_size: int, embed_dim: int) -> int:
    """The stride-2 convolutions of a conv stem for `patch_size` (log2 of it); ModelConfigError
    (field "patch_size" or "embed_dim") unless patch_size is a power of two >= 2 and
    embed_dim >= patch_size."""
    k = patch_size.bit_length() - 1
    if patch_size < 2 or patch_size != 1 << k:
        allowed = ", ".join(str(1 << i) for i in range(1, 6))
        raise ModelConfigError(f"stem conv needs a patch_size that is a power of two ({allowed}, ...), "
                               f"got {patch_size}", field="patch_size")
    if embed_dim < patch_size:
        raise ModelConfigError(f"stem conv needs embed_dim >= patch_size (its first convolution has "
                               f"embed_dim / patch_size channels), got embed_dim {embed_dim}, patch_size {patch_size}",
                               field="embed_dim")
    return k


@dataclass(frozen=True)
class ModelConfig:
    """A timm ViT by name plus the architecture overrides atd exposes (all resolved: fields
    the user did not set are read back from the model timm builds, so two nodes compare
    configs field by field)."""

    name: str = "vit_tiny_patch16_224"
    img_size: int = 224
    patch_size: int = 16
    embed_dim: int = 192
    depth: int = 12
    num_heads: int = 3
    in_chans: int = 3
    num_classes: int = 10
    mlp_ratio: float = DEFAULT_MLP_RATIO
    stem: str = DEFAULT_STEM

    def __post_init__(self) -> None:
        for f in fields(self):
            check_field(f.name, getattr(self, f.name))
        if self.embed_dim % self.num_heads:
            raise ModelConfigError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}",
                                   field="num_heads")
        if self.img_size % self.patch_size:
            lo = max(self.patch_size, self.img_size - self.img_size % self.patch_size)
            raise ModelConfigError(f"img_size {self.img_size} is not a multiple of patch_size {self.patch_size} "
                                   f"(the border would be cropped): use img_size {lo} or "
                                   f"{lo + self.patch_size}, or another patch size", field="patch_size")
        if self.stem == "conv":
            conv_stem_depth(self.patch_size, self.embed_dim)
        object.__setattr__(self, "mlp_ratio", float(self.mlp_ratio))

    def arch(self) -> str:
        """The architecture as built, e.g. "ViT 28px/patch 4, embed 64, depth 4, 4 heads
        (timm vit_tiny_patch16_224 family)": a timm name alone says the sizes it was
        registered with, not the ones overridden here."""
        stem = ", conv stem" if self.stem == "conv" else ""
        return (f"ViT {self.img_size}px/patch {self.patch_size}{stem}, embed {self.embed_dim}, depth {self.depth}, "
                f"{self.num_heads} heads (timm {self.name} family)")

    @property
    def num_patches(self) -> int:
        return (self.img_size // self.patch_size) ** 2

    def to_dict(self) -> dict:
        """The wire form (entries, registry, run keys); mlp_ratio only when it is not 4.0, stem
        only when it is not "patch" (:data:`OPTIONAL`)."""
        d = asdict(self)
        for k, default in OPTIONAL.items():
            if d[k] == default:
                del d[k]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Parse :meth:`to_dict`'s form strictly (ModelConfigError on unknown or missing
        fields or a bad value)."""
        if not isinstance(d, dict):
            raise ModelConfigError(f"bad model config: not a table ({type(d).__name__})")
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        missing = names - set(d) - set(OPTIONAL)
        if unknown or missing:
            raise ModelConfigError(f"bad model config: unknown {sorted(unknown)}, missing {sorted(missing)}")
        try:
            return cls(name=str(d["name"]), mlp_ratio=float(d.get("mlp_ratio", DEFAULT_MLP_RATIO)),
                       stem=d.get("stem", DEFAULT_STEM), **{k: int(d[k]) for k in names - {"name", *OPTIONAL}})
        except (TypeError, ValueError) as exc:  # ModelConfigError included: name the dict
            raise ModelConfigError(f"bad model config {d!r}: {exc}", field=getattr(exc, "field", None)) from None

    def diff(self, other: "ModelConfig", *, ignore: tuple[str, ...] = ()) -> list[str]:
        """Human-readable field differences, e.g. ["depth 2 != 4"]."""
        out = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name not in ignore and a != b:
                out.append(f"{f.name} {a} != {b}")
        return out

    def with_classes(self, num_classes: int) -> "ModelConfig":
        return replace(self, num_classes=num_classes)
