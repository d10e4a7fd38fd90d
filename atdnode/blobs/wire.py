"""Wire helpers shared by the blob server, the fetcher and the bulk channel (see blobxfer.py
for the protocol). Header frames are msgpack maps of at most HEADER_MAX bytes."""
from __future__ import annotations

from typing import Any

import msgpack
import trio

from atdnode.transport import MAX_FRAME, DecodeBudget, FrameError, Stream, TransportError

PROTOCOL = "/atd/blob/1.0.0"
HEADER_MAX = 64 << 10
MAX_BATCH = 256  # chunk indexes per `get` request
MAX_CHUNK = MAX_FRAME - HEADER_MAX  # largest chunk a manifest may use over this protocol
TOKEN_BYTES = 32
GATHER = 4  # stream path: chunks the fetcher's writer gathers per thread hop (`gather`)
GATHER_S = 0.02  # ... waiting at most this long for them


def pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(raw: bytes | bytearray) -> dict:
    """Decode a header frame; FrameError unless it is a msgpack map with string keys."""
    try:
        budget = DecodeBudget(maps=1, lists=1)  # headers are flat maps, `get` carries one index list
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=HEADER_MAX, max_str_len=HEADER_MAX,
                              max_array_len=MAX_BATCH, max_map_len=64, max_ext_len=0,
                              object_hook=budget.map, list_hook=budget.list)
    except Exception as e:
        raise FrameError(f"malformed header frame ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise FrameError("malformed header frame (not a map)")
    return obj


async def read_header(stream: Stream) -> dict:
    return unpack(await stream.read_frame(HEADER_MAX))


def chunk_request(req: dict) -> tuple[int, list[int]]:
    """(chunk_size, indexes) of a `get` request; FrameError if malformed."""
    cs, idx = req.get("chunk_size"), req.get("chunks")
    if type(cs) is not int or not 1 <= cs <= MAX_CHUNK:
        raise FrameError(f"bad chunk_size {cs!r:.20}")
    if not isinstance(idx, list) or not 1 <= len(idx) <= MAX_BATCH or any(type(i) is not int or i < 0 for i in idx):
        raise FrameError("bad chunk list")
    return cs, idx


def check_chunk_header(hdr: dict, i: int, n: int) -> None:
    """Client: the header announcing chunk i must promise exactly n bytes."""
    if hdr.get("i") != i:
        raise FrameError(f"expected chunk {i}, got header {hdr!r:.60}")
    if "error" in hdr:
        raise TransportError(f"does not serve chunk {i}: {hdr['error']!r:.60}")
    if hdr.get("n") != n:
        raise FrameError(f"announced {hdr.get('n')!r:.20} bytes for chunk {i}, expected {n}")


class StreamChunks:
    """Client view of a blob stream: send a request, then receive chunks one by one."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    async def request(self, header: bytes) -> None:
        await self.stream.write_frame(header)

    async def chunk(self, i: int, n: int, buf: bytearray | None = None) -> bytes | bytearray:
        """Chunk i (exactly n bytes); `buf` is ignored (frames arrive as new objects)."""
        check_chunk_header(await read_header(self.stream), i, n)
        read = getattr(self.stream, "read_frame_buffer", self.stream.read_frame)  # FramedStream: one copy less
        data = await read(n)
        if len(data) != n:
            raise FrameError(f"sent {len(data)} bytes for chunk {i}, expected {n}")
        return data

    async def close(self) -> None:
        await self.stream.close()

    async def reset(self) -> None:
        await self.stream.reset()


async def gather(recv: trio.MemoryReceiveChannel, first: Any, want: int) -> list[Any]:
    """`first` plus up to `want` - 1 more items from `recv` within GATHER_S, then whatever
    else is waiting (<= MAX_BATCH in all): the fetcher's writer moves a few chunks per thread
    hop, not one (each hop wakes a thread, then the loop: ~0.2-0.9 ms on 2 busy cores)."""
    items = [first]
    try:
        with trio.move_on_after(GATHER_S):
            while len(items) < want:
                items.append(await recv.receive())
        while len(items) < MAX_BATCH:
            items.append(recv.receive_nowait())
    except (trio.WouldBlock, trio.EndOfChannel):
        pass
    return items
