"""The weights a training run starts from, and the shared start it descends from.

`--init-from` names a blob of the node's store (or a unique prefix), an atd weight-set file
(imported into the store first, so provenance names it by hash), another checkpoint file,
or a registered model (its extractor, e.g. an MSD base): `resolve_init`. `build_start`
builds the model from it and records the provenance; `base_fingerprint` names the shared
start, which `atd aggregate` compares before averaging.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from atdnode.data import LabeledImages
from atdnode.errors import ConfigError
from atdnode.node import NodeHome
from atdnode.learning.model import ModelConfig, build_model, extractor_state, freeze_blocks
from atdnode.learning.train_options import TrainOptions


def resolve_init(home: NodeHome, store, init_from: str | None) -> tuple[str | None, Path | None]:
    """`--init-from` -> (blob hash, None) or (None, checkpoint file). An atd weight-set file
    is imported into the store first, so provenance can name it by hash; a model id (or
    unique prefix) of the registry gives that model's extractor blob (`atd base build`)."""
    from atdnode.models import read_meta

    if init_from is None:
        return None, None
    p = Path(init_from).expanduser()
    if p.is_file():
        if p.suffix == ".safetensors":
            try:
                from safetensors import safe_open

                with safe_open(str(p), framework="pt") as f:
                    is_atd = "atd" in (f.metadata() or {})
            except Exception:
                is_atd = False
            if is_atd:
                h = store.put_file(p)
                read_meta(store, h)
                return h, None
        return None, p
    h = init_from.lower()
    if len(h) >= 8 and all(c in "0123456789abcdef" for c in h):
        if len(h) < 64:  # unique prefix of a held blob
            hits = [b for b in store.list() if b.startswith(h)]
            if len(hits) > 1:
                from atdnode.ids import unique

                unique(h, hits, what="--init-from blob")  # raises, naming the matching blobs
            if len(hits) == 1:
                h = hits[0]
        if len(h) == 64 and store.has(h):
            return h, None
    from atdnode.models import extractor_blob_of  # a registered model, e.g. an MSD base

    h = extractor_blob_of(home, init_from)
    if h is not None and store.has(h):
        return h, None
    raise ConfigError(f"--init-from {init_from}: neither a file, a blob in {home.blobs_dir} nor a model id")


def build_start(home: NodeHome, store, cfg: ModelConfig, data: LabeledImages, opts: TrainOptions) -> tuple[nn.Module, dict]:
    """The model a run starts from, and its provenance.

    Deviation from VGS-ATD §3.1 (which attaches a new, randomly initialised head to the
    shared extractor at each node): when `--init-from` names a full weight set whose label
    space equals this node's, the follower starts from that set's head too (a warm start
    for the same task); a different label space, or an extractor set, gets timm's fresh
    head as in the paper. Give the extractor part to get the paper's behaviour always.
    """
    from atdnode.learning.model import import_part
    from atdnode.models import read_meta

    blob, ckpt = resolve_init(home, store, opts.init_from)
    torch.manual_seed(opts.seed)
    model = build_model(cfg, checkpoint=ckpt, pretrained=opts.pretrained)
    prov: dict = {"init_from": blob or (str(ckpt) if ckpt else None), "init_part": None}
    if blob is not None:
        meta = read_meta(store, blob)
        same_labels = meta.get("label_fp") == data.label_fp
        part = meta.get("part") if (meta.get("part") == "extractor" or same_labels) else "extractor"
        if part == "head":
            raise ConfigError(f"--init-from {blob[:12]} is a head-only weight set; give an extractor or full set")
        import_part(store, blob, model, cfg, label_fp=data.label_fp, labels=data.classes, part=part)
        prov["init_part"] = part
    elif ckpt is not None:
        prov["init_part"] = "checkpoint"
    prov["base"] = base_fingerprint(store, blob, model)
    freeze_blocks(model, opts.freeze_blocks)
    return model, prov


def base_fingerprint(store, init_blob: str | None, model: nn.Module) -> str:
    """Which shared start a model descends from: the base its init weight set records (so
    every follower of one base gets the same fingerprint), else a hash of the initial
    extractor weights (same seed + config, or the same checkpoint file, give the same one).
    Averaging models with different bases is meaningless (see README); `atd aggregate` warns."""
    from atdnode.models import read_meta

    if init_blob is not None:
        base = read_meta(store, init_blob).get("base")
        return str(base) if isinstance(base, str) and base else f"blob:{init_blob[:32]}"
    h = hashlib.sha256()
    for k, v in sorted(extractor_state(model).items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().float().numpy().tobytes())
    return f"init:{h.hexdigest()[:32]}"

