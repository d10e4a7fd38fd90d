"""yamux_tuning: large DATA frames and a larger window between TunedYamux peers,
and wire compatibility with py-libp2p's stock Yamux either way (real hosts, one process)."""
from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import trio
from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, TYPE_DATA, Yamux

from atdnode.transport._libp2p.yamux import FRAME_MAX, RECV_WINDOW, TunedYamux
from tests.blobnet import cluster
from tests.factories import run, wait_for

MIB = 1 << 20


def muxer_of(stream) -> object:
    """The yamux connection under one of our FramedStreams."""
    return stream.raw.s.muxed_stream.conn


@pytest.mark.parametrize("server,client", [(TunedYamux, Yamux), (Yamux, TunedYamux), (TunedYamux, TunedYamux)],
                         ids=["tuned-serves-stock", "stock-serves-tuned", "tuned-both"])
def test_blob_over_streams_intact_with_stock_and_tuned_yamux(server: type, client: type, tmp_path: Path,
                                                              caplog) -> None:
    """A blob of 1 MiB chunks (each four times stock yamux's 256 KiB window) crosses the
    stream fallback intact whichever side runs py-libp2p's stock yamux, and no side ever
    sends past the window its peer granted (py-libp2p logs "peer exceeded receive window")."""
    data = random.Random(7).randbytes(5 * MIB - 4321)

    async def body() -> None:
        async with cluster("libp2p", 2, tmp_path, bulk=False, muxers=[server, client], chunk=MIB) as (a, b):
            h = a.store.put_bytes(data)
            async def idle(stream) -> None:
                return None

            a.t.set_stream_handler("/test/probe/1", idle)
            probe = await b.t.open_stream(a.t.peer_id, "/test/probe/1")
            assert type(muxer_of(probe)) is client  # the muxer each side asked for is the one in use
            await probe.reset()
            assert await b.svc.fetch(h, [a.t.peer_id], manifest_hash=a.store.manifest(h).hash) == h
            assert b.store.get_bytes(h) == data
            assert b.svc.fetcher.reports[h].modes == {a.t.peer_id: "stream"}

    with caplog.at_level(logging.WARNING):
        run(body, timeout=60)
    assert not [r.getMessage() for r in caplog.records if "exceeded receive window" in r.getMessage()]


def test_tuned_opener_grants_a_large_window_and_receives_large_frames(tmp_path: Path) -> None:
    """Between two TunedYamux hosts the stream's opener (a fetcher) grants RECV_WINDOW at once
    and the acceptor's 3 MiB write leaves in frames of FRAME_MAX (stock py-libp2p: 48 frames
    of < 64 KiB within a 256 KiB window), sealed; the acceptor grants no more than the default."""
    payload = random.Random(3).randbytes(3 * MIB)

    async def body() -> None:
        async with cluster("libp2p", 2, tmp_path) as (a, b):
            sizes: list[int] = []
            wire = bytearray()

            async def source(stream) -> None:
                ys, conn = stream.raw.s.muxed_stream, muxer_of(stream)
                assert isinstance(conn, TunedYamux) and ys.target_recv_window == DEFAULT_WINDOW_SIZE
                # the opener's grant arrived (less the few bytes of protocol negotiation)
                await wait_for(lambda: ys.send_window > RECV_WINDOW - 1024 > DEFAULT_WINDOW_SIZE,
                               "the large window granted", interval=0.005)
                write = conn._write_data

                async def spy(header: bytes, body) -> None:
                    assert header[1] == TYPE_DATA
                    sizes.append(len(body))
                    await write(header, body)

                raw = conn.secured_conn.conn.read_writer.read_write_closer  # the TCP connection
                send = raw.write

                async def tap(data) -> None:
                    wire.extend(data)
                    await send(data)

                conn._write_data, raw.write = spy, tap
                await stream.write_frame(payload)
                conn._write_data, raw.write = write, send

            a.t.set_stream_handler("/test/bulk/1", source)
            s = await b.t.open_stream(a.t.peer_id, "/test/bulk/1")
            with trio.fail_after(20):
                assert await s.read_frame() == payload
            assert max(sizes) == FRAME_MAX and len(sizes) <= 5, sizes
            # every byte crossed sealed: no 32-byte run of the payload is on the wire
            assert len(wire) > len(payload)
            assert not any(payload[k : k + 32] in wire for k in range(0, len(payload), 65521))

    run(body, timeout=60)


def test_tuned_reader_handles_noise_messages_that_straddle_frames(tmp_path: Path) -> None:
    """NoiseRx (one copy per byte) must accept any split of yamux frames into Noise messages:
    here the sender coalesces three DATA frames into one Noise write, so messages end in the
    middle of frames and one message carries the end of a large frame and the start of the
    next. Both large frames arrive intact and the stream goes on working."""
    payload = random.Random(4).randbytes(2 * MIB)

    async def body() -> None:
        async with cluster("libp2p", 2, tmp_path) as (a, b):

            async def source(stream) -> None:
                ys, conn = stream.raw.s.muxed_stream, muxer_of(stream)
                await wait_for(lambda: ys.send_window > RECV_WINDOW - 1024, "the window credit back", interval=0.005)
                pending: list[bytes] = []

                async def coalesce(header: bytes, body) -> None:
                    pending.append(header + bytes(body))
                    if sum(len(p) for p in pending) >= len(payload) + 4 + 3 * 12:
                        async with conn._write_lock:
                            await conn.secured_conn.write(b"".join(pending))
                        pending.clear()

                real = conn._write_data
                conn._write_data = coalesce
                await stream.write_frame(payload)
                conn._write_data = real
                await stream.write_frame(b"after")

            a.t.set_stream_handler("/test/bulk/1", source)
            s = await b.t.open_stream(a.t.peer_id, "/test/bulk/1")
            with trio.fail_after(20):
                assert await s.read_frame() == payload
                assert await s.read_frame() == b"after"

    run(body, timeout=60)
