"""Length-prefixed frames over any byte stream (libp2p stream, in-memory pipe, TCP socket).

Wire format: 4-byte big-endian payload length, then the payload. A libp2p stream's
`read()` returns whatever happens to be buffered, so frames are re-assembled here.

`FramedStream` implements `base.Stream` on top of a minimal `ByteStream` (receive some
bytes / send bytes / close / abort). Each transport only adapts its native stream to
`ByteStream`, so the framing rules -- oversize frames reset the stream, end of stream
mid-frame is a FrameError, clean end of stream at a boundary is StreamClosed -- are the
same code for every transport (and for blobxfer's bulk TCP channel).
"""
from __future__ import annotations

import logging
import struct
from typing import Protocol

from atdnode.transport.base import MAX_FRAME, FrameError, Stream, StreamClosed

log = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
RECV_MAX = 1 << 20  # largest single read from the byte stream
_COALESCE = 64 << 10  # frames up to this size are sent in one write with their header


class ByteStream(Protocol):
    """What a transport must provide under FramedStream. Errors raise TransportError."""

    async def receive_some(self, max_bytes: int) -> bytes:
        """Return 1..max_bytes bytes, or b"" at a clean end of stream. A bytearray returned
        is the caller's own (nothing else refers to it): FramedStream keeps it as its buffer."""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send all of `data`."""

    async def close(self) -> None:
        """Half-close: the peer sees end of stream; never raises."""

    async def abort(self) -> None:
        """Reset in both directions; never raises."""


class Counter:
    """Byte counters shared by the streams of one transport (`bytes_counters()`).

    `sent` / `received` are totals; `by_protocol[name] = [sent, received]` splits them by
    stream protocol ("gossip" for pubsub messages), for the daemon's /metrics;
    `by_peer[peer id] = [sent, received]` the stream bytes per remote peer (the dashboard's
    chart; gossip is fanned out, so it is counted by protocol only).
    """

    __slots__ = ("sent", "received", "by_protocol", "by_peer")

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.by_protocol: dict[str, list[int]] = {}
        self.by_peer: dict[str, list[int]] = {}

    def count(self, protocol: str, *, sent: int = 0, received: int = 0, peer: str | None = None) -> None:
        self.sent += sent
        self.received += received
        row = self.by_protocol.setdefault(protocol or "other", [0, 0])
        row[0] += sent
        row[1] += received
        if peer:
            prow = self.by_peer.setdefault(peer, [0, 0])
            prow[0] += sent
            prow[1] += received

    def as_dict(self) -> dict[str, int]:
        return {"sent": self.sent, "received": self.received}


class FramedStream(Stream):
    """`Stream` over a `ByteStream`. Not safe for concurrent readers (or concurrent writers)."""

    def __init__(
        self,
        raw: ByteStream,
        remote_peer: str,
        *,
        protocol: str = "",
        remote_host: str | None = None,
        counter: Counter | None = None,
    ) -> None:
        self.raw = raw  # exposed for tests that must write malformed bytes
        self.remote_peer = remote_peer
        self.protocol = protocol
        self.remote_host = remote_host
        self._counter = counter or Counter()
        self._buf = bytearray()
        self._closed = False

    async def _fill(self, need: int) -> bool:
        """Buffer at least `need` bytes; False on a clean end of stream before that."""
        while len(self._buf) < need:
            data = await self.raw.receive_some(RECV_MAX)
            if not data:
                return False
            if not self._buf and type(data) is bytearray:
                self._buf = data  # handed over by the byte stream (yamux_tuning): keep it, no copy
            else:
                self._buf += data
        return True

    async def read_frame(self, max_size: int = MAX_FRAME) -> bytes:
        out = await self.read_frame_buffer(max_size)
        return out if type(out) is bytes else bytes(out)

    async def read_frame_buffer(self, max_size: int = MAX_FRAME) -> bytes | bytearray:
        """`read_frame`, but a large payload may come back as the bytearray the byte stream
        handed over (one copy less: the blob fetcher's chunks)."""
        if not await self._fill(HEADER.size):
            if self._buf:
                raise FrameError(f"stream from {self.remote_peer} ended inside a frame header")
            raise StreamClosed(f"stream from {self.remote_peer} closed")
        (n,) = HEADER.unpack_from(self._buf)
        if n > max_size:
            await self.reset()
            raise FrameError(f"frame of {n} bytes from {self.remote_peer} exceeds limit {max_size}")
        del self._buf[: HEADER.size]
        if len(self._buf) >= n and n > _COALESCE and len(self._buf) - n < n:
            out = self._buf  # a large payload already buffered: hand it over, keep the shorter tail
            self._buf = out[n:]
            del out[n:]
        elif len(self._buf) >= n:  # common for small frames: already buffered
            out = bytes(memoryview(self._buf)[:n])
            del self._buf[:n]
        else:
            out = await self._read_large(n)
        self._counter.count(self.protocol, received=HEADER.size + n, peer=self.remote_peer)
        return out

    async def _read_large(self, n: int) -> bytes | bytearray:
        """Assemble an n-byte payload, holding only what has arrived.

        Memory follows what the peer actually sent, never what it announced: a peer that
        announces `max_size` and goes silent costs one header, not `max_size`.
        Pieces are kept as received and joined once (one copy of the payload; none when one
        read brought it all, as a large yamux DATA frame does).
        """
        parts: list[bytes] = [bytes(self._buf)] if self._buf else []
        got = len(self._buf)
        self._buf = bytearray()
        while got < n:
            data = await self.raw.receive_some(min(RECV_MAX, n - got))
            if not data:
                raise FrameError(f"stream from {self.remote_peer} ended inside a {n}-byte frame")
            parts.append(data)  # reads are capped at n - got
            got += len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def write_frame(self, data: bytes) -> None:
        n = len(data)
        if n > 0xFFFFFFFF:
            raise FrameError(f"frame of {n} bytes cannot be encoded")
        if n <= _COALESCE:
            await self.raw.send_all(HEADER.pack(n) + bytes(data))
        else:
            await self.raw.send_all(HEADER.pack(n))
            await self.raw.send_all(data)
        self._counter.count(self.protocol, sent=HEADER.size + n, peer=self.remote_peer)

    async def write_frames(self, frames: list[bytes]) -> None:
        """Frames in order with as few writes as possible: every length header and each small
        frame go out with the next large payload's header; a large payload is sent as is
        (the blob server's chunk header + chunk: two writes, not three)."""
        pending = bytearray()
        for data in frames:
            n = len(data)
            if n > 0xFFFFFFFF:
                raise FrameError(f"frame of {n} bytes cannot be encoded")
            pending += HEADER.pack(n)
            if n <= _COALESCE:
                pending += data
            else:
                await self.raw.send_all(bytes(pending))
                pending.clear()
                await self.raw.send_all(data)
            self._counter.count(self.protocol, sent=HEADER.size + n, peer=self.remote_peer)
        if pending:
            await self.raw.send_all(bytes(pending))

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.raw.close()

    async def reset(self) -> None:
        self._closed = True
        await self.raw.abort()
