"""In-memory byte pipes for `MemoryTransport` streams (one `LinkPipe` per stream end).

Each direction is a bounded buffer (WINDOW bytes, like a TCP/yamux window: a writer waits
while the reader lags) whose items carry a delivery time computed by the simulated link
(serialization at the link's bandwidth + latency). Bytes are reliable and ordered; while
a link is down the writer stalls. `abort` resets both directions, like a stream reset.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import trio

from atdnode.transport.base import TransportError
from atdnode.transport.memory_link import Link

WINDOW = 1 << 20


class _Direction:
    __slots__ = ("items", "buffered", "eof", "reset", "lot")

    def __init__(self) -> None:
        self.items: deque[tuple[float, memoryview]] = deque()
        self.buffered = 0
        self.eof = False
        self.reset = False
        self.lot = trio.lowlevel.ParkingLot()  # readers and writers both wait here


class LinkPipe:
    """One end of an in-memory stream; implements framing.ByteStream."""

    def __init__(self, inbound: _Direction, outbound: _Direction, link: Link) -> None:
        self._in, self._out, self._link = inbound, outbound, link
        self.other: LinkPipe | None = None
        self.on_done: Callable[["LinkPipe"], None] | None = None

    async def receive_some(self, max_bytes: int) -> bytes:
        d = self._in
        while True:
            if d.reset:
                raise TransportError("stream reset")
            if d.items:
                at, data = d.items[0]
                if at > trio.current_time():
                    await trio.sleep_until(at)
                    continue
                if len(data) <= max_bytes:
                    d.items.popleft()
                    out = bytes(data)
                else:
                    out = bytes(data[:max_bytes])
                    d.items[0] = (at, data[max_bytes:])
                d.buffered -= len(out)
                d.lot.unpark_all()
                return out
            if d.eof:
                self._check_done()
                await trio.lowlevel.checkpoint()
                return b""
            await d.lot.park()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        d = self._out
        view = memoryview(bytes(data))
        while True:
            if d.reset:
                raise TransportError("stream reset")
            if d.eof:
                raise TransportError("stream closed for writing")
            if d.buffered < WINDOW:
                break
            await d.lot.park()
        at = await self._link.stream(len(view))
        if d.reset:
            raise TransportError("stream reset")
        d.items.append((at, view))
        d.buffered += len(view)
        d.lot.unpark_all()

    async def close(self) -> None:
        self._out.eof = True
        self._out.lot.unpark_all()
        self._check_done()

    async def abort(self) -> None:
        self.abort_now()

    def abort_now(self) -> None:
        for d in (self._in, self._out):
            d.reset = True
            d.lot.unpark_all()
        self._done()

    def _check_done(self) -> None:
        if self._in.eof and self._out.eof and not self._in.items:
            self._done()

    def _done(self) -> None:
        for end in (self, self.other):
            if end is not None and end.on_done is not None:
                end.on_done(end)
                end.on_done = None


def pipe_pair(a_to_b: Link, b_to_a: Link) -> tuple[LinkPipe, LinkPipe]:
    """Two connected ends: (a's end, b's end)."""
    ab, ba = _Direction(), _Direction()
    a = LinkPipe(inbound=ba, outbound=ab, link=a_to_b)
    b = LinkPipe(inbound=ab, outbound=ba, link=b_to_a)
    a.other, b.other = b, a
    return a, b
