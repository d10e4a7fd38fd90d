"""Client side of `/atd/blob/1.0.0`: fetch one blob from several holders in parallel.

    fetcher = BlobFetcher(transport, store, FetchConfig())
    h = await fetcher.fetch(blob, peers, manifest_hash=entry_manifest_hash)

1. Every candidate peer is asked for the manifest (in parallel); those that hold the blob
   are its holders. The manifest used is the one named by `manifest_hash` (pass it: it
   comes from the signed ledger entry), else the one most holders offer -- then it is only
   checked at the end, by the whole-blob hash.
2. `store.partial(manifest).missing()` gives the chunks still needed (so an interrupted
   fetch resumes with only those). They sit in one shared queue; each holder gets up to
   `per_peer` workers (bulk TCP connections or libp2p streams, `max_streams` in total),
   each taking batches from the queue, so faster holders serve more chunks.
3. Each received chunk is handed to a writer task and written through
   `PartialBlob.write_chunk` in a worker thread (it verifies the chunk's hash against the
   manifest before writing). A chunk that fails verification is put back in the queue for
   another holder, and the peer that sent it is marked bad for this blob. A peer whose
   stream breaks, stalls (`stall_timeout`) or lacks a chunk is dropped for this fetch.
4. When every chunk is written, `complete()` checks the whole blob and moves it into the
   store. If holders run out first, FetchError; what was written stays for a resume.

Memory is bounded by buffers, whatever the blob size: per worker a fixed set of
`pipeline_bytes` + 2 chunks of buffers (one being received, the rest queued or being written). The queue keeps
the connection busy while a writer thread hashes, so a single connection is not a
stop-and-go ping-pong between processes.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import trio

from atdnode.blobpartial import PartialBlob
from atdnode.blobstore import BlobStore, Manifest, check_hash
from atdnode.errors import BlobError
from atdnode.transport.base import FrameError, Stream, Transport, TransportError
from atdnode.transport.blobwire import MAX_BATCH, MAX_CHUNK, PROTOCOL, StreamChunks, pack, read_header
from atdnode.transport.bulk import BulkConn, BulkIntegrityError, derive_keys, new_ephemeral

log = logging.getLogger(__name__)


class FetchError(TransportError, BlobError):
    """A blob could not be fetched (no holder, every holder failed or served bad data)."""


@dataclass(frozen=True)
class FetchConfig:
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
        self.batch = max(1, min(MAX_BATCH, cfg.batch_bytes // manifest.chunk_size))

    def take(self) -> list[int]:
        out = [self.queue.popleft() for _ in range(min(self.batch, len(self.queue)))]
        self.inflight.update(out)
        return out

    def give_back(self, idx: set[int]) -> None:
        back = sorted(i for i in idx if i in self.inflight)
        self.inflight.difference_update(back)
        self.queue.extendleft(reversed(back))
        self.lot.unpark_all()

    def done(self, i: int) -> None:
        self.inflight.discard(i)
        if not self.queue and not self.inflight:
            self.lot.unpark_all()

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

    async def fetch(self, blob: str, peers: list[str], *, manifest_hash: str | None = None) -> str:
        """Fetch `blob` into the store from whichever of `peers` hold it; return its hash.

        FetchError when no peer holds it (with `manifest_hash`: offers that manifest) or
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

    async def _fetch(self, blob: str, peers: list[str], manifest_hash: str | None) -> str:
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
                if job.queue:
                    per = max(1, min(self.cfg.per_peer, self.cfg.max_streams // len(holders)))
                    per = min(per, max(1, math.ceil(len(job.queue) / job.batch / len(holders))))
                    async with trio.open_nursery() as nursery:
                        for p in holders:
                            nursery.start_soon(self._peer, job, p, probes.pop(p)[0], per)
                if job.queue or job.inflight:
                    why = "; ".join(f"{p}: {r}" for p, r in {**report.failed_peers, **report.bad_peers}.items())
                    raise FetchError(f"blob {blob[:12]}: {len(job.queue) + len(job.inflight)} of {m.num_chunks} "
                                     f"chunks still missing, no usable holder left ({why or 'none'})")
                h = await trio.to_thread.run_sync(partial.complete)
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

    def _choose_manifest(self, blob: str, probes: dict, manifest_hash: str | None) -> Manifest:
        offered = [m for _, m in probes.values()]
        if not offered:
            raise FetchError(f"no peer holds blob {blob[:12]}")
        if manifest_hash is not None:
            for m in offered:
                if m.hash == manifest_hash:
                    return m
            raise FetchError(f"no holder of blob {blob[:12]} offers manifest {manifest_hash[:12]}")
        votes = Counter(m.hash for m in offered)
        best = min(votes, key=lambda h: (-votes[h], h))
        return next(m for m in offered if m.hash == best)

    # -- per holder --------------------------------------------------------------------

    async def _peer(self, job: _Job, peer: str, first: Stream, n: int) -> None:
        """Run up to n workers against one holder: over the bulk channel if offered, else
        (or when bulk fails) over libp2p streams."""
        if self.cfg.bulk and first.remote_host and peer not in self.no_bulk:
            outcome = await self._bulk(job, peer, first, n)
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
                    nursery.start_soon(self._worker, job, peer, c, fail)
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

    async def _worker(self, job: _Job, peer: str, conn: StreamChunks | BulkConn, fail=None) -> None:
        """Receive batches on `conn` until the queue is empty. On a broken connection:
        `fail(reason, integrity)` when given (bulk: the caller falls back), else the peer is
        dropped for this fetch."""
        # A fixed set of chunk buffers circulates receiver -> writer -> receiver: memory per
        # worker is bounded by it, and no chunk-sized allocation happens per chunk (which
        # otherwise lets glibc's heap grow with the blob size through fragmentation).
        depth = max(1, self.cfg.pipeline_bytes // job.m.chunk_size)
        free_send, free_recv = trio.open_memory_channel(depth + 2)
        for _ in range(depth + 2):  # streams deliver frames as fresh bytes: no buffers needed
            free_send.send_nowait(bytearray(job.m.chunk_size) if isinstance(conn, BulkConn) else None)
        owned: set[int] = set()
        send, recv = trio.open_memory_channel(depth)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer, job, peer, recv, free_send, owned, nursery.cancel_scope)
                async with send:
                    try:
                        await self._receive(job, peer, conn, send, free_recv, owned)
                    except (TransportError, trio.TooSlowError) as e:
                        if fail is not None:
                            fail(f"{type(e).__name__}: {e}", isinstance(e, BulkIntegrityError))
                        else:
                            job.fail(peer, f"{type(e).__name__}: {e}")
                        await conn.reset()
        finally:
            job.give_back(owned)

    async def _receive(self, job: _Job, peer: str, conn: StreamChunks | BulkConn, send: trio.MemorySendChannel,
                       free: trio.MemoryReceiveChannel, owned: set[int]) -> None:
        m, stall = job.m, self.cfg.stall_timeout
        while job.usable(peer):
            batch = job.take()
            if not batch:
                if not job.inflight:
                    return
                await job.lot.park()  # woken when chunks come back to the queue, or all are done
                continue
            owned.update(batch)
            with trio.fail_after(stall):
                await conn.request(pack({"op": "get", "blob": m.blob, "chunk_size": m.chunk_size, "chunks": batch}))
            for i in batch:
                buf = await free.receive()
                with trio.fail_after(stall):
                    data = await conn.chunk(i, m.span(i)[1], buf)
                await send.send((i, data, buf))

    async def _writer(self, job: _Job, peer: str, recv: trio.MemoryReceiveChannel, free: trio.MemorySendChannel,
                      owned: set[int], scope: trio.CancelScope) -> None:
        async with recv:
            async for i, data, buf in recv:
                try:
                    await trio.to_thread.run_sync(job.partial.write_chunk, i, data, False)
                except BlobError as e:  # hash mismatch (or the disk): never trust this peer for this blob
                    job.fail(peer, str(e), bad=True)
                    scope.cancel()
                    return
                n = len(data)
                del data
                free.send_nowait(buf)  # the buffer may be reused: write_chunk is done with it
                owned.discard(i)
                job.report.chunks_from[peer] += 1
                job.report.bytes += n
                job.unflushed += n
                if job.unflushed >= self.cfg.flush_bytes:
                    job.unflushed = 0
                    await trio.to_thread.run_sync(job.partial.flush)
                job.done(i)
