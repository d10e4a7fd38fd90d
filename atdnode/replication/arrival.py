"""Waiting for what others published: until these entries are in this node's log and, when
asked, the blobs they name are in its store (the daemon fetches them). `atd ledger wait` is
this function; netsim and scripts call the same. Progress is reported through
`atdnode.progress` (entries arrived; blob bytes held once every entry is here).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack

from atdnode import progress
from atdnode.blobs import BlobStore, partial_bytes
from atdnode.errors import ConfigError, DaemonError
from atdnode.node import NodeHome
from ledger import Ledger

POLL_S = 0.25  # how often the log and the store are read again


def wait_for_entries(home: NodeHome, refs: Sequence[str], *, blobs: bool = False, timeout: float = 120.0,
                     poll: float = POLL_S) -> None:
    """Return once every entry of `refs` (full hex ids, or unique prefixes of at least
    `atdnode.ids.MIN_PREFIX` hex digits: `atdnode.ids.arrived_entry`) is in `home`'s log and,
    with `blobs`, every blob they name is in its store; DaemonError naming what is missing
    after `timeout` seconds; IdError (a ConfigError) for a malformed or ambiguous ref (the
    ledger and the store are read, nothing is written: a daemon does the rest)."""
    from atdnode.ids import arrived_entry

    ids = list(dict.fromkeys(r.strip().lower() for r in refs))
    if not home.ledger_db.exists():
        raise ConfigError(f"{home.ledger_db} is missing; this node's ledger is gone")
    store = BlobStore(home.blobs_dir)
    end = time.monotonic() + timeout
    with ExitStack() as stack:
        arrived = stack.enter_context(progress.task("entries", total=len(ids)))
        fetched = stack.enter_context(progress.task("blobs", total=None, unit="bytes")) if blobs else None
        while True:
            with Ledger.open(home.ledger_db) as led:
                got = {i: arrived_entry(led, i) for i in ids}  # a prefix: once one entry here matches it
            missing = [i[:16] for i, e in got.items() if e is None]
            arrived.update(len(ids) - len(missing))
            named = [e.body for e in got.values() if blobs and e is not None and isinstance(e.body.get("blob"), str)]
            unfetched = [b["blob"][:16] for b in named if not store.has(b["blob"])]
            if fetched is not None and not missing:  # every entry here: the total bytes are known
                sizes = {b["blob"]: int(b.get("size") or 0) for b in named}
                fetched.update(sum(min(partial_bytes(store, k), n) for k, n in sizes.items()),
                               total=sum(sizes.values()))
            if not missing and not unfetched:
                return
            if time.monotonic() > end:
                what = ([f"entries {', '.join(missing)}"] if missing else []) + \
                    ([f"blobs {', '.join(unfetched)}"] if unfetched else [])
                raise DaemonError(f"timed out after {timeout:g} s waiting for {' and '.join(what)} (is the daemon "
                                  f"running and connected? `atd node status --home {home.root}`)")
            time.sleep(poll)
