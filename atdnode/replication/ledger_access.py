"""Async access to the node's ledger from the trio loop, off the event loop.

SQLite work (and the signature checks inside `merge`) can take longer than yamux's 5 s
reader-stall limit on a big batch, so every call runs in a worker thread. A capacity
limiter of one serialises them: the ledger object holds one connection.

Group commit. `append` queues the node's own entry; one task at a time (the
first appender that finds no commit running) takes everything queued and writes it with
`Ledger.append_many`: one durable transaction, one WAL fsync, for every append that
arrived while the previous group was being written. Each appender gets its entry back only
after that commit returned, so whatever the caller gossips is already durable: a crash
(process killed, power cut) between signing and the commit loses only entries nobody was
shown, and the node never signs twice at a seq anyone saw. Readers of this process go
through the same limiter, so they never see an uncommitted own entry either.

Where a group's time goes (`bench/ledger_bench.py` prints the numbers: `fsync_ms`,
`group_ms`, `fsync_ceiling`): per entry an Ed25519 signature, the canonical encoding and
hash, and an SQLite insert; per group one COMMIT, i.e. one fsync of the WAL (plus, now and
then, a WAL checkpoint). A closed loop of k appenders never forms groups larger than k, so
with sign time s and fsync time F throughput is bounded by 1 / (s + F / k): on a disk whose
fsync is slow the fsync dominates at small k, whatever this code does.

Signing the next group while this group's fsync runs was tried and reverted (commit bb07115,
numbers in its message): an Ed25519 signature holds the GIL (cryptography), so a signer
thread runs only while the trio loop and the ledger thread wait; it gained nothing on the
shared 2-core machine, and `executemany` for a group's rows was not worth a second insert
path either.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, TypeVar

import trio

from atdnode.bodies import refusal
from atdnode.transport import StreamClosed
from atdnode.errors import ConfigError
from ledger import AuthorQuota, Entry, Ledger, Signer

T = TypeVar("T")


class NodeStopping(StreamClosed):
    """The ledger was closed: the node is shutting down. A stream handler that still runs
    (a peer's sync or blob request that arrived during shutdown) ends like a closed stream,
    quietly, instead of failing on SQLite's closed connection."""


@dataclass
class _Pending:
    kind: str
    body: dict
    done: trio.Event = field(default_factory=trio.Event)
    result: Entry | BaseException | None = None


class LedgerAccess:
    """Owns an open `Ledger`; `run(fn)` calls `fn(ledger)` in a worker thread; after
    `close()` every call raises `NodeStopping`."""

    def __init__(self, ledger: Ledger, *, quota: AuthorQuota | None = None, own: bytes | None = None) -> None:
        """`quota`: per-author size / rate limits on entries merged from the network
        (`ledger.quota`; HOME/config.toml ``[quota]``, see `quota_from_config`); `own`: this
        node's key, whose entries no quota or waiting cap holds back (a restored home takes
        its whole chain back from a member at once)."""
        self.ledger = ledger
        self.quota = quota
        self.own = () if own is None else (own,)
        self._limiter = trio.CapacityLimiter(1)
        self._closed = False
        self._genesis_seen: set[bytes] = set()  # refusals' genesis bytes already merged
        self._queue: list[tuple[Signer, _Pending]] = []  # own appends waiting for the next group commit
        self._committing = False
        self.commits = 0  # group commits (one WAL fsync each) so far, for tests and /metrics
        self.commit_s = 0.0  # time those commits took (the ledger thread's part), for benchmarks

    async def run(self, fn: Callable[[Ledger], T]) -> T:
        if self._closed:
            raise NodeStopping("the node is shutting down")
        return await trio.to_thread.run_sync(self._call, fn, limiter=self._limiter)

    def _call(self, fn: Callable[[Ledger], T]) -> T:
        if self._closed:  # closed while this call waited for the limiter
            raise NodeStopping("the node is shutting down")
        return fn(self.ledger)

    @property
    def closed(self) -> bool:
        """True once `close` ran: the daemon that owns this ledger is shutting down."""
        return self._closed

    async def close(self) -> None:
        """Close the ledger after the call in progress (the limiter serialises them)."""
        def shut(_led: Ledger) -> None:
            self._closed = True
            self.ledger.close()

        if not self._closed:
            await self.run(shut)

    async def append(self, signer: Signer, kind: str, body: dict) -> Entry:
        """`Ledger.append` with group commit (see the module doc): returns the entry once it
        is durable; raises what `append` would (LedgerError), or the group's disk error."""
        item = _Pending(kind, body)
        self._queue.append((signer, item))
        if not self._committing:
            self._committing = True
            try:
                while self._queue:
                    await self._commit_group()
                    for _ in range(2):  # let the appenders just woken queue their next entry into the
                        await trio.lowlevel.cancel_shielded_checkpoint()  # next group (trio may run us first)
            finally:
                self._committing = False
                for _, p in self._queue:  # cancelled leader: hand nothing half-done to waiters
                    if not p.done.is_set():
                        p.result = NodeStopping("the group commit was cancelled")
                        p.done.set()
                self._queue.clear()
        await item.done.wait()
        if isinstance(item.result, BaseException):
            raise item.result
        assert item.result is not None
        return item.result

    async def _commit_group(self) -> None:
        """Write the queued appends of the first queued signer in one durable transaction."""
        signer = self._queue[0][0]
        group = [p for s, p in self._queue if s is signer]
        self._queue = [(s, p) for s, p in self._queue if s is not signer]
        t0 = time.perf_counter()
        try:
            with trio.CancelScope(shield=True):  # the thread runs to the end anyway: report its outcome
                results: list = await self.run(lambda led: led.append_many(signer, [(p.kind, p.body) for p in group]))
            self.commits += 1
            self.commit_s += time.perf_counter() - t0
        except BaseException as exc:  # disk / SQLite / shutdown: nothing of the group was stored
            results = [exc] * len(group)
        for p, r in zip(group, results):
            p.result = r
            p.done.set()

    async def merge(self, items: Iterable[bytes]):
        """Merge entries from the network (gossip, sync): members' only, within their quota,
        and only bodies that fit the spec (`atdnode.bodies.refusal`; a refused one is logged
        and not stored, its author's chain waits behind it: `Ledger.merge`)."""
        items = list(items)
        return await self.run(lambda led: led.merge(items, members_only=True, quota=self.quota,  # outsiders' entries
                                                    exempt=self.own, check=refusal))             # never stored

    async def merge_genesis(self, raw: bytes) -> int:
        """Merge the genesis entry a refusal carried; returns how many entries it added. The
        same bytes a second time cost no ledger-thread job (a refused node must not spend
        its ledger thread on every refusal)."""
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
