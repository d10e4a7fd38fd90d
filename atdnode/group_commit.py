"""Group commit of the node's own appends, with the next group signed during this one's fsync.

`GroupCommit.append` queues an own entry and returns it once it is durable: stored by
`Ledger.append_many` in one transaction committed with synchronous=FULL (the WAL fsynced)
together with every append that arrived while the previous group was being written
(issue 29). Whatever the caller gossips is therefore already durable: a crash between
signing and commit loses only entries nobody was shown, and the node never signs twice at
a seq anyone saw. Readers of this process share the ledger thread (`LedgerAccess.run`),
so they never see an uncommitted own entry either.

Two stages, run by the first appender that finds none running (the "leader") until
nothing is queued:

* the committer writes a group in the ledger thread and wakes its appenders;
* the signer, while a group is being committed, signs what queued meanwhile in a worker
  thread (`ledger.sign_after`), continuing the chain from the last entry of the groups in
  flight, so the next group is ready when the commit returns: its signatures -- most of a
  group's CPU -- overlap the previous group's WAL write and fsync, which hold no GIL.
  `append_many` stores a signed-ahead entry only if it is exactly the entry it would sign
  (another process's append or a merged entry with a higher clock in between: it signs
  afresh), so a wrong guess costs a signature, never a different ledger.

When to commit. A closed loop of k appenders (each appends again once its entry is durable)
cannot form groups larger than k. Committing what is signed as soon as the committer is
free splits them into two alternating groups whose signing overlaps the other's commit:
k entries per max(2 F, k c) instead of per F + k c for one group (F: a commit's time; c:
the signer's time per entry). That wins when F < k c (fast fsync, many appenders); with a
slow disk (F > k c) one full group per fsync is better, and the committer waits until the
signer caught up with everything queued. Both F and c are measured as it runs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from atdnode.transport.base import StreamClosed
from ledger import Entry, Ledger, Signer
from ledger.ledger import sign_after

CHUNK = 16  # entries the signer signs per worker-thread call (the committer takes finished chunks)
_EWMA = 0.2


class NodeStopping(StreamClosed):
    """The ledger was closed: the node is shutting down. A stream handler that still runs
    (a peer's sync or blob request that arrived during shutdown) ends like a closed stream,
    quietly, instead of failing on SQLite's closed connection."""


@dataclass(eq=False)
class _Pending:
    signer: Signer
    kind: str
    body: dict
    entry: Entry | None = None  # signed ahead (a guess, see append_many)
    done: trio.Event = field(default_factory=trio.Event)
    result: Entry | BaseException | None = None


class GroupCommit:
    """Own appends through `run` (LedgerAccess.run: the ledger thread), grouped (module doc)."""

    def __init__(self, run: Callable[[Callable[[Ledger], object]], Awaitable[object]]) -> None:
        self._run = run
        self._queue: list[_Pending] = []     # not signed yet
        self._ready: list[_Pending] = []     # signed ahead (or left unsigned), in append order
        self._signing: list[_Pending] = []   # in the signer's worker thread now
        self._chain: dict[bytes, Entry] = {}  # signer key -> its last entry once all pending ones are stored
        self._epoch = 0  # bumped when a guess failed: a chunk signed meanwhile is not trusted
        self._lot = trio.lowlevel.ParkingLot()
        self._leading = False
        self.commits = 0  # group commits (one WAL fsync each) so far, for tests and /metrics
        self.commit_total_s = 0.0  # time in group commits so far
        self.commit_s = 2e-3  # EWMA of a commit's time (F) ...
        self.sign_s = 100e-6  # ... and of the signer's time per entry (c)

    async def append(self, signer: Signer, kind: str, body: dict) -> Entry:
        """The entry, once durable; raises what `Ledger.append` would (LedgerError), the
        group's disk error, or NodeStopping. `body` must not change after the call."""
        item = _Pending(signer, kind, body)
        self._queue.append(item)
        self._lot.unpark_all()
        if not self._leading:
            self._leading = True
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._sign_loop)
                    await self._commit_loop()
                    nursery.cancel_scope.cancel()
            finally:
                self._leading = False
                for p in self._queue + self._ready + self._signing:  # cancelled leader: hand nothing
                    if not p.done.is_set():                         # half-done to waiters
                        p.result = NodeStopping("the group commit was cancelled")
                        p.done.set()
                self._queue, self._ready, self._signing = [], [], []
                self._chain.clear()
        await item.done.wait()
        if isinstance(item.result, BaseException):
            raise item.result
        assert item.result is not None
        return item.result

    # --- committer ---------------------------------------------------------------------
    async def _commit_loop(self) -> None:
        while True:
            group = await self._next_group()
            if not group:
                return
            await self._commit(group)
            for _ in range(2):  # let the appenders just woken queue their next entry (trio may run us first)
                await trio.lowlevel.cancel_shielded_checkpoint()

    def _pending(self) -> int:
        return len(self._queue) + len(self._ready) + len(self._signing)

    async def _next_group(self) -> list[_Pending]:
        """The next group, all of one signer, in append order (module doc: when to commit)."""
        while True:
            if not self._pending():
                return []
            overlap = self.commit_s < self._pending() * self.sign_s
            head = self._queue[0].signer.public_key if self._queue else None
            if self._signing and not (overlap and self._ready) or not self._ready and head in self._chain:
                await self._lot.park()  # the signer is at it: wait for its chunk
                continue
            if self._ready:
                take, self._ready = self._ready, []
                if not overlap and not self._signing:  # one full group: the unsigned rest too
                    take, self._queue = take + self._queue, []
            else:  # nothing to continue the chain from (a first group, a failed guess): the committer signs
                take, self._queue = self._queue, []
            signer = take[0].signer
            group = [p for p in take if p.signer is signer]
            rest = [p for p in take if p.signer is not signer]  # another key (rotation): rarely
            if rest:
                self._unsign(rest)
                self._queue = rest + self._queue
            return group

    async def _commit(self, group: list[_Pending]) -> None:
        signer, me = group[0].signer, group[0].signer.public_key
        if any(p.entry is None for p in group):
            self._chain.pop(me, None)  # the tip after this group is known only once it is stored
        items = [(p.kind, p.body) for p in group]
        presigned = [p.entry for p in group]
        t0 = time.perf_counter()
        try:
            with trio.CancelScope(shield=True):  # the thread runs to the end anyway: report its outcome
                results, missed = await self._run(lambda led: _append(led, signer, items, presigned))
            self.commits += 1
        except BaseException as exc:  # disk / SQLite / shutdown: nothing of the group was stored
            results, missed = [exc] * len(group), True
        took = time.perf_counter() - t0
        self.commit_total_s += took
        self.commit_s += _EWMA * (took - self.commit_s)
        if missed:  # a guess failed: what was signed ahead after it continues a wrong chain
            self._chain.pop(me, None)
            self._unsign([p for p in self._ready if p.signer is signer])
        if me not in self._chain and not any(p.signer is signer for p in self._ready + self._signing):
            last = next((r for r in reversed(results) if isinstance(r, Entry)), None)
            if last is not None:
                self._chain[me] = last
        for p, r in zip(group, results):
            p.result = r
            p.done.set()
        self._lot.unpark_all()

    def _unsign(self, items: list[_Pending]) -> None:
        """Drop the signatures made ahead for `items` (their chain guess may be wrong): the
        committer signs them; no chunk signed meanwhile is trusted either."""
        self._epoch += 1
        for p in items:
            p.entry = None
            self._chain.pop(p.signer.public_key, None)

    # --- signer ------------------------------------------------------------------------
    async def _sign_loop(self) -> None:
        while True:
            chunk = self._next_chunk()
            if chunk is None:
                await self._lot.park()
                continue
            signer, base, epoch = chunk[0].signer, self._chain[chunk[0].signer.public_key], self._epoch
            self._signing = chunk
            t0 = time.perf_counter()
            entries = await trio.to_thread.run_sync(_sign_yielding, signer, base, [(p.kind, p.body) for p in chunk])
            self.sign_s += _EWMA * ((time.perf_counter() - t0) / len(chunk) - self.sign_s)
            self._signing = []
            if epoch == self._epoch:  # else a commit proved the chain wrong meanwhile: leave them unsigned
                for p, e in zip(chunk, entries):
                    p.entry = e
                if entries[-1] is not None:
                    self._chain[signer.public_key] = entries[-1]
                else:
                    self._chain.pop(signer.public_key, None)
            self._ready.extend(chunk)
            self._lot.unpark_all()

    def _next_chunk(self) -> list[_Pending] | None:
        """Up to CHUNK queued items of one signer whose chain tip is known."""
        if not self._queue or self._queue[0].signer.public_key not in self._chain:
            return None
        signer = self._queue[0].signer
        n = 0
        while n < min(CHUNK, len(self._queue)) and self._queue[n].signer is signer:
            n += 1
        chunk, self._queue = self._queue[:n], self._queue[n:]
        return chunk


def _sign_yielding(signer: Signer, base: Entry, items: list) -> list[Entry | None]:
    """`sign_after`, one entry at a time, giving the GIL up after each (time.sleep(0)): a
    signature holds the GIL, and a thread waiting for it -- the ledger thread back from its
    fsync, the trio loop -- would otherwise wait for the interpreter's 5 ms switch interval
    (measured: commits 13 ms instead of 6, the signer at 435 us an entry instead of 97)."""
    out: list[Entry | None] = []
    for item in items:
        e = sign_after(signer, base, [item])[0] if base is not None else None
        out.append(e)
        base = e
        time.sleep(0)
    return out


def _append(led: Ledger, signer: Signer, items: list, presigned: list) -> tuple[list, bool]:
    """append_many, and whether an entry signed ahead was not what it stored (in the ledger thread)."""
    misses = led.presign_misses
    out = led.append_many(signer, items, presigned)
    return out, led.presign_misses != misses
