"""The blob protocol `/atd/blob/1.0.0`: serve and fetch content-addressed blobs over streams.

Wire (every frame length-prefixed, see framing.py; headers are msgpack maps <= 64 KiB):

    client -> {"op": "manifest", "blob": hex}
    server <- {"ok": true} + one raw frame: the canonical manifest bytes
              | {"ok": false, "error": str}
    client -> {"op": "get", "blob": hex, "chunk_size": int, "chunks": [i, ...]}   (<= 256)
    server <- per chunk: {"i": i, "n": len} + one raw frame of exactly len bytes
              | {"i": i, "error": str} (and no data frame)
    client -> {"op": "bulk", "blob": hex, "conns": k, "x25519": 32 bytes}
    server <- {"ok": true, "port": p, "x25519": 32 bytes} | {"ok": false, "error": str}
              ... then {"done": true} once the bulk connections are finished.

Members only. The server answers a non-member's stream with one refusal frame
(`atdnode.replication.access`, `{"ok": false, "refused": true, ...}`) before reading a request, and
re-checks membership before every request, so a member revoked mid-stream is refused at
its next request. A blob whose ledger entry carries a reader list (atdnode.bodies)
is served only to those readers: other members get `{"ok": false, "error": "not a reader"}`.

Chunks are byte ranges [i*chunk_size, ...) of the blob, so a server needs no manifest of its
own for the client's chunking, and never re-hashes what it serves: the client verifies every
chunk against the manifest it trusts (`PartialBlob.write_chunk`).

Bulk channel. `op: bulk` makes the server listen on a TCP port of the address the daemon
listens on (never 0.0.0.0: with a wildcard listener, the local address that reaches the
client) and run an ephemeral X25519 exchange on this Noise-authenticated stream; the client
opens up to k TCP connections that prove the derived key, and then speaks the same `get`
requests there, every frame AES-256-GCM sealed (see bulk.py). Integrity additionally comes
from the manifest (named by the signed ledger entry). Turned off or pinned to a fixed port
in config.toml (`[bulk] enabled`, `port`; see NodeConfig.bulk_options); with a fixed port,
one offer at a time uses it and a concurrent request is answered "busy" (the client then
uses streams). Throughput of both against raw TCP + SHA-256: bench/transfer_bench.py.

A peer that breaks the protocol (malformed or oversized header, wrong chunk length) has
that one stream reset with a logged reason; nothing else is affected.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Collection
from typing import Any, Awaitable, Callable, Protocol

import trio

from atdnode.blobs.store import BlobStore, check_hash
from atdnode.errors import BlobError
from atdnode.transport import FrameError, PeerLimits, Stream, StreamClosed, Transport, lease_or_reset
from atdnode.blobs.wire import (  # noqa: F401  (re-exported: the protocol's public names)
    HEADER_MAX,
    MAX_BATCH,
    PROTOCOL,
    StreamChunks,
    chunk_request,
    pack,
    read_header,
    unpack,
)
from atdnode.blobs.fetch import BlobFetcher, FetchConfig
from atdnode.blobs.bulk import MAX_CONNS, BulkConn  # noqa: F401  (BulkConn re-exported)
from atdnode.blobs.bulk_server import BulkConns, ChunkReader, serve_bulk

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 60.0  # server: a request stream (or bulk connection) silent this long is closed
READ_AHEAD_BYTES = 4 << 20  # server: chunks read ahead of the stream, per stream
PER_PEER_STREAMS = 6  # server: streams one peer may hold at once (of max_streams slots)


class MemberGate(Protocol):
    """Who may use the blob protocol: the daemon's `atdnode.replication.MembershipGate`
    (members only), which replication keeps current from the ledger."""

    def allows(self, peer: str) -> bool: ...
    async def admit(self, stream: Stream, what: str) -> bool: ...


class BlobServer:
    """Serves blobs held in `store` to peers (the inbound side of `/atd/blob/1.0.0`)."""

    def __init__(self, transport: Transport, store: BlobStore, *, bulk: bool = True, max_streams: int = 32,
                 gate: MemberGate | None = None, may_read: Callable[[str, str], bool] | None = None,
                 bulk_port: int = 0, per_peer: int = PER_PEER_STREAMS) -> None:
        """`gate`: members-only access (None: serve anyone -- only for tools without a ledger);
        `may_read(peer, blob)`: per-blob reader lists; `bulk_port`: 0 = a fresh port per offer;
        `per_peer`: streams one peer may hold at once (fairness)."""
        self.transport, self.store, self.bulk = transport, store, bulk
        self.gate, self.may_read, self.bulk_port = gate, may_read, bulk_port
        self._bulk_port_lock = trio.Lock()  # a fixed port serves one offer at a time
        self._slots = trio.Semaphore(max_streams)
        # Fairness: one peer holds at most `per_peer` streams (served or waiting for a slot);
        # more are reset at once, so a slot hog cannot starve the others.
        self.limits = PeerLimits(per_peer=min(per_peer, max_streams), total=4 * max_streams)
        self.served_chunks = 0  # chunks / bytes sent so far (tests and stats)
        self.served_bytes = 0
        # Awaited before each `get` batch is served, on streams and bulk connections alike:
        # (peer, chunk indexes) -> None. Tests stall a holder with it; netsim may shape.
        self.before_batch: Callable[[str, list[int]], Awaitable[None]] | None = None
        self.bulk_conns = BulkConns()  # the proven bulk connections being served, by peer

    def may_serve(self, peer: str, blob: str) -> bool:
        """May `peer` read `blob` now? The membership gate and the blob's reader list."""
        if self.gate is not None and not self.gate.allows(peer):
            return False
        return self.may_read is None or self.may_read(peer, blob)

    def bulk_peers(self) -> list[str]:
        """Peers holding bulk connections now."""
        return self.bulk_conns.peers()

    def drop_peer(self, peer: str) -> int:
        """Close every bulk connection of `peer` at once (e.g. just revoked); returns how many.
        Safe from the trio thread: closing wakes the worker thread blocked on the socket."""
        n = self.bulk_conns.drop(peer)
        if n:
            log.info("closed %d bulk connection(s) of %s", n, peer)
        return n

    def _reader(self, blob: str, path: os.PathLike) -> ChunkReader:
        """What the bulk channel may know of this server: one blob's file and its gate."""

        async def before_batch(peer: str, idx: list[int]) -> None:
            if self.before_batch is not None:  # looked up per batch: tests set it late
                await self.before_batch(peer, idx)

        def served(chunks: int, nbytes: int) -> None:
            self.served_chunks += chunks
            self.served_bytes += nbytes

        return ChunkReader(blob, path, lambda peer: self.may_serve(peer, blob), before_batch, served)

    def install(self) -> None:
        self.transport.set_stream_handler(PROTOCOL, self.handle)

    async def handle(self, stream: Stream) -> None:
        """Serve requests on one stream until the client closes it."""
        if self.gate is not None and not await self.gate.admit(stream, "blob stream"):
            return
        lease = await lease_or_reset(self.limits, stream, "blob")
        if lease is None:
            return
        with lease:
            try:
                with trio.fail_after(IDLE_TIMEOUT):
                    await self._slots.acquire()
            except trio.TooSlowError:
                await stream.reset()
                return
            try:
                await self._serve(stream)
            finally:
                self._slots.release()

    async def _serve(self, stream: Stream) -> None:
        while True:
            try:
                with trio.fail_after(IDLE_TIMEOUT):
                    req = await read_header(stream)
            except StreamClosed:
                return
            except trio.TooSlowError:
                log.info("blob stream from %s idle for %ss; closed", stream.remote_peer, IDLE_TIMEOUT)
                return
            except FrameError as e:
                log.warning("blob stream from %s closed: %s", stream.remote_peer, e)
                await stream.reset()
                return
            if self.gate is not None and not await self.gate.admit(stream, "blob request"):
                return  # e.g. revoked since the stream was opened
            try:
                await self._one(stream, req)
            except FrameError as e:
                log.warning("blob request from %s rejected, stream reset: %s", stream.remote_peer, e)
                await stream.reset()
                return
            except BlobError as e:  # our store changed under the request (blob deleted, unreadable)
                log.warning("blob request from %s failed, stream reset: %s", stream.remote_peer, e)
                await stream.reset()
                return

    async def _one(self, stream: Stream, req: dict) -> None:
        op, blob = req.get("op"), req.get("blob")
        try:
            blob = check_hash(blob)
        except BlobError as e:
            raise FrameError(str(e)) from None
        held = await trio.to_thread.run_sync(self.store.has, blob)
        if self.may_read is not None and not self.may_read(stream.remote_peer, blob):
            log.info("blob %s refused to %s: not on its reader list", blob[:12], stream.remote_peer)
            if op == "get":
                cs, idx = chunk_request(req)
                for i in idx:
                    await stream.write_frame(pack({"i": i, "error": "not a reader"}))
            else:
                await stream.write_frame(pack({"ok": False, "error": "not a reader"}))
            return
        if op == "manifest":
            if not held:
                await stream.write_frame(pack({"ok": False, "error": "not held"}))
                return
            try:
                m = await trio.to_thread.run_sync(self.store.manifest, blob)
            except BlobError as e:  # e.g. our copy turned out corrupt: say so, keep serving others
                log.warning("cannot serve blob %s: %s", blob[:12], e)
                await stream.write_frame(pack({"ok": False, "error": "unavailable"}))
                return
            await stream.write_frame(pack({"ok": True}))
            await stream.write_frame(m.to_bytes())
        elif op == "get":
            cs, idx = chunk_request(req)
            if self.before_batch is not None:
                await self.before_batch(stream.remote_peer, idx)
            await self._send_chunks(stream, blob, cs, idx, held)
        elif op == "bulk":
            conns, pub = req.get("conns"), req.get("x25519")
            if type(conns) is not int or not 1 <= conns <= MAX_CONNS:
                raise FrameError(f"bad conns {conns!r:.20}")
            if not isinstance(pub, bytes) or len(pub) != 32:
                raise FrameError("bulk request without a 32-byte x25519 key")
            if not (held and self.bulk and stream.remote_host):
                await stream.write_frame(pack({"ok": False, "error": "bulk channel not offered"}))
                return
            reader = self._reader(blob, await trio.to_thread.run_sync(self.store.path, blob))
            bind = _bind_host(self.transport, stream.remote_host)

            async def offer() -> None:
                await serve_bulk(reader, self.bulk_conns, stream, conns, pub, local_peer=self.transport.peer_id,
                                 bind=bind, port=self.bulk_port, idle=IDLE_TIMEOUT)

            if self.bulk_port == 0:
                await offer()
                return
            try:
                self._bulk_port_lock.acquire_nowait()
            except trio.WouldBlock:
                await stream.write_frame(pack({"ok": False, "error": "bulk channel busy"}))
                return
            try:
                await offer()
            finally:
                self._bulk_port_lock.release()
        else:
            raise FrameError(f"unknown op {op!r:.30}")

    async def _send_chunks(self, stream: Stream, blob: str, cs: int, idx: list[int], held: bool) -> None:
        if not held:
            for i in idx:
                await stream.write_frame(pack({"i": i, "error": "not held"}))
            return
        path = await trio.to_thread.run_sync(self.store.path, blob)
        fd = await trio.to_thread.run_sync(os.open, path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size

            def read(batch: list[int]) -> list[bytes | None]:
                return [os.pread(fd, min(cs, size - i * cs), i * cs) if i * cs < size else None for i in batch]

            # chunks are read (in a thread, several per thread hop) ahead of the one being
            # sent: <= 1.5 READ_AHEAD + 2 chunks in memory
            ahead = max(1, READ_AHEAD_BYTES // cs)
            per_hop = max(1, ahead // 2)
            send_ch, recv_ch = trio.open_memory_channel(ahead)

            async def produce() -> None:
                async with send_ch:
                    for at in range(0, len(idx), per_hop):
                        batch = idx[at : at + per_hop]
                        for i, data in zip(batch, await trio.to_thread.run_sync(read, batch)):
                            await send_ch.send((i, data))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                async with recv_ch:
                    async for i, data in recv_ch:
                        await self._send_one(stream, i, data)
        finally:
            os.close(fd)

    async def _send_one(self, stream: Stream, i: int, data: bytes | None) -> None:
        if data is None:
            await stream.write_frame(pack({"i": i, "error": "chunk index out of range"}))
            return
        await stream.write_frames([pack({"i": i, "n": len(data)}), data])  # libp2p: two yamux writes, not three
        self.served_chunks += 1
        self.served_bytes += len(data)


def _bind_host(transport: Transport, remote_host: str) -> str:
    """The IPv4 address the bulk port binds to: the one our libp2p listener uses; with a
    wildcard listener (0.0.0.0), the local address that routes to the client -- never all."""
    for a in transport.addrs():
        parts = a.split("/")
        if len(parts) > 2 and parts[1] == "ip4" and parts[2] != "0.0.0.0":
            return parts[2]
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent
            s.connect((remote_host, 9))
            return s.getsockname()[0]
    except OSError:  # e.g. an IPv6 client: offer loopback only (the client then uses streams)
        return "127.0.0.1"


class BlobService:
    """What the daemon holds: a `BlobServer` for its store plus a `BlobFetcher` into it.

        blobs = BlobService(transport, store)
        blobs.install()                                   # serve /atd/blob/1.0.0
        h = await blobs.fetch(blob, peers, manifest_hash=m)  # FetchError if it cannot
    """

    def __init__(self, transport: Transport, store: BlobStore, *, bulk: bool = True, config: Any = None,
                 gate: MemberGate | None = None, may_read: Callable[[str, str], bool] | None = None,
                 bulk_port: int = 0) -> None:
        self.server = BlobServer(transport, store, bulk=bulk, gate=gate, may_read=may_read, bulk_port=bulk_port)
        self.fetcher = BlobFetcher(transport, store, config or FetchConfig(bulk=bulk))

    def install(self) -> None:
        self.server.install()

    async def fetch(self, blob: str, peers: list[str], *,
                    manifest_hash: str | Collection[str] | None = None) -> str:
        """Fetch `blob` from whichever of `peers` hold it; see `BlobFetcher.fetch`."""
        return await self.fetcher.fetch(blob, peers, manifest_hash=manifest_hash)
