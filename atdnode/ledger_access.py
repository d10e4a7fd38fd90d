"""Async access to the node's ledger from the trio loop, off the event loop.

SQLite work (and the signature checks inside `merge`) can take longer than yamux's 5 s
reader-stall limit on a big batch, so every call runs in a worker thread. A capacity
limiter of one serialises them: the ledger object holds one connection.

Own appends go through `GroupCommit` (atdnode/group_commit.py, issue 29): several appends
per durable (synchronous=FULL) commit, the next group signed while this one is fsynced, and
each appender gets its entry -- what the daemon gossips -- only once it is durable.
"""
from __future__ import annotations

from typing import Callable, Iterable, TypeVar

import trio

from atdnode.errors import ConfigError
from atdnode.group_commit import GroupCommit, NodeStopping
from ledger import AuthorQuota, Entry, Ledger, Signer

__all__ = ["LedgerAccess", "NodeStopping", "quota_from_config"]

T = TypeVar("T")


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
        self._group = GroupCommit(self.run)

    @property
    def commits(self) -> int:
        """Group commits (one WAL fsync each) of own appends so far, for tests and /metrics."""
        return self._group.commits

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

    async def append(self, signer: Signer, kind: str, body: dict) -> Entry:
        """`Ledger.append` with group commit (atdnode/group_commit.py): returns the entry once
        it is durable; raises what `append` would (LedgerError), or the group's disk error."""
        return await self._group.append(signer, kind, body)

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
