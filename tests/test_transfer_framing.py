"""FramedStream hands a large, already-buffered payload over without copying it:
the frames after it must stay intact and independent of the handed-over buffer."""
from __future__ import annotations

import os

import trio

from atdnode.transport.framing import HEADER, FramedStream


class _Chunks:
    """A ByteStream that returns the given pieces as fresh bytearrays (as yamux_tuning does)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def receive_some(self, max_bytes: int) -> bytearray:
        await trio.lowlevel.checkpoint()
        if not self.pieces:
            return bytearray()
        head = self.pieces[0]
        take, rest = head[:max_bytes], head[max_bytes:]
        self.pieces[0:1] = [rest] if rest else []
        return bytearray(take)

    async def send_all(self, data) -> None: ...
    async def close(self) -> None: ...
    async def abort(self) -> None: ...


def _frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def test_large_buffered_payload_is_handed_over_and_the_rest_kept():
    big, small, big2 = os.urandom(300 << 10), b"header", os.urandom(200 << 10)
    wire = _frame(big) + _frame(small) + _frame(big2) + _frame(b"")

    async def main() -> None:
        for pieces in ([wire], [wire[:7], wire[7:]], [wire[: len(wire) // 2], wire[len(wire) // 2 :]]):
            fs = FramedStream(_Chunks(list(pieces)), "peer")
            first = await fs.read_frame_buffer()
            assert bytes(first) == big
            if len(pieces) == 1:  # all of it buffered at once: the buffer itself, no copy
                assert type(first) is bytearray
            if type(first) is bytearray:
                first[:10] = b"\0" * 10  # the caller owns what it got: later frames are unaffected
            assert await fs.read_frame() == small
            assert bytes(await fs.read_frame_buffer()) == big2
            assert await fs.read_frame() == b""

    trio.run(main)
