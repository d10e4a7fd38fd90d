"""Checks shared by the split-secret tests: is the clients' embedder anywhere on
the server, and how well does the paper's attacker do with and without permutation."""
from __future__ import annotations

from pathlib import Path

import torch

from atdnode.data import load_dataset
from atdnode.node import NodeHome, NodeIdentity
from atdnode.split import load_records
from atdnode.split.roles import prepare
from atdnode.split.secret import open_secret
from ledger import Ledger
from atdnode.learning import ModelConfig
from protocols.inversion_attack import AttackConfig, paper_attack
from protocols.split_parts import TaskSpec, build_plain_embedder
from protocols.split_state import load_state

DIGIT = TaskSpec("digit", "classification", 10)


def campaign_secret(home: NodeHome, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The adopted embedder secret as client ``home`` used it (named in its p-FESTA comm
    record, opened from its own ledger with its own key)."""
    (rec,) = [r for r in load_records(home) if r.get("secret_entry")]
    with Ledger.open(home.ledger_db) as led:
        return open_secret(NodeIdentity.load(home), led, rec["secret_entry"], rec["service_entry"], cfg)


def secret_bytes(state: dict[str, torch.Tensor]) -> list[bytes]:
    """Byte strings that would betray the embedder if found: each tensor's raw float32
    bytes, and its first 64 bytes alone."""
    out = []
    for v in state.values():
        raw = v.contiguous().numpy().tobytes()
        out += [raw, raw[:64]]
    return out


def files_containing(root: Path, needles: list[bytes]) -> list[str]:
    """Every file under ``root`` (ledger, WAL, state, records, logs) holding any needle."""
    hits = []
    for f in sorted(root.rglob("*")):
        if f.is_file():
            blob = f.read_bytes()
            if any(n in blob for n in needles):
                hits.append(str(f.relative_to(root)))
    return hits


def in_order_and_stored(server_home: NodeHome, client_home: NodeHome, spec: str,
                        cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the server stored for the client (its permuted uploads, (M, N, D)), the same
    images' in-order embeddings (what a non-permuting client would have sent; made here
    with the client's secret, as an oracle) and the images: (in_order, stored, images)."""
    client = NodeIdentity.load(client_home).peer_id
    tensors, _ = load_state(Path(server_home.root) / "split" / "server" / "pfesta" / "state")
    stored = tensors[f"store.{client}"]  # (M, N, D): exactly what the server holds
    x, _ = prepare(load_dataset(spec, cfg.img_size, cfg.in_chans, "train", seed=0), DIGIT, cfg.patch_size)
    emb = build_plain_embedder(cfg, state=campaign_secret(client_home, cfg))
    with torch.no_grad():
        in_order = emb(x)
    return in_order, stored, x


def attack_margin(server_home: NodeHome, client_home: NodeHome, spec: str, public_specs: list[tuple[str, str]],
                  cfg: ModelConfig, ac: AttackConfig = AttackConfig()) -> tuple[dict, dict]:
    """The paper's attacker on what the server stored for the client (permuted uploads) and
    on the same images' in-order embeddings (`in_order_and_stored`). Public images:
    ``public_specs``, disjoint from the client's. Returns (without permutation, with permutation)."""
    in_order, stored, x = in_order_and_stored(server_home, client_home, spec, cfg)
    public = torch.cat([prepare(load_dataset(s, cfg.img_size, cfg.in_chans, split, seed=0), DIGIT,
                                cfg.patch_size)[0] for s, split in public_specs])
    assert stored.shape == in_order.shape
    plain = paper_attack(in_order, x, public, cfg, permuted=False, ac=ac)
    perm = paper_attack(stored, x, public, cfg, permuted=True, ac=ac)
    return plain, perm


def spread(homes: list[NodeHome]) -> None:
    """Every home's entries merged into every other home's ledger (what sync would do)."""
    raws = []
    for h in homes:
        with Ledger.open(h.ledger_db) as led:
            raws += [e.to_bytes() for e in led.all_entries()]
    for h in homes:
        with Ledger.open(h.ledger_db) as led:
            led.merge(raws)
