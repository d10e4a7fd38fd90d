"""The blob bulk channel: plain TCP, negotiated over an authenticated libp2p blob stream.

The server opens a one-time port on its own IP and sends `{port, token}` over the Noise
stream; the client connects (up to `conns` times), sends the 32-byte token as its first
frame, then sends `get` requests exactly as on a blob stream (same frames, see
blobwire.py). Only `get` for the negotiated blob is served.

Why threads: py-libp2p streams (and even trio sockets, at ~64 KiB per wakeup) cost far
more CPU per byte than the bytes themselves. Here each connection's socket is a blocking
socket driven from worker threads (`trio.to_thread`, one call per chunk or batch): the
client receives a whole chunk into one preallocated buffer per call, the server sends
with `socket.sendfile` straight from the blob file. The trio loop never blocks; a
cancelled call is abandoned and its socket shut down, which ends the thread's I/O.

Security: the token authenticates the TCP connection to the libp2p peer that asked for
it; integrity comes from the manifest (every chunk is hash-checked by the client). The
bytes are NOT encrypted on this channel (see blobxfer.py).
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
from typing import TYPE_CHECKING, Any, Callable

import trio

from atdnode.transport.base import FrameError, Stream, StreamClosed, TransportError
from atdnode.transport.blobwire import HEADER_MAX, TOKEN_BYTES, check_chunk_header, chunk_request, pack, unpack
from atdnode.transport.framing import Counter

if TYPE_CHECKING:
    from atdnode.transport.blobxfer import BlobServer

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
BULK_BYTES = Counter()  # every bulk connection of this process, for the daemon's /metrics (protocol "bulk")
ACCEPT_TIMEOUT = 10.0  # server: how long a token stays usable
SOCK_BUF = 4 << 20


async def _run(fn: Callable[..., Any], *args: Any) -> Any:
    """Run blocking socket work in a thread; on cancellation the caller closes the socket."""
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


class BlockingFrames:
    """Length-prefixed frames (framing.py's format) on a blocking socket. Thread-side only."""

    def __init__(self, sock: socket.socket, peer: str, timeout: float) -> None:
        self.sock, self.peer = sock, peer
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
            except OSError:
                pass

    def _exact(self, view: memoryview) -> int:
        got = 0
        try:
            while got < len(view):
                r = self.sock.recv_into(view[got:])
                if not r:
                    break
                got += r
        except socket.timeout as e:
            raise TransportError(f"bulk connection with {self.peer} stalled") from e
        except OSError as e:
            raise TransportError(f"bulk connection with {self.peer} broke: {e}") from e
        BULK_BYTES.count("bulk", received=got)
        return got

    def read_frame(self, max_size: int, into: bytearray | None = None) -> bytearray | memoryview:
        """The next frame: a new bytearray, or a view of `into` (reused, len(into) >= max_size)."""
        head = bytearray(_LEN.size)
        got = self._exact(memoryview(head))
        if got == 0:
            raise StreamClosed(f"bulk connection from {self.peer} closed")
        if got < _LEN.size:
            raise FrameError(f"bulk connection from {self.peer} ended inside a frame header")
        (n,) = _LEN.unpack(head)
        if n > max_size:
            raise FrameError(f"frame of {n} bytes from {self.peer} exceeds limit {max_size}")
        out = memoryview(into)[:n] if into is not None else memoryview(bytearray(n))
        if self._exact(out) < n:
            raise FrameError(f"bulk connection from {self.peer} ended inside a {n}-byte frame")
        return out if into is not None else out.obj

    def write_frame(self, data: bytes) -> None:
        self._send(_LEN.pack(len(data)) + data)

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
            BULK_BYTES.count("bulk", sent=len(data))
        except socket.timeout as e:
            raise TransportError(f"bulk connection with {self.peer} stalled") from e
        except OSError as e:
            raise TransportError(f"bulk connection with {self.peer} broke: {e}") from e

    def send_file_range(self, f: Any, off: int, n: int) -> None:
        """One data frame straight from a file (zero-copy sendfile)."""
        self._send(_LEN.pack(n))
        try:
            if self.sock.sendfile(f, off, n) != n:
                raise TransportError(f"blob file shrank while sending to {self.peer}")
            BULK_BYTES.count("bulk", sent=n)
        except socket.timeout as e:
            raise TransportError(f"bulk connection with {self.peer} stalled") from e
        except OSError as e:
            raise TransportError(f"bulk connection with {self.peer} broke: {e}") from e

    def close(self) -> None:
        """Shut down and close; safe from any thread, idempotent; wakes a blocked reader."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# -- client ----------------------------------------------------------------------------------


class BulkConn:
    """Client end of one bulk connection; same `request` / `chunk` calls as StreamChunks."""

    def __init__(self, frames: BlockingFrames) -> None:
        self.f = frames

    @classmethod
    async def open(cls, host: str, port: int, token: bytes, peer: str, timeout: float = 30.0) -> "BulkConn":
        def connect() -> BlockingFrames:
            try:
                s = socket.create_connection((host, port), timeout=min(timeout, ACCEPT_TIMEOUT))
            except OSError as e:
                raise TransportError(f"bulk connect to {host}:{port} failed: {e}") from e
            f = BlockingFrames(s, peer, timeout)
            f.write_frame(token)
            return f

        return cls(await _run(connect))

    async def request(self, header: bytes) -> None:
        await self._call(self.f.write_frame, header)

    async def chunk(self, i: int, n: int, buf: bytearray | None = None) -> bytearray | memoryview:
        """Chunk i (exactly n bytes), received into `buf` when given (no allocation per chunk)."""

        def recv() -> bytearray | memoryview:
            check_chunk_header(unpack(self.f.read_frame(HEADER_MAX)), i, n)
            return self.f.read_frame(n, buf)  # longer than n: FrameError; shorter: checked below

        data = await self._call(recv)
        if len(data) != n:
            raise FrameError(f"sent {len(data)} bytes for chunk {i}, expected {n}")
        return data

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await _run(fn, *args)
        except BaseException:
            self.f.close()  # a cancelled (abandoned) thread must not keep using the socket
            raise

    async def close(self) -> None:
        self.f.close()
        await trio.lowlevel.checkpoint()

    async def reset(self) -> None:
        await self.close()


# -- server ----------------------------------------------------------------------------------


async def serve_bulk(server: "BlobServer", control: Stream, blob: str, conns: int, bind: str, idle: float) -> None:
    """Offer a one-time port on `control`, serve up to `conns` token-bearing connections."""
    token = secrets.token_bytes(TOKEN_BYTES)
    lsock = socket.create_server((bind, 0))
    accepted = 0
    try:
        await control.write_frame(pack({"ok": True, "port": lsock.getsockname()[1], "token": token}))
        async with trio.open_nursery() as nursery:
            deadline = trio.current_time() + ACCEPT_TIMEOUT
            while accepted < conns and (left := deadline - trio.current_time()) > 0:
                try:
                    frames = await _run(_accept, lsock, token, control.remote_peer, left, idle)
                except TimeoutError:
                    break
                if frames is not None:
                    accepted += 1
                    nursery.start_soon(_serve_conn, server, frames, blob)
            lsock.close()  # no more connections; accepted ones finish in the nursery
    finally:
        lsock.close()
    await control.write_frame(pack({"done": True, "conns": accepted}))


def _accept(lsock: socket.socket, token: bytes, peer: str, left: float, idle: float) -> BlockingFrames | None:
    lsock.settimeout(left)
    sock, _ = lsock.accept()  # TimeoutError when the token expires
    frames = BlockingFrames(sock, peer, min(left, ACCEPT_TIMEOUT))
    try:
        got = frames.read_frame(TOKEN_BYTES)
    except TransportError as e:
        log.warning("bulk connection for %s dropped before its token: %s", peer, e)
        frames.close()
        return None
    if not hmac.compare_digest(bytes(got), token):
        log.warning("bulk connection with a wrong token (offered to %s) refused", peer)
        frames.close()
        return None
    frames.sock.settimeout(idle)
    return frames


async def _serve_conn(server: "BlobServer", frames: BlockingFrames, blob: str) -> None:
    try:
        path = await trio.to_thread.run_sync(server.store.path, blob)
        while True:
            try:
                raw = await _run(frames.read_frame, HEADER_MAX)
            except StreamClosed:
                return
            req = unpack(raw)
            if req.get("op") != "get" or req.get("blob") != blob:
                raise FrameError(f"bulk connection may only get blob {blob[:12]}")
            cs, idx = chunk_request(req)
            if server.before_batch is not None:
                await server.before_batch(frames.peer, idx)
            n, nbytes = await _run(_send_ranges, frames, path, cs, idx)
            server.served_chunks += n
            server.served_bytes += nbytes
    except FrameError as e:
        log.warning("bulk connection from %s closed: %s", frames.peer, e)
    except TransportError as e:
        log.debug("bulk connection from %s ended: %s", frames.peer, e)
    finally:
        frames.close()


def _send_ranges(frames: BlockingFrames, path: os.PathLike, cs: int, idx: list[int]) -> tuple[int, int]:
    sent = nbytes = 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for i in idx:
            off = i * cs
            if off >= size:
                frames.write_frame(pack({"i": i, "error": "chunk index out of range"}))
                continue
            n = min(cs, size - off)
            frames.write_frame(pack({"i": i, "n": n}))
            frames.send_file_range(f, off, n)
            sent, nbytes = sent + 1, nbytes + n
    return sent, nbytes
