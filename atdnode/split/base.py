"""`atd base build` / `atd base publish`: a base ViT built inside the consortium by masked
sampling distillation, the start VGS-ATD and `atd train --init-from` use when no
hub weights may be downloaded.

An MSD campaign (`msd_campaign.py`) leaves two things on the ledger: the clients' secret
embedder (patch projection + position table, one ``split_secret`` entry sealed to the client
members, `secret.py`) and the distilled transformer body (a ``weights`` entry, part "body",
blob readers = the contributors). Neither is a model alone. `build_base` runs on a client
member: it opens the secret with this node's key, loads the body blob through the checked
loader, and puts both into a timm ViT built by name (:data:`BASE_MODEL`: no class token,
average pooling, no fc_norm — the shape the MSD body was trained in: permuted patch tokens,
mean-pooled; MSD §III), so that::

    model.blocks(model._pos_embed(model.patch_embed(x))) == body(embedder(x))

exactly (up to float rounding); the final LayerNorm is fresh (MSD's own norm belongs to its projection head and is
not published). The extractor is stored as an atd weight set (meta ``base`` =
``msd:<body entry id>``, so every model trained from it shares one base fingerprint) and
registered as a model (``provenance.kind`` "msd-base", naming the campaign's service entry,
body entry and secret entry). Assembling is deterministic: every client gets the same blob.

`publish_base` shares it as a signed ``weights`` entry (part "extractor", provenance the
campaign's entries) whose blob readers are the campaign's secret recipients — the clients,
never the server: with embedder + body it could invert the features it was sent (MSD §III's
attacker), so the server never holds the assembled extractor.

Deviation: the papers fine-tune the body inside the split model (embedder -> body -> tail);
atd turns it into a whole timm ViT so that every VGS-ATD step (`atd train`, aggregation,
features) can start from it. timm builds :data:`BASE_MODEL` at the campaign's sizes,
``mlp_ratio`` included (`atdnode.learning.model.ModelConfig`); tensors that do not fit are a typed
shape error.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import nn

from atdnode import bodies
from atdnode.blobs import BlobStore
from atdnode.errors import AtdError, ConfigError, WeightsError
from atdnode.node import NodeHandle, NodeHome, NodeIdentity
from atdnode.learning import ModelConfig, build_model, export_part, extractor_state, load_part, resolve_config
from atdnode.models import ModelRecord, ModelRegistry, load_weights, register_model
from atdnode.split.secret import SplitSecretError, open_secret
from protocols.seeding import seeded
from ledger import Entry, Ledger

# timm's ViT without class token, average-pooled, no fc_norm: the MSD body's shape. Its
# defaults (qkv bias, no layer scale, LayerNorm eps 1e-6, GELU) are those of
# `protocols.split_parts.SplitBody`; the sizes (mlp_ratio too) come from the campaign.
BASE_MODEL = "vit_base_patch16_gap_224"
BASE_KIND = "msd-base"


class BaseBuildError(AtdError):
    """The MSD base cannot be assembled, registered or published; the message says why."""


@dataclass
class Campaign:
    """A finished MSD campaign as this node's ledger knows it."""

    service: str  # the server's `service` entry id (names the campaign)
    body_entry: Entry  # the distilled body's `weights` entry
    secret: str  # the adopted `split_secret` entry id
    split: ModelConfig  # the campaign's split shape (`protocols.split_parts.split_config`)


def find_campaign(led: Ledger, ref: str = "latest") -> Campaign:
    """The finished MSD campaign ``ref``: its service entry id or body entry id (hex or a
    unique prefix), or "latest". BaseBuildError if none, ambiguous, or not finished."""
    from protocols.split_parts import split_config

    ref = ref.lower()
    found = [e for e in led.query(kind="weights") if e.body.get("part") == "body" and e.body.get("algorithm") == "msd"]
    if ref != "latest":
        found = [e for e in found if e.id.hex().startswith(ref)
                 or str((e.body.get("model") or {}).get("service", "")).startswith(ref)]
    if not found:
        services = [] if ref == "latest" else [e for e in led.query(kind="service") if e.id.hex().startswith(ref)]
        if services:
            raise BaseBuildError(f"MSD campaign {ref[:12]} has not finished: no distilled body entry in the local "
                                 "ledger yet (wait for the round, or sync with the server)")
        raise BaseBuildError(f"no finished MSD campaign {'' if ref == 'latest' else ref[:16] + ' '}in the local ledger")
    if ref != "latest" and len({e.id for e in found}) > 1:
        raise BaseBuildError(f"campaign reference {ref!r} is ambiguous ({len(found)} body entries)")
    entry = found[-1]
    try:
        model = entry.body["model"]
        return Campaign(service=str(model["service"]), body_entry=entry, secret=str(model["secret"]),
                        split=split_config(model["split"]))
    except (KeyError, TypeError, ValueError) as e:
        raise BaseBuildError(f"weights entry {entry.id.hex()[:12]} does not describe an MSD body: {e}") from None


def base_config(split: ModelConfig) -> ModelConfig:
    """The timm config of the assembled extractor for the campaign's split shape ``split``
    (no classifier). BaseBuildError if timm cannot build it."""
    try:
        return resolve_config(BASE_MODEL, img_size=split.img_size, patch_size=split.patch_size,
                               embed_dim=split.embed_dim, depth=split.depth, num_heads=split.num_heads,
                               in_chans=split.in_chans, mlp_ratio=split.mlp_ratio, num_classes=0)
    except ConfigError as e:
        raise BaseBuildError(f"shape mismatch: {e}") from None


