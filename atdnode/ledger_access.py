"""Async access to the node's ledger from the trio loop, off the event loop.

SQLite work (and the signature checks inside `merge`) can take longer than yamux's 5 s
reader-stall limit on a big batch, so every call runs in a worker thread. A capacity
limiter of one serialises them: the ledger object holds one connection.
"""
from __future__ import annotations

from typing import Callable, Iterable, TypeVar

import trio

from ledger import Ledger

T = TypeVar("T")


class LedgerAccess:
    """Owns an open `Ledger`; `run(fn)` calls `fn(ledger)` in a worker thread."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._limiter = trio.CapacityLimiter(1)

    async def run(self, fn: Callable[[Ledger], T]) -> T:
        return await trio.to_thread.run_sync(fn, self.ledger, limiter=self._limiter)

    async def merge(self, items: Iterable[bytes]):
        items = list(items)
        return await self.run(lambda led: led.merge(items, members_only=True))  # outsiders' entries never stored
