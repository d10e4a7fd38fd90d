"""Client side of `/atd/blob/1.0.0`: fetch one blob from several holders in parallel.

    fetcher = BlobFetcher(transport, store, FetchConfig())
    h = await fetcher.fetch(blob, peers, manifest_hash=entry_manifest_hash)

1. Every candidate peer is asked for the manifest (in parallel); those that hold the blob
   are its holders. The manifest used is the one named by `manifest_hash` (pass it: it
   comes from the signed ledger entry; several entries may name the blob, so a set of
   hashes is accepted too -- then the one most holders offer among them), else the one
   most holders offer -- then it is only checked at the end, by the whole-blob hash.
2. `store.partial(manifest).missing()` gives the chunks still needed (so an interrupted
   fetch resumes with only those). They sit in one shared queue; each holder gets up to
   `per_peer` workers (bulk TCP connections or libp2p streams, `max_streams` in total),
   each taking batches from the queue, so faster holders serve more chunks.
3. Chunks are written through `PartialBlob.write_chunk` in worker threads: on a bulk
   connection one thread per batch receives, decrypts, writes and hashes each chunk (no
   thread hop per frame); on a libp2p stream a writer task writes whatever chunks arrived,
   one thread hop for all of them. Each byte is hashed ONCE: the whole-blob SHA-256 runs
   incrementally over the written prefix, in a hasher thread of its own beside the
   receivers (`PartialBlob.start_hasher`: two cores busy, not one), and a chunk is
   checked against its own manifest hash only when it is the first of its connection
   (a holder that serves garbage is caught at once). A chunk that fails that check is put
   back in the queue and its sender is marked bad for this blob. A peer whose connection
   breaks, stalls (`stall_timeout`) or lacks a chunk is dropped for this fetch.
4. When every chunk is written, `complete()` checks the whole blob and moves it into the
   store. If the whole hash is wrong, the chunks that do not match the manifest are
   un-recorded (`BadChunks`); their senders are marked bad and those chunks are fetched
   again from the other holders. Nothing unverified ever enters the store. If holders run
   out first, FetchError; what was written stays for a resume.

Memory is bounded by buffers, whatever the blob size: per bulk connection one chunk buffer
(plus the sockets' buffers); per stream `pipeline_bytes` of received chunks waiting for the
writer, which keeps the stream busy while a writer thread hashes.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Callable

import trio

from atdnode.blobs.partial import BadChunks, PartialBlob
from atdnode.blobs.store import BlobStore, Manifest, check_hash
from atdnode.errors import BlobError
from atdnode.transport import FrameError, Stream, Transport, TransportError
from atdnode.blobs.wire import GATHER, MAX_BATCH, MAX_CHUNK, PROTOCOL, StreamChunks, gather, pack, read_header
from atdnode.blobs.bulk import BulkConn, BulkIntegrityError, derive_keys, new_ephemeral

log = logging.getLogger(__name__)


class FetchError(TransportError, BlobError):
    """A blob could not be fetched (no holder, every holder failed or served bad data)."""


@dataclass(frozen=True)
class FetchConfig:
    """How a fetch spreads over holders: bulk channel or streams, workers, batch size, stall timeout."""

    bulk: bool = True  # ask holders for the encrypted TCP bulk channel (see bulk.py); streams if it fails
    max_streams: int = 8  # workers over all holders
    per_peer: int = 2  # workers (streams or bulk connections) per holder
    batch_bytes: int = 16 << 20  # chunks requested per round trip, in bytes
    stall_timeout: float = 30.0  # a holder silent this long is dropped
    flush_bytes: int = 64 << 20  # make written chunks durable (resumable) every this many bytes
    pipeline_bytes: int = 8 << 20  # per worker: received chunks waiting for the writer thread


@dataclass
class FetchReport:
    """What one fetch did (kept in `BlobFetcher.reports[blob]`)."""

    blob: str
    manifest: str = ""
    holders: list[str] = field(default_factory=list)
    chunks_from: Counter = field(default_factory=Counter)
    bytes: int = 0
    resumed_chunks: int = 0  # already on disk when the fetch started
    bad_peers: dict[str, str] = field(default_factory=dict)  # served data that failed verification
    failed_peers: dict[str, str] = field(default_factory=dict)  # broke, stalled, lacked chunks
    modes: dict[str, str] = field(default_factory=dict)  # peer -> "bulk" | "stream"
    bulk_failed: dict[str, str] = field(default_factory=dict)  # peer -> why its bulk channel was abandoned
    seconds: float = 0.0


class _Job:
    """The shared chunk queue of one fetch."""

    def __init__(self, manifest: Manifest, partial: PartialBlob, report: FetchReport, cfg: FetchConfig) -> None:
        self.m, self.partial, self.report, self.cfg = manifest, partial, report, cfg
        self.queue: deque[int] = deque(partial.missing())
        self.inflight: set[int] = set()
        self.lot = trio.lowlevel.ParkingLot()
        self.unflushed = 0
        self.flush_due = trio.Event()  # set when `unflushed` reached cfg.flush_bytes (BlobFetcher._flusher)
        self.source: dict[int, str] = {}  # chunk -> the peer it came from in this fetch (for BadChunks)
        self.batch = max(1, min(MAX_BATCH, cfg.batch_bytes // manifest.chunk_size))

    def take(self) -> list[int]:
        out = [self.queue.popleft() for _ in range(min(self.batch, len(self.queue)))]
        self.inflight.update(out)
        return out

    async def next_batch(self, peer: str, owned: set[int]) -> list[int] | None:
        """The next batch for a worker of `peer` (added to its `owned`); None when nothing is
        left for it. Waits while other workers hold the last chunks (they may give them back)."""
        while self.usable(peer):
            if batch := self.take():
                owned.update(batch)
                return batch
            if not self.inflight:
                return None
            await self.lot.park()  # woken when chunks come back to the queue, or all are done
        return None

    def request(self, batch: list[int]) -> bytes:
        """The `get` request for `batch`."""
        return pack({"op": "get", "blob": self.m.blob, "chunk_size": self.m.chunk_size, "chunks": batch})

    def give_back(self, idx: set[int]) -> None:
        back = sorted(i for i in idx if i in self.inflight)
        self.inflight.difference_update(back)
        self.queue.extendleft(reversed(back))
        self.lot.unpark_all()

    def settle(self, peer: str, arrived: list[tuple[int, int]], owned: set[int]) -> None:
        """Account the chunks a worker thread wrote for `peer` -- (index, bytes) -- and empty `arrived`."""
        for i, n in arrived:
            owned.discard(i)
            self.source[i] = peer
            self.report.chunks_from[peer] += 1
            self.report.bytes += n
            self.unflushed += n
            self.inflight.discard(i)
        arrived.clear()
        if self.unflushed >= self.cfg.flush_bytes:
            self.unflushed = 0
            self.flush_due.set()
        if not self.queue and not self.inflight:
            self.lot.unpark_all()

    def reject(self, chunks: list[int]) -> list[str]:
        """Chunks the whole-blob check found wrong (`BadChunks`, now missing again): the
        peers that sent them are marked bad and no longer credited; the chunks go back in
        the queue. Returns those peers (none for chunks from an earlier, resumed fetch)."""
        blamed: dict[str, list[int]] = {}
        for i in chunks:
            peer = self.source.pop(i, None)
            if peer is not None:
                blamed.setdefault(peer, []).append(i)
                self.report.chunks_from[peer] -= 1
                self.report.bytes -= self.m.span(i)[1]
        for peer, bad in blamed.items():
            self.fail(peer, f"chunks {bad[:10]} of blob {self.m.blob[:16]} do not match the manifest "
                            "(found by the whole-blob hash); rejected", bad=True)
        self.queue.extend(sorted(chunks))
        return list(blamed)

    def usable(self, peer: str) -> bool:
        return peer not in self.report.bad_peers and peer not in self.report.failed_peers

    def fail(self, peer: str, reason: str, *, bad: bool = False) -> None:
        target = self.report.bad_peers if bad else self.report.failed_peers
        if peer not in target:
            target[peer] = reason
            log.warning("blob %s: %s peer %s: %s", self.m.blob[:12], "bad" if bad else "dropping", peer, reason)
        self.lot.unpark_all()


class BlobFetcher:
    def __init__(self, transport: Transport, store: BlobStore, config: FetchConfig | None = None) -> None:
        self.transport, self.store = transport, store
        self.cfg = config or FetchConfig()
        self.reports: dict[str, FetchReport] = {}
        self._active: dict[str, trio.Event] = {}
        self.no_bulk: dict[str, str] = {}  # peers whose bulk frames failed authentication: streams only

    async def fetch(self, blob: str, peers: list[str], *,
                    manifest_hash: str | Collection[str] | None = None) -> str:
        """Fetch `blob` into the store from whichever of `peers` hold it; return its hash.

        FetchError when no peer holds it (with `manifest_hash`: offers that manifest, or one
        of those manifests) or
        every holder failed before all chunks arrived; chunks already written are kept, so
        calling again resumes. Concurrent calls for one blob share a single download.
        """
        blob = check_hash(blob)
        while True:
            running = self._active.get(blob)
            if running is not None:  # someone else is fetching it: wait for them, then re-check
                await running.wait()
                continue
            if await trio.to_thread.run_sync(self.store.has, blob):
                return blob
            if blob not in self._active:  # nobody started one while we looked at the store
                break
        done = self._active[blob] = trio.Event()
        try:
            return await self._fetch(blob, list(dict.fromkeys(peers)), manifest_hash)
        finally:
            del self._active[blob]
            done.set()

    async def _fetch(self, blob: str, peers: list[str], manifest_hash: str | Collection[str] | None) -> str:
        t0 = time.monotonic()
        report = self.reports[blob] = FetchReport(blob)
        probes: dict[str, tuple[Stream, Manifest]] = {}
        async with trio.open_nursery() as nursery:
            for p in peers:
                nursery.start_soon(self._probe, blob, p, probes, report)
        try:
            m = self._choose_manifest(blob, probes, manifest_hash)
            holders = sorted(p for p, (_, pm) in probes.items() if pm.hash == m.hash) + sorted(
                p for p, (_, pm) in probes.items() if pm.hash != m.hash)  # any holder can serve byte ranges
            report.manifest, report.holders = m.hash, holders
            if m.chunk_size > MAX_CHUNK:
                raise FetchError(f"blob {blob[:12]}: chunk size {m.chunk_size} exceeds the frame limit")
            partial = await trio.to_thread.run_sync(self.store.partial, m)
            job = _Job(m, partial, report, self.cfg)
            report.resumed_chunks = m.num_chunks - len(job.queue)
            try:
                h = await self._rounds(job, holders, probes)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(partial.close)  # keep what was written, for a resume
                raise
        except BlobError as e:
            if isinstance(e, FetchError):
                raise
            raise FetchError(f"blob {blob[:12]}: {e}") from e
        finally:
            for s, _ in probes.values():
                await s.close()
            report.seconds = time.monotonic() - t0
        log.info("fetched blob %s (%d bytes from %s) in %.2fs", blob[:12], report.bytes,
                 dict(report.chunks_from), report.seconds)
        return h

    async def _rounds(self, job: _Job, holders: list[str], probes: dict) -> str:
        """Fetch every missing chunk from the usable holders, then `complete()`. Chunks are
        written unverified (one SHA-256 per byte: the whole-blob hash), so when that hash
        fails, the chunks that do not match the manifest are missing again (`BadChunks`):
        their senders are marked bad and they are fetched again from the others -- a round
        per bad holder at most. FetchError when no usable holder is left."""
        for _ in range(len(holders) + 2):
            usable = [p for p in holders if job.usable(p)]
            if job.queue and usable:
                per = max(1, min(self.cfg.per_peer, self.cfg.max_streams // len(usable)))
                per = min(per, max(1, math.ceil(len(job.queue) / job.batch / len(usable))))
                job.partial.start_hasher()  # the whole-blob hash on a core of its own, beside the receivers
                async with trio.open_nursery() as outer:
                    outer.start_soon(self._flusher, job)
                    async with trio.open_nursery() as nursery:
                        for p in usable:
                            first = probes.pop(p)[0] if p in probes else None
                            nursery.start_soon(self._peer, job, p, first, per)
                    outer.cancel_scope.cancel()  # a flush under way finishes first (its thread is waited for)
            if job.queue or job.inflight:
                break
            try:
                return await trio.to_thread.run_sync(job.partial.complete)
            except BadChunks as e:
                log.warning("blob %s: %s", job.m.blob[:12], e)
                job.reject(e.chunks)
        report, m = job.report, job.m
        why = "; ".join(f"{p}: {r}" for p, r in {**report.failed_peers, **report.bad_peers}.items())
        raise FetchError(f"blob {m.blob[:12]}: {len(job.queue) + len(job.inflight)} of {m.num_chunks} "
                         f"chunks still missing, no usable holder left ({why or 'none'})")

    async def _probe(self, blob: str, peer: str, out: dict, report: FetchReport) -> None:
        """Ask `peer` for the manifest; on success keep the stream for the transfer."""
        stream = None
        try:
            with trio.fail_after(self.cfg.stall_timeout):
                stream = await self.transport.open_stream(peer, PROTOCOL)
                await stream.write_frame(pack({"op": "manifest", "blob": blob}))
                hdr = await read_header(stream)
                if hdr.get("ok") is not True:
                    await stream.close()
                    return
                m = Manifest.from_bytes(await stream.read_frame())
            if m.blob != blob:
                raise FrameError(f"sent a manifest for blob {m.blob[:12]}")
            out[peer] = (stream, m)
        except (TransportError, BlobError, trio.TooSlowError) as e:
            report.failed_peers[peer] = f"manifest: {type(e).__name__}: {e}"
            if stream is not None:
                await stream.reset()

    def _choose_manifest(self, blob: str, probes: dict, manifest_hash: str | Collection[str] | None) -> Manifest:
        offered = [m for _, m in probes.values()]
        if not offered:
            raise FetchError(f"no peer holds blob {blob[:12]}")
        if manifest_hash is not None:
            named = {manifest_hash} if isinstance(manifest_hash, str) else set(manifest_hash)
            offered = [m for m in offered if m.hash in named]
            if not offered:
                raise FetchError(f"no holder of blob {blob[:12]} offers manifest "
                                 f"{' or '.join(sorted(h[:12] for h in named))}")
        votes = Counter(m.hash for m in offered)
        best = min(votes, key=lambda h: (-votes[h], h))
        return next(m for m in offered if m.hash == best)

    # -- per holder --------------------------------------------------------------------

    async def _peer(self, job: _Job, peer: str, first: Stream | None, n: int) -> None:
        """Run up to n workers against one holder: over the bulk channel if offered, else
        (or when bulk fails) over libp2p streams. `first`: an open blob stream, if any."""
        if first is None and self.cfg.bulk and peer not in self.no_bulk:
            try:
                with trio.fail_after(self.cfg.stall_timeout):
                    first = await self.transport.open_stream(peer, PROTOCOL)
            except (TransportError, trio.TooSlowError) as e:
                job.fail(peer, f"{type(e).__name__}: {e}")
                return
        if first is not None and self.cfg.bulk and first.remote_host and peer not in self.no_bulk:
            outcome = await self._bulk(job, peer, first, n)
            if outcome == "failed" and job.usable(peer) and not (job.queue or job.inflight):
                job.fail(peer, f"bulk channel: {job.report.bulk_failed.get(peer, 'failed')}")  # others finished
            if outcome == "done" or not job.usable(peer) or not (job.queue or job.inflight):
                return
            if outcome == "failed":
                first = None  # the bulk control stream is spent: fall back on fresh streams
        job.report.modes[peer] = "stream"
        conns: list[StreamChunks] = []
        try:
            if first is not None:
                conns.append(StreamChunks(first))
            while len(conns) < n:
                conns.append(StreamChunks(await self.transport.open_stream(peer, PROTOCOL)))
            async with trio.open_nursery() as nursery:
                for c in conns:
                    nursery.start_soon(self._worker, job, peer, c)
        except (TransportError, trio.TooSlowError) as e:
            job.fail(peer, f"{type(e).__name__}: {e}")
        finally:
            for c in conns:
                await c.close()

    async def _bulk(self, job: _Job, peer: str, control: Stream, n: int) -> str:
        """Fetch over the encrypted bulk channel: "done", "unoffered" (`control` is still
        usable as a blob stream) or "failed" (the caller falls back to streams). A frame that fails authentication marks the
        peer: no bulk channel with it again (`no_bulk`)."""
        conns: list[BulkConn] = []
        failed: list[str] = []
        offered = False

        def fail(reason: str, integrity: bool) -> None:
            failed.append(reason)
            job.report.bulk_failed[peer] = reason
            if integrity:
                self.no_bulk[peer] = reason
            log.warning("blob %s: bulk channel with %s failed (%s); falling back to streams", job.m.blob[:12], peer, reason)

        try:
            private, client_pub = new_ephemeral()
            with trio.fail_after(self.cfg.stall_timeout):
                await control.write_frame(pack({"op": "bulk", "blob": job.m.blob, "conns": n, "x25519": client_pub}))
                hdr = await read_header(control)
            if hdr.get("ok") is not True:
                return "unoffered"
            port, server_pub = hdr.get("port"), hdr.get("x25519")
            offered = True
            if type(port) is not int or not isinstance(server_pub, bytes):
                raise FrameError("malformed bulk offer")
            keys = derive_keys(private, server_pub, server_peer=peer, client_peer=self.transport.peer_id,
                               server_pub=server_pub, client_pub=client_pub, conns=n)
            for i in range(n):
                conns.append(await BulkConn.open(control.remote_host, port, i, keys[i], peer, self.cfg.stall_timeout))
            job.report.modes[peer] = "bulk"
            async with trio.open_nursery() as nursery:
                for c in conns:
                    nursery.start_soon(self._bulk_worker, job, peer, c, fail)
        except (TransportError, trio.TooSlowError) as e:
            fail(f"{type(e).__name__}: {e}", isinstance(e, BulkIntegrityError))
        finally:
            for c in conns:
                await c.close()
            if offered or failed:
                with trio.move_on_after(2):  # let the server report it is done; not essential
                    try:
                        await read_header(control)
                    except TransportError:
                        pass
                await control.close()
        return "failed" if failed else "done"

    async def _bulk_worker(self, job: _Job, peer: str, conn: BulkConn, fail: Callable[[str, bool], None]) -> None:
        """Fetch batches on one bulk connection until the queue is empty. Each batch is
        received, decrypted, written and hashed in one worker thread (`BulkConn.fetch_batch`)
        through one chunk buffer: memory per connection is one chunk plus the socket's
        buffers, and there is one thread hop per batch, not per frame. A broken connection
        calls `fail(reason, integrity)` (the caller falls back to streams)."""
        buf, owned, arrived = bytearray(job.m.chunk_size), set[int](), list[tuple[int, int]]()
        check_next = [True]  # the connection's first chunk is checked against its own hash

        def sink(i: int, data: memoryview) -> None:  # in the worker thread
            if job.partial.write_chunk(i, data, False, check_next[0]):
                arrived.append((i, len(data)))
            check_next[0] = False

        ahead: list[int] = []  # the next batch, already requested by the thread of the current one

        def more() -> bytes | None:  # on the trio thread, called by the worker thread (trio.from_thread)
            if job.usable(peer) and (nxt := job.take()):
                owned.update(nxt)
                ahead.extend(nxt)
                return job.request(nxt)
            return None

        try:
            while True:
                if ahead and job.usable(peer):
                    batch, header = ahead[:], None
                    ahead.clear()
                elif (batch := await job.next_batch(peer, owned)) is not None:
                    header = job.request(batch)
                else:
                    break
                try:
                    await conn.fetch_batch(header, [(i, job.m.span(i)[1]) for i in batch], buf, sink, more)
                finally:
                    job.settle(peer, arrived, owned)
        except BlobError as e:  # a chunk failed its hash (or the disk): never trust this peer for this blob
            job.fail(peer, str(e), bad=True)
            await conn.reset()
        except (TransportError, trio.TooSlowError) as e:
            fail(f"{type(e).__name__}: {e}", isinstance(e, BulkIntegrityError))
            await conn.reset()
        finally:
            job.give_back(owned)

    async def _worker(self, job: _Job, peer: str, conn: StreamChunks) -> None:
        """Receive batches on a libp2p stream until the queue is empty; a writer task writes
        what arrived (all chunks waiting, in one thread hop). A broken stream drops the peer
        for this fetch."""
        depth = max(1, self.cfg.pipeline_bytes // job.m.chunk_size)  # chunks waiting for the writer
        owned: set[int] = set()
        send, recv = trio.open_memory_channel(depth)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer, job, peer, recv, owned, nursery.cancel_scope)
                async with send:
                    try:
                        await self._receive(job, peer, conn, send, owned)
                    except (TransportError, trio.TooSlowError) as e:
                        job.fail(peer, f"{type(e).__name__}: {e}")
                        await conn.reset()
        finally:
            job.give_back(owned)

    async def _receive(self, job: _Job, peer: str, conn: StreamChunks, send: trio.MemorySendChannel,
                       owned: set[int]) -> None:
        m, stall = job.m, self.cfg.stall_timeout
        while (batch := await job.next_batch(peer, owned)) is not None:
            with trio.fail_after(stall):
                await conn.request(job.request(batch))
            for i in batch:
                with trio.fail_after(stall):
                    data = await conn.chunk(i, m.span(i)[1])
                await send.send((i, data))

    async def _writer(self, job: _Job, peer: str, recv: trio.MemoryReceiveChannel, owned: set[int],
                      scope: trio.CancelScope) -> None:
        check_next, arrived = [True], list[tuple[int, int]]()  # the stream's first chunk: checked by its own hash

        def write(items: list[tuple[int, bytes]]) -> None:  # in a worker thread
            for i, data in items:
                if job.partial.write_chunk(i, data, False, check_next[0]):
                    arrived.append((i, len(data)))
                check_next[0] = False

        want = max(1, min(GATHER, self.cfg.pipeline_bytes // job.m.chunk_size // 2))
        async with recv:
            async for item in recv:
                items = await gather(recv, item, want)
                try:
                    await trio.to_thread.run_sync(write, items)  # not abandoned: it ends before we go on
                except BlobError as e:  # hash mismatch (or the disk): never trust this peer for this blob
                    job.fail(peer, str(e), bad=True)
                    scope.cancel()
                    return
                finally:
                    del items, item
                    job.settle(peer, arrived, owned)

    async def _flusher(self, job: _Job) -> None:
        """Make written chunks durable (resumable) every `flush_bytes`, beside the workers:
        a worker never waits for an fsync."""
        while True:
            await job.flush_due.wait()
            job.flush_due = trio.Event()
            await trio.to_thread.run_sync(job.partial.flush)
