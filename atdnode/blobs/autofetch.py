"""Blob auto-fetch of a daemon, with the reader policy.

`AutoFetcher` keeps the set of blobs this node wants: those named by other members'
`weights` / `features` entries that it lacks and may read (`atdnode.blobs.readers`: sealed
features and MSD's authorised lists name their readers; a blob not for us is never even
tried). `queue_wanted_blobs()` re-reads the ledger (after a merge that added blob entries,
and at start-up) and also refreshes the reader lists the blob server checks and the
manifest hashes the signed entries naming each blob name (any of them will do: the
whole-blob hash is checked anyway, and a member naming a blob with a wrong manifest must
not stop others from fetching it). `fetch_loop()` fetches wanted blobs
while `auto_fetch` is on, with a per-blob back-off (1 s doubling to 60 s; 30 s doubling to
600 s after a disk error). `fetch(blob)` fetches one blob at once (`atd fetch`).
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable, Protocol, TypeVar

import trio

from atdnode.blobs.readers import BlobReaders
from atdnode.blobs.store import BlobStore
from atdnode.errors import DaemonError
from atdnode.retry import Backoff
from atdnode.transport import Transport, TransportError
from atdnode.blobs.xfer import BlobService, MemberGate
from ledger import Ledger

log = logging.getLogger("atd.daemon")

IDLE_WAKE_S = 300.0  # with nothing wanted, the fetch loop still looks again this often
T = TypeVar("T")


class LedgerJobs(Protocol):
    """The daemon's ledger (`atdnode.replication.LedgerAccess`): runs `fn(ledger)` in its thread."""

    async def run(self, fn: Callable[[Ledger], T]) -> T: ...


class AutoFetcher:
    """What one daemon wants of the blobs its ledger announces, and the loop that gets them."""

    def __init__(self, *, ledger: LedgerJobs, me: bytes, store: BlobStore, transport: Transport,
                 gate: MemberGate, blobs: BlobService, readers: BlobReaders,
                 disk_trouble: Callable[[str, BaseException], Awaitable[None]], poll_interval: float,
                 auto_fetch: bool) -> None:
        self.ledger, self.me, self.store, self.transport = ledger, me, store, transport
        self.gate, self.blobs, self.readers = gate, blobs, readers
        self.disk_trouble = disk_trouble
        self.poll_interval = poll_interval
        self._auto_fetch = auto_fetch
        self._wake = trio.Event()  # set when there may be something to fetch (fetch_loop waits on it)
        self.wanted: set[str] = set()
        self.manifests: dict[str, set[str]] = {}  # blob -> manifest hashes named by signed entries
        self.failures: dict[str, str] = {}
        self.waits = Backoff(1.0, 60.0)  # per blob; a disk error waits at least 30 s, at most 600 s

    @property
    def auto_fetch(self) -> bool:
        """Off: only explicit `fetch` calls download. Turning it on wakes the fetch loop."""
        return self._auto_fetch

    @auto_fetch.setter
    def auto_fetch(self, value: bool) -> None:
        self._auto_fetch = value
        self._wake.set()

    async def queue_wanted_blobs(self) -> None:
        """Re-read blob entries: manifests, reader lists, and the blobs to fetch."""
        me = self.me

        def wanted(led: Ledger) -> set[str]:
            out = set()
            named = led.query(kind="aggregate") + led.query(kind="weights") + led.query(kind="features")
            for e in named:
                if isinstance(e.body.get("blob"), str) and isinstance(e.body.get("manifest"), str):
                    self.manifests.setdefault(e.body["blob"], set()).add(e.body["manifest"])
            self.readers.refresh(led, named)
            for kind in ("weights", "features"):
                for e in led.query(kind=kind):
                    if e.author == me:
                        continue
                    blob = e.body.get("blob")
                    if isinstance(blob, str) and not self.readers.for_me(blob):
                        continue  # for named readers only (sealed features, MSD's authorised list)
                    if isinstance(blob, str) and not self.store.has(blob):
                        out.add(blob)
            return out

        found = await self.ledger.run(wanted)
        if found - self.wanted:
            self._wake.set()
        self.wanted |= found

    async def fetch_loop(self) -> None:
        """Fetch wanted blobs (module doc). With nothing to fetch it sleeps until
        `queue_wanted_blobs` finds a new blob, auto-fetch is turned on, or the earliest
        back-off ends: an idle daemon's fetch loop does not wake every second."""
        while True:
            self._wake = trio.Event()
            # with --no-auto-fetch only explicit `fetch` calls download (they learn manifests, not wants)
            for blob in sorted(self.wanted) if self.auto_fetch else []:
                if self.store.has(blob) or blob in self.failures:
                    self.wanted.discard(blob)
                    continue
                now = trio.current_time()
                if self.waits.blocked(blob, now):
                    continue
                try:
                    await self.fetch(blob)
                    self.waits.clear(blob)
                except (DaemonError, TransportError) as exc:
                    delay = self.waits.fail(blob, now)
                    log.info("fetch of %s postponed %.0f s: %s", blob[:12], delay, exc)
                except OSError as exc:  # disk full or unwritable store: one line, long back-off
                    self.waits.fail(blob, now, 600.0, at_least=30.0)
                    await self.disk_trouble(f"fetching blob {blob[:12]}", exc)
            wait = IDLE_WAKE_S
            if self.auto_fetch and self.wanted:  # back-offs running: wake when the first one ends
                now = trio.current_time()
                due = min(self.waits.until(b, now) for b in self.wanted)
                wait = max(max(self.poll_interval, 1.0), due - now)
            with trio.move_on_after(wait):
                await self._wake.wait()

    async def fetch(self, blob: str, timeout: float = 600.0) -> str:
        """Fetch `blob` from whichever connected peers hold it; returns its hash when stored."""
        if self.store.has(blob):
            return blob
        if not self.transport.peers():
            raise DaemonError("no connected peers to fetch from")
        with trio.move_on_after(min(timeout, 15.0)):  # connected, but membership may still be syncing
            while not (peers := [p for p in self.transport.peers() if self.gate.allows(p)]):
                await trio.sleep(0.2)
        if not peers:
            raise DaemonError("no connected member peers to fetch from")
        if blob not in self.manifests:
            await self.queue_wanted_blobs()  # learn the manifest hash the signed entry names
        with trio.fail_after(timeout):
            await self.blobs.fetch(blob, peers, manifest_hash=self.manifests.get(blob))
        self.wanted.discard(blob)
        return blob

    def fetch_report(self, blob: str) -> dict:
        """What the last fetch of `blob` did ({} if none ran)."""
        rep = self.blobs.fetcher.reports.get(blob)
        if rep is None:
            return {}
        return {"bytes": rep.bytes, "resumed_chunks": rep.resumed_chunks, "holders": list(rep.holders),
                "chunks_from": dict(rep.chunks_from), "bad_peers": dict(rep.bad_peers),
                "failed_peers": dict(rep.failed_peers), "seconds": rep.seconds,
                "modes": dict(rep.modes), "bulk_failed": dict(rep.bulk_failed)}
