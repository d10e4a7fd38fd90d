"""Verifiable ledger dumps for moving a ledger between nodes (`atd ledger export/import`).

A dump is one msgpack map:
    {"format": "atd-ledger-dump", "version": 1, "genesis": bytes32 | None, "count": n,
     "entries": [wire entry bytes, ...]}
Every entry carries its own signature, so importing is just a merge: nothing in a dump is
trusted, and a dump of another consortium is refused (WrongConsortium).
"""
from __future__ import annotations

import os
from pathlib import Path

from ledger.encoding import pack, unpack
from ledger.errors import MalformedEntry, WrongConsortium
from ledger.ledger import Ledger
from ledger.merge import MergeResult

FORMAT = "atd-ledger-dump"
VERSION = 1


def export_dump(ledger: Ledger, path: str | Path) -> int:
    """Write every stored entry (log, held and fork evidence) to `path` atomically; returns the count."""
    entries = ledger.raw_rows()
    data = pack({"format": FORMAT, "version": VERSION, "genesis": ledger.genesis_id,
                 "count": len(entries), "entries": entries})
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(entries)


def read_dump(data: bytes) -> tuple[bytes | None, list[bytes]]:
    """(genesis id, wire entries) of dump bytes; MalformedEntry if it is not a dump."""
    try:
        obj = unpack(data)
    except MalformedEntry as exc:
        raise MalformedEntry(f"not an atd ledger dump ({exc.reason})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise MalformedEntry("not an atd ledger dump")
    if obj.get("version") != VERSION:
        raise MalformedEntry(f"unsupported ledger dump version {obj.get('version')!r}")
    genesis, entries = obj.get("genesis"), obj.get("entries")
    if genesis is not None and (not isinstance(genesis, bytes) or len(genesis) != 32):
        raise MalformedEntry("dump genesis id is not 32 bytes")
    if not isinstance(entries, list) or not all(isinstance(e, bytes) for e in entries):
        raise MalformedEntry("dump entries are not a list of byte strings")
    if obj.get("count") != len(entries):
        raise MalformedEntry(f"dump says {obj.get('count')!r} entries but holds {len(entries)} (truncated?)")
    return genesis, entries


def import_dump(ledger: Ledger, path: str | Path) -> MergeResult:
    """Merge a dump into `ledger` (one transaction). A dump pinned to another genesis is refused."""
    genesis, entries = read_dump(Path(path).read_bytes())
    pin = ledger.genesis_id
    if genesis is not None and pin is not None and genesis != pin:
        raise WrongConsortium(f"dump belongs to genesis {genesis.hex()}, this ledger to {pin.hex()}")
    return ledger.merge(entries)
