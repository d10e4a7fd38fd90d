"""`atd split finetune`: fine-tune a task from a published MSD body (a `weights` entry).

The entry (part "body", algorithm "msd") names the blob, the split body config, the
campaign's `split_secret` entry (the clients' embedder, opened with this node's key; a node
that is not one of its recipients cannot fine-tune) and the tasks of the service. The blob must be in the local store (a
client of the MSD round has it; another node's daemon fetches it automatically, or
`atd fetch` does). It is loaded through the checked loader (hash, keys, shapes, dtypes,
finiteness), then body + task tail are trained on local labelled data and evaluated on
its test split — optionally next to the same fine-tuning from a random body.
"""
from __future__ import annotations

from typing import Any

from atdnode.blobs import BlobStore
from atdnode.data import load_dataset
from atdnode.data import require_classes
from atdnode.learning import resolve_device
from atdnode.node import NodeHome, NodeIdentity
from atdnode.split.client import SplitJoinError
from atdnode.split.roles import prepare
from atdnode.split.secret import open_secret
from atdnode.models import load_weights
from atdnode.errors import WeightsError
from ledger import Ledger
from protocols.msd import evaluate_local, fine_tune
from protocols.split_parts import SplitBody, TaskSpec, build_plain_embedder, split_config


def find_body_entry(home: NodeHome, ref: str = "latest"):
    """The MSD `weights` entry ``ref`` (hex id or prefix, or "latest") from the local ledger."""
    led = Ledger.open(home.ledger_db)
    try:
        found = [e for e in led.query(kind="weights") if e.body.get("part") == "body"
                 and e.body.get("algorithm") == "msd"]
    finally:
        led.close()
    if ref != "latest":
        found = [e for e in found if e.id.hex().startswith(ref.lower())]
    if not found:
        raise SplitJoinError(f"no MSD body weights entry {'' if ref == 'latest' else ref + ' '}in the local ledger")
    if ref != "latest" and len(found) > 1:
        raise SplitJoinError(f"weights entry prefix {ref!r} is ambiguous")
    return found[-1]


def finetune_from_entry(home: NodeHome, *, task: str, data: str, ref: str = "latest", steps: int = 100,
                        lr: float = 2e-3, seed: int = 0, compare_scratch: bool = False) -> dict[str, Any]:
    """Fine-tune ``task`` on ``data`` from the body of entry ``ref``; returns metrics and provenance."""
    entry = find_body_entry(home, ref)
    b = entry.body
    try:
        cfg = split_config(b["model"]["split"])
        specs = {t["name"]: TaskSpec.from_dict(t) for t in b["tasks"]}
        service, secret = str(b["model"]["service"]), str(b["model"]["secret"])
    except (KeyError, TypeError, ValueError) as e:
        raise SplitJoinError(f"weights entry {entry.id.hex()[:12]} does not describe an MSD body: {e}") from None
    if task not in specs:
        raise SplitJoinError(f"task {task!r} is not one of the service's tasks {sorted(specs)}")
    store = BlobStore(home.blobs_dir)
    if not store.has(b["blob"]):
        raise SplitJoinError(f"blob {b['blob'][:12]} of entry {entry.id.hex()[:12]} is not in the local store "
                             "(run a daemon to fetch it, or `atd fetch`)")
    expect = {k: (tuple(v.shape), v.dtype) for k, v in SplitBody(cfg).state_dict().items()}
    try:
        body_state, _ = load_weights(store, b["blob"], expect=expect)
    except WeightsError as e:
        raise SplitJoinError(f"MSD body blob rejected: {e}") from None
    spec = specs[task]
    train = load_dataset(data, cfg.img_size, cfg.in_chans, "train")
    require_classes(train)
    x, y = prepare(train, spec, cfg.patch_size)
    xt, yt = prepare(load_dataset(data, cfg.img_size, cfg.in_chans, "test"), spec, cfg.patch_size)
    with Ledger.open(home.ledger_db) as led:
        state = open_secret(NodeIdentity.load(home), led, secret, service, cfg)
    embedder = build_plain_embedder(cfg, state=state)
    metrics: dict[str, float] = {}
    for prefix, state in [("", body_state)] + ([("scratch_", None)] if compare_scratch else []):
        body, tail = fine_tune(embedder, cfg, spec, x, y, body_state=state, steps=steps, lr=lr, seed=seed,
                               device=resolve_device(None, home=home))
        metrics.update({prefix + k: v for k, v in evaluate_local(embedder, body, tail, spec, xt, yt).items()})
    return {"entry": entry.id.hex(), "blob": b["blob"], "task": task, "samples": int(x.shape[0]),
            "steps": steps, "metrics": metrics}
