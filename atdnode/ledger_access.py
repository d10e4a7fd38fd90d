"""Async access to the node's ledger from the trio loop, off the event loop.

SQLite work (and the signature checks inside `merge`) can take longer than yamux's 5 s
reader-stall limit on a big batch, so every call runs in a worker thread. A capacity
limiter of one serialises them: the ledger object holds one connection.
"""
from __future__ import annotations

from typing import Callable, Iterable, TypeVar

import trio

from atdnode.transport.base import StreamClosed
from atdnode.errors import ConfigError
from ledger import AuthorQuota, Ledger

T = TypeVar("T")


class NodeStopping(StreamClosed):
    """The ledger was closed: the node is shutting down. A stream handler that still runs
    (a peer's sync or blob request that arrived during shutdown) ends like a closed stream,
    quietly, instead of failing on SQLite's closed connection."""


class LedgerAccess:
    """Owns an open `Ledger`; `run(fn)` calls `fn(ledger)` in a worker thread; after
    `close()` every call raises `NodeStopping`."""

    def __init__(self, ledger: Ledger, *, quota: AuthorQuota | None = None, own: bytes | None = None) -> None:
        """`quota`: per-author size / rate limits on entries merged from the network
        (`ledger.quota`; HOME/config.toml ``[quota]``, see `quota_from_config`); `own`: this
        node's key, whose entries no quota or waiting cap holds back (a restored home takes
        its whole chain back from a member at once, issue 24)."""
        self.ledger = ledger
        self.quota = quota
        self.own = () if own is None else (own,)
        self._limiter = trio.CapacityLimiter(1)
        self._closed = False
        self._genesis_seen: set[bytes] = set()  # refusals' genesis bytes already merged

    async def run(self, fn: Callable[[Ledger], T]) -> T:
        if self._closed:
            raise NodeStopping("the node is shutting down")
        return await trio.to_thread.run_sync(self._call, fn, limiter=self._limiter)

    def _call(self, fn: Callable[[Ledger], T]) -> T:
        if self._closed:  # closed while this call waited for the limiter
            raise NodeStopping("the node is shutting down")
        return fn(self.ledger)

    async def close(self) -> None:
        """Close the ledger after the call in progress (the limiter serialises them)."""
        def shut(_led: Ledger) -> None:
            self._closed = True
            self.ledger.close()

        if not self._closed:
            await self.run(shut)

    async def merge(self, items: Iterable[bytes]):
        items = list(items)
        return await self.run(lambda led: led.merge(items, members_only=True, quota=self.quota,  # outsiders' entries
                                                    exempt=self.own))                            # never stored

    async def merge_genesis(self, raw: bytes) -> int:
        """Merge the genesis entry a refusal carried; returns how many entries it added. The
        same bytes a second time cost no ledger-thread job (a refused node must not spend
        its ledger thread on every refusal, issue 24)."""
        if raw in self._genesis_seen:
            await trio.lowlevel.checkpoint()
            return 0
        added = len((await self.merge([raw])).added)
        if len(self._genesis_seen) < 16:
            self._genesis_seen.add(raw)
        return added



def quota_from_config(table: dict | None) -> AuthorQuota:
    """`AuthorQuota` from the config's ``[quota]`` table (defaults without one); ConfigError
    for a malformed table."""
    try:
        return AuthorQuota.from_table(table)
    except ValueError as exc:
        raise ConfigError(f"config: {exc}") from None
