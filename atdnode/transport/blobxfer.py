"""The blob protocol `/atd/blob/1.0.0`: serve and fetch content-addressed blobs over streams.

Wire (every frame length-prefixed, see framing.py; headers are msgpack maps <= 64 KiB):

    client -> {"op": "manifest", "blob": hex}
    server <- {"ok": true} + one raw frame: the canonical manifest bytes
              | {"ok": false, "error": str}
    client -> {"op": "get", "blob": hex, "chunk_size": int, "chunks": [i, ...]}   (<= 256)
    server <- per chunk: {"i": i, "n": len} + one raw frame of exactly len bytes
              | {"i": i, "error": str} (and no data frame)
    client -> {"op": "bulk", "blob": hex, "conns": k}
    server <- {"ok": true, "port": p, "token": 32 bytes} | {"ok": false, "error": str}
              ... then {"done": true} once the bulk connections are finished.

Chunks are byte ranges [i*chunk_size, ...) of the blob, so a server needs no manifest of its
own for the client's chunking, and never re-hashes what it serves: the client verifies every
chunk against the manifest it trusts (`PartialBlob.write_chunk`).

Bulk channel. `op: bulk` makes the server listen on a fresh TCP port of its own IP and
hand out a one-time 32-byte token over the Noise-authenticated libp2p stream; the client
opens up to k plain TCP connections to the peer's IP, sends the token as the first frame,
and then speaks the same `get` requests there. Integrity still comes from the manifest
(named by the signed ledger entry): a chunk that does not hash right is rejected exactly
as on a libp2p stream. The token authenticates the connection to the libp2p peer.
Confidentiality is NOT provided on the bulk channel (plain TCP): use `bulk=False` to
keep bytes inside Noise. Weights are meant for every consortium member and shared
features are already sealed per recipient, so the daemon uses the bulk channel by default;
it is ~2-4x faster than py-libp2p streams (bench/transfer_bench.py).

A peer that breaks the protocol (malformed or oversized header, wrong chunk length) has
that one stream reset with a logged reason; nothing else is affected.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
from typing import Any

import msgpack
import trio

from atdnode.blobstore import BlobStore, check_hash
from atdnode.errors import BlobError
from atdnode.transport.base import FrameError, Stream, StreamClosed, Transport, TransportError
from atdnode.transport.framing import FramedStream

log = logging.getLogger(__name__)

PROTOCOL = "/atd/blob/1.0.0"
HEADER_MAX = 64 << 10
MAX_BATCH = 256
IDLE_TIMEOUT = 60.0  # server: a request stream silent this long is closed
BULK_ACCEPT_TIMEOUT = 10.0  # server: how long a bulk token stays usable
TOKEN_BYTES = 32


def pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(raw: bytes) -> dict:
    """Decode a header frame; FrameError unless it is a msgpack map with string keys."""
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=HEADER_MAX)
    except Exception as e:
        raise FrameError(f"malformed header frame ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise FrameError("malformed header frame (not a map)")
    return obj


async def read_header(stream: Stream) -> dict:
    return unpack(await stream.read_frame(HEADER_MAX))


def _chunk_list(req: dict) -> tuple[int, list[int]]:
    cs, idx = req.get("chunk_size"), req.get("chunks")
    if type(cs) is not int or not 1 <= cs <= (8 << 20) - HEADER_MAX:
        raise FrameError(f"bad chunk_size {cs!r:.20}")
    if not isinstance(idx, list) or not 1 <= len(idx) <= MAX_BATCH or any(type(i) is not int or i < 0 for i in idx):
        raise FrameError("bad chunk list")
    return cs, idx


class _TcpBytes:
    """framing.ByteStream over a trio SocketStream (the bulk channel)."""

    def __init__(self, s: trio.SocketStream) -> None:
        self.s = s

    async def receive_some(self, max_bytes: int) -> bytes:
        try:
            return await self.s.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise TransportError(f"bulk connection broke: {e}") from e

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self.s.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise TransportError(f"bulk connection broke: {e}") from e

    async def close(self) -> None:
        # Bulk connections carry one exchange: closing is final (the peer sees EOF) and must
        # release the socket even when cancelled, so the peer never waits for a timeout.
        await self.abort()

    async def abort(self) -> None:
        with trio.CancelScope(shield=True):
            await self.s.aclose()


def _tune(sock: trio.SocketStream) -> None:
    import socket

    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:
            pass


async def open_bulk(host: str, port: int, token: bytes, peer: str) -> FramedStream:
    """Client side: connect to a bulk port and present the token."""
    try:
        with trio.fail_after(BULK_ACCEPT_TIMEOUT):
            s = await trio.open_tcp_stream(host, port)
    except (OSError, trio.TooSlowError) as e:
        raise TransportError(f"bulk connect to {host}:{port} failed: {e}") from e
    _tune(s)
    fs = FramedStream(_TcpBytes(s), peer, protocol=PROTOCOL + "#bulk", remote_host=host)
    await fs.write_frame(token)
    return fs


class BlobServer:
    """Serves blobs held in `store` to peers (the inbound side of `/atd/blob/1.0.0`)."""

    def __init__(self, transport: Transport, store: BlobStore, *, bulk: bool = True, max_streams: int = 32) -> None:
        self.transport, self.store, self.bulk = transport, store, bulk
        self._slots = trio.Semaphore(max_streams)
        self.served_chunks = 0  # chunks sent so far (tests and stats)
        self.served_bytes = 0

    def install(self) -> None:
        self.transport.set_stream_handler(PROTOCOL, self.handle)

    async def handle(self, stream: Stream) -> None:
        """Serve requests on one stream until the client closes it."""
        try:
            with trio.fail_after(IDLE_TIMEOUT):
                await self._slots.acquire()
        except trio.TooSlowError:
            await stream.reset()
            return
        try:
            await self._serve(stream, bulk_allowed=self.bulk)
        finally:
            self._slots.release()

    async def _serve(self, stream: Stream, *, bulk_allowed: bool, only_blob: str | None = None) -> None:
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
            try:
                await self._one(stream, req, bulk_allowed, only_blob)
            except FrameError as e:
                log.warning("blob request from %s rejected, stream reset: %s", stream.remote_peer, e)
                await stream.reset()
                return

    async def _one(self, stream: Stream, req: dict, bulk_allowed: bool, only_blob: str | None) -> None:
        op, blob = req.get("op"), req.get("blob")
        try:
            blob = check_hash(blob)
        except BlobError as e:
            raise FrameError(str(e)) from None
        if only_blob is not None and blob != only_blob:
            raise FrameError("bulk connection used for another blob")
        held = await trio.to_thread.run_sync(self.store.has, blob)
        if op == "manifest":
            if not held:
                await stream.write_frame(pack({"ok": False, "error": "not held"}))
                return
            m = await trio.to_thread.run_sync(self.store.manifest, blob)
            await stream.write_frame(pack({"ok": True}))
            await stream.write_frame(m.to_bytes())
        elif op == "get":
            cs, idx = _chunk_list(req)
            await self._send_chunks(stream, blob, cs, idx, held)
        elif op == "bulk" and only_blob is None:
            conns = req.get("conns")
            if type(conns) is not int or not 1 <= conns <= 16:
                raise FrameError(f"bad conns {conns!r:.20}")
            if not (held and bulk_allowed and stream.remote_host):
                await stream.write_frame(pack({"ok": False, "error": "bulk channel not offered"}))
                return
            await self._bulk(stream, blob, conns)
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

            def read(i: int) -> bytes | None:
                off = i * cs
                return os.pread(fd, min(cs, size - off), off) if off < size else None

            # one chunk is read (in a thread) while the previous one is sent: <= 3 chunks in memory
            send_ch, recv_ch = trio.open_memory_channel(1)

            async def produce() -> None:
                async with send_ch:
                    for i in idx:
                        await send_ch.send((i, await trio.to_thread.run_sync(read, i)))

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
        await stream.write_frame(pack({"i": i, "n": len(data)}))
        await stream.write_frame(data)
        self.served_chunks += 1
        self.served_bytes += len(data)

    async def _bulk(self, stream: Stream, blob: str, conns: int) -> None:
        """Open a one-time TCP port, serve up to `conns` token-bearing connections on it."""
        token = secrets.token_bytes(TOKEN_BYTES)
        bind = _bind_host(self.transport)
        listeners = await trio.open_tcp_listeners(0, host=bind)
        port = listeners[0].socket.getsockname()[1]
        await stream.write_frame(pack({"ok": True, "port": port, "token": token}))
        accepted = 0
        try:
            async with trio.open_nursery() as nursery:
                with trio.move_on_after(BULK_ACCEPT_TIMEOUT):
                    while accepted < conns:
                        sock = await listeners[0].accept()
                        ok = await self._check_token(sock, token, stream.remote_peer)
                        if ok is not None:
                            accepted += 1
                            nursery.start_soon(self._serve_bulk, ok, blob)
                for lst in listeners:  # no more connections; served ones finish in the nursery
                    await lst.aclose()
        finally:
            for lst in listeners:
                await lst.aclose()
        await stream.write_frame(pack({"done": True, "conns": accepted}))

    async def _check_token(self, sock: trio.SocketStream, token: bytes, peer: str) -> FramedStream | None:
        _tune(sock)
        fs = FramedStream(_TcpBytes(sock), peer, protocol=PROTOCOL + "#bulk")
        try:
            with trio.fail_after(BULK_ACCEPT_TIMEOUT):
                got = await fs.read_frame(TOKEN_BYTES)
        except (TransportError, trio.TooSlowError) as e:
            log.warning("bulk connection for %s dropped before its token: %s", peer, e)
            await fs.reset()
            return None
        if not hmac.compare_digest(got, token):
            log.warning("bulk connection with a wrong token (for peer %s) refused", peer)
            await fs.reset()
            return None
        return fs

    async def _serve_bulk(self, fs: FramedStream, blob: str) -> None:
        try:
            await self._serve(fs, bulk_allowed=False, only_blob=blob)
        except TransportError as e:
            log.debug("bulk connection ended: %s", e)
        finally:
            await fs.close()


def _bind_host(transport: Transport) -> str:
    """The IPv4 address our libp2p listener uses (the bulk port binds to the same one)."""
    for a in transport.addrs():
        parts = a.split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            return parts[2]
    return "127.0.0.1"


class BlobService:
    """What the daemon holds: a `BlobServer` for its store plus a `BlobFetcher` into it.

        blobs = BlobService(transport, store)
        blobs.install()                                   # serve /atd/blob/1.0.0
        h = await blobs.fetch(blob, peers, manifest_hash=m)  # FetchError if it cannot
    """

    def __init__(self, transport: Transport, store: BlobStore, *, bulk: bool = True, config: Any = None) -> None:
        from atdnode.transport.blobfetch import BlobFetcher, FetchConfig  # imports this module's wire helpers

        self.server = BlobServer(transport, store, bulk=bulk)
        self.fetcher = BlobFetcher(transport, store, config or FetchConfig(bulk=bulk))

    def install(self) -> None:
        self.server.install()

    async def fetch(self, blob: str, peers: list[str], *, manifest_hash: str | None = None) -> str:
        """Fetch `blob` from whichever of `peers` hold it; see `BlobFetcher.fetch`."""
        return await self.fetcher.fetch(blob, peers, manifest_hash=manifest_hash)
