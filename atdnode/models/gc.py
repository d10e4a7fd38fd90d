"""Removing old models: `atd models rm ID` and the `[models] max_bytes` size limit.

A model's files are its registry record, its evaluations, its weight blobs (full /
extractor / head / ensemble) and its training run folder (checkpoint, PNGs, CSV). A model
is *served* when any ledger entry names one of its blobs (a `weights` entry that
published it, an `aggregate` entry whose result it is, ...): peers may fetch or verify
those bytes at any time, so a served model is never removed (`ModelServed`, one line).
Blobs another record still uses are kept.

The size limit, from config.toml::

    [models]
    max_bytes = 2000000000   # total bytes of model blobs this node keeps (0 / absent: no limit)

`enforce_limit` removes the oldest unserved models, never the newest one, until the
total fits (or only served / newest models are left). Every writer of a model record
(training, the aggregation modes, `atd rounds`, the MSD base, netsim through them) goes
through `register_model`, which applies it after writing the record: the limit holds whoever
writes. Each removal is logged on the `atd.models` logger (WARNING); the CLI prints
those lines (`cli.commands.models.reporting_removals`), it decides nothing.
"""
from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass

from atdnode.blobs import BlobStore
from atdnode.errors import AtdError
from atdnode.node import NodeHandle, NodeHome
from atdnode.models.registry import ModelRecord, ModelRegistry, RunCheckpoint


log = logging.getLogger("atd.models")


class ModelServed(AtdError):
    """The model's bytes are named by a ledger entry: removing them would break what peers rely on."""


@dataclass
class Removed:
    model_id: str
    bytes: int
    blobs: list[str]


def _hex_strings(v, out: set[str]) -> None:
    if isinstance(v, str):
        if len(v) == 64:
            out.add(v.lower())
    elif isinstance(v, dict):
        for x in v.values():
            _hex_strings(x, out)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _hex_strings(x, out)


def served_blobs(home: NodeHome) -> dict[str, str]:
    """{blob hash: "entry-id-prefix (kind)"} for every 64-hex string named in an entry body."""
    out: dict[str, str] = {}
    for e in NodeHandle.of(home).ledger.query():
        if e.kind in ("genesis", "member", "hello"):
            continue
        found: set[str] = set()
        _hex_strings(e.body, found)
        for h in found:
            out.setdefault(h, f"{e.id.hex()[:16]} ({e.kind})")
    return out


def model_blobs(record: ModelRecord) -> list[str]:
    return sorted({b for b in record.blobs.values() if isinstance(b, str)})


def check_removable(record: ModelRecord, served: dict[str, str]) -> None:
    """ModelServed (one line) when a ledger entry names one of the record's blobs."""
    for part, blob in sorted(record.blobs.items()):
        if isinstance(blob, str) and blob in served:
            raise ModelServed(f"model {record.id} is served: its {part} blob {blob[:12]} is named by ledger entry "
                              f"{served[blob]}; not removed")


def remove_model(home: NodeHome, ref: str, *, served: dict[str, str] | None = None) -> Removed:
    """Remove model `ref` (id or unique prefix) and the files only it uses; ModelServed if served."""
    node = NodeHandle.of(home)
    reg = ModelRegistry.of(node)
    rec = reg.get(ref)
    served = served_blobs(node) if served is None else served
    check_removable(rec, served)
    store = BlobStore.of(node)
    others = {b for r in reg.list() if r.id != rec.id for b in model_blobs(r)}
    gone, size = [], 0
    for blob in model_blobs(rec):
        if blob not in others and store.has(blob):
            size += store.size(blob)
            store.delete(blob)
            gone.append(blob)
    run_key = rec.provenance.get("run_key")
    if isinstance(run_key, str) and run_key.isalnum():
        run = RunCheckpoint(home.runs_dir / run_key)
        if run.dir.is_dir() and run.read().get("model_id") == rec.id:
            shutil.rmtree(run.dir)  # its PNGs / CSV; a later identical `atd train` trains afresh
    reg.remove(rec.id)
    return Removed(model_id=rec.id, bytes=size, blobs=gone)


def size_limit(home: NodeHome) -> int:
    """`[models] max_bytes` from config.toml (0: no limit; also for a home without config.toml)."""
    if not home.config_file.is_file():
        return 0
    return NodeHandle.of(home).config.setting("models.max_bytes")  # checked as it loads


def enforce_limit(home: NodeHome, limit: int | None = None) -> list[Removed]:
    """Remove the oldest unserved models (never the newest) until model blobs fit `limit`."""
    node = NodeHandle.of(home)
    limit = size_limit(node) if limit is None else limit
    if not limit:
        return []
    reg = ModelRegistry.of(node)
    store = BlobStore.of(node)
    recs = reg.list()

    def total() -> int:
        blobs = {b for r in reg.list() for b in model_blobs(r)}
        return sum(store.size(b) for b in blobs if store.has(b))

    if total() <= limit:
        return []
    served = served_blobs(node)
    removed = []
    for rec in recs[:-1]:  # oldest first; the newest model stays
        if total() <= limit:
            break
        if any(b in served for b in model_blobs(rec)):
            continue
        gone = remove_model(node, rec.id, served=served)
        log.warning("removed old model %s (%.1f MB) to stay under the size limit", gone.model_id, gone.bytes / 1e6)
        removed.append(gone)
    return removed


def register_model(home: NodeHome, record: ModelRecord, *, recorded_in: bytes | None = None) -> str:
    """Add `record` to the node's registry, then keep model blobs under `[models] max_bytes`
    (`enforce_limit`; the new record is the newest, so it stays). `recorded_in`: the id of
    the aggregate entry the model is the result of (`ModelRegistry.add_recorded`: only
    registered once the ledger holds it). Returns the model id. The one way a model is
    registered: every writer calls it."""
    node = NodeHandle.of(home)
    reg = ModelRegistry.of(node)
    model_id = reg.add(record) if recorded_in is None else reg.add_recorded(record, recorded_in, node.ledger)
    enforce_limit(node)
    return model_id