def assemble(split: ModelConfig, embedder: dict[str, torch.Tensor],
             body: dict[str, torch.Tensor]) -> tuple[nn.Module, ModelConfig]:
    """A timm ViT (:data:`BASE_MODEL`, eval mode) whose patch embedding and position table are
    ``embedder`` (`protocols.split_parts.EMBEDDER_KEYS`) and whose blocks are ``body`` (a
    `SplitBody` state); final norm fresh. BaseBuildError on any key or shape mismatch."""
    cfg = base_config(split)
    with seeded(0):  # deterministic, and the caller's RNG untouched
        model = build_model(cfg)
    own = extractor_state(model)
    tensors = {k.removeprefix("vit."): v for k, v in embedder.items()}
    tensors.update(body)
    tensors.update({k: own[k] for k in ("norm.weight", "norm.bias")})  # fresh LayerNorm: ones / zeros
    try:
        load_part(model, tensors, "extractor")
    except WeightsError as e:
        raise BaseBuildError(f"shape mismatch: embedder + body do not fit {BASE_MODEL}: {e}") from None
    return model.eval(), cfg


def _campaign_parts(home: NodeHome, led: Ledger, camp: Campaign) -> tuple[dict, dict]:
    """(embedder state, body state) of ``camp`` for this node; typed errors if it may not have them."""
    from protocols.split_parts import SplitBody

    try:
        embedder = open_secret(NodeIdentity.load(home), led, camp.secret, camp.service, camp.split)
    except SplitSecretError as e:
        raise BaseBuildError(f"cannot assemble the MSD base of campaign {camp.service[:12]}: {e} "
                             "(only the campaign's client members hold its embedder)") from None
    b = camp.body_entry.body
    store = BlobStore.of(home)
    if not store.has(b.get("blob", "")):
        raise BaseBuildError(f"the distilled body blob {str(b.get('blob'))[:12]} of entry "
                             f"{camp.body_entry.id.hex()[:12]} is not in the local store (a client of the round "
                             "has it; a daemon of a reader fetches it)")
    expect = {k: (tuple(v.shape), v.dtype) for k, v in SplitBody(camp.split).state_dict().items()}
    try:
        body, _ = load_weights(store, b["blob"], expect=expect)
    except WeightsError as e:
        raise BaseBuildError(f"MSD body blob rejected: {e}") from None
    return embedder, body


def build_base(home: NodeHome, campaign: str = "latest") -> ModelRecord:
    """Assemble the MSD base of ``campaign`` on this (client) node, store its extractor weight
    set and register it as a model; returns the record (same id on every client)."""
    home = NodeHandle.of(home)  # its ledger, store and registry: opened once for the steps below
    camp = find_campaign(home.ledger, campaign)
    embedder, body = _campaign_parts(home, home.ledger, camp)
    model, cfg = assemble(camp.split, embedder, body)
    entry = camp.body_entry.id.hex()
    prov = {"kind": BASE_KIND, "campaign": camp.service, "body_entry": entry, "secret_entry": camp.secret,
            "entries": [camp.service, entry], "base": f"msd:{entry[:32]}", "init_from": None}
    samples = int(camp.body_entry.body.get("samples", 0))
    store = BlobStore.of(home)
    blob = export_part(store, model, cfg, "extractor", labels=[], label_fp="", samples=samples,
                       extra={"base": prov["base"], "provenance": {"kind": BASE_KIND, "campaign": camp.service,
                                                                    "body_entry": entry}})
    metrics = {k: v for k, v in (camp.body_entry.body.get("metrics") or {}).items() if isinstance(v, (int, float))}
    rec = ModelRecord(model=cfg.to_dict(), labels=[], label_fp="", samples=samples, metrics=metrics,
                      blobs={"extractor": blob}, provenance=prov)
    register_model(home, rec)  # applies the [models] size limit
    return rec


@dataclass
class PublishedBase:
    entry: Entry
    blob: str
    readers: list[str]


def publish_base(home: NodeHome, model: str = "latest") -> PublishedBase:
    """Sign a ``weights`` entry for the registered MSD base ``model`` (id, prefix, or "latest"
    MSD base): part "extractor", provenance the campaign's service and body entries, blob
    readers = the campaign's client members (its secret's recipients; never the server)."""
    from atdnode.models import part_blob, weights_body

    home = NodeHandle.of(home)
    reg = ModelRegistry.of(home)
    if model == "latest":
        bases = [r for r in reg.list() if r.provenance.get("kind") == BASE_KIND]
        if not bases:
            raise BaseBuildError("no MSD base in the model registry (run `atd base build` first)")
        record = bases[-1]
    else:
        record = reg.get(model)
    if record.provenance.get("kind") != BASE_KIND:
        raise BaseBuildError(f"model {record.id} is not an MSD base (it was made by "
                             f"{record.provenance.get('kind') or 'training'})")
    ident = NodeIdentity.load(home)
    store = BlobStore.of(home)
    blob = part_blob(store, record, "extractor")
    led = home.ledger
    secret = led.get(record.provenance["secret_entry"])
    if secret is None:
        raise BaseBuildError(f"the campaign's secret entry {record.provenance['secret_entry'][:12]} is not in "
                             "the local ledger")
    readers = sorted(set(secret.body["recipients"]) - {ident.peer_id})
    body = weights_body(store, blob, part="extractor", record=record,
                        provenance=[record.provenance["campaign"], record.provenance["body_entry"]])
    body.update({"algorithm": BASE_KIND, bodies.READERS: readers})
    entry = bodies.append(led, ident.signer, "weights", body)
    return PublishedBase(entry=entry, blob=blob, readers=readers)
