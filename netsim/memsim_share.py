"""What the simulated nodes of one process share (netsim.memnet, simulation only).

All nodes of a simulation live in one process. Results that depend only on the bytes at
hand -- a signature check that succeeded, the parsed form of a stored entry -- are
computed once and looked up by the next node, without changing any node's outcome.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def shared_signature_checks(keep: int = 1 << 18) -> Iterator[None]:
    """Remember successful Ed25519 checks process-wide (simulation only).

    Every simulated node still parses and checks each entry it receives, but all nodes
    share one process: a (key, signature, message) triple one node verified verifies the
    same for the next, so its result is looked up instead of recomputed (1,000 nodes would
    otherwise repeat each check 1,000 times). Keyed by a hash of the exact bytes; failures
    are never cached, so a forged or altered entry is always checked for real.
    """
    import ledger.entry as entry_mod

    original = entry_mod.verify_signature
    ok: OrderedDict[bytes, None] = OrderedDict()

    def verify(public_key: bytes, signature: bytes, data: bytes) -> None:
        key = hashlib.blake2b(bytes(public_key) + bytes(signature) + bytes(data), digest_size=32).digest()
        if key in ok:
            return
        original(public_key, signature, data)  # raises BadSignature
        ok[key] = None
        if len(ok) > keep:
            ok.popitem(last=False)

    entry_mod.verify_signature = verify
    try:
        yield
    finally:
        entry_mod.verify_signature = original


@contextmanager
def shared_entry_reads(keep: int = 1 << 17) -> Iterator[None]:
    """Share parsed log entries process-wide (simulation only).

    Every simulated ledger is its own SQLite database, and each read still runs its query
    there; only the step from a stored row to an `Entry` (decoding the payload) is looked up:
    an `Entry` is immutable and the same stored (id, signature) is the same entry in every
    node, so one node's parse serves the next (with 1,000 nodes, every node reading the
    1,000 hello entries at start-up decoded the same million rows). Bounded LRU;
    restored afterwards."""
    import ledger.ledger as ledger_mod

    original = ledger_mod._entry
    parsed: OrderedDict[tuple[bytes, bytes], Any] = OrderedDict()

    def entry(row: tuple) -> Any:
        key = (row[2], row[1])  # (entry id = hash of the payload, signature)
        e = parsed.get(key)
        if e is None:
            e = parsed[key] = original(row)
            if len(parsed) > keep:
                parsed.popitem(last=False)
        return e

    ledger_mod._entry = entry
    try:
        yield
    finally:
        ledger_mod._entry = original
