"""Bounded resources: slow-loris, oversized-frame and slot-hog attacks, replayed by an admitted peer.

The attacker here is a peer the server talks to (an insider: membership gates do not
help), so these bounds hold whatever admission checks run before the first frame.
Memory is measured with tracemalloc around the attack; the numbers are asserted as bounds.
"""
from __future__ import annotations

import hashlib
import random
import struct
import tracemalloc
from pathlib import Path

import msgpack
import pytest
import trio
import trio.testing

from atdnode.replication import sync
from atdnode.blobs import PROTOCOL as BLOB_PROTOCOL, BlobService, BlobStore, pack
from atdnode.replication import SYNC_PROTOCOL, LedgerAccess, SyncProtocolError, pull, serve_sync
from atdnode.blobs import xfer as blobxfer
from atdnode.transport import FrameError, MemoryNetwork, MemoryTransport, PeerLimits
from atdnode.blobs.fetch import FetchConfig
from atdnode.transport.framing import FramedStream
from ledger import Ledger, Signer
from tests.factories import wait_for

MiB = 1 << 20


def _seed(i: int) -> bytes:
    return hashlib.sha256(f"bounded-{i}".encode()).digest()


class _Silent:
    """A ByteStream that delivers `data` and then blocks forever (a slow-loris sender)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def receive_some(self, max_bytes: int) -> bytes:
        if self.data:
            out, self.data = self.data[:max_bytes], self.data[max_bytes:]
            return out
        await trio.sleep_forever()
        return b""

    async def send_all(self, data) -> None:
        pass

    async def close(self) -> None:
        pass

    async def abort(self) -> None:
        pass


def test_announced_frame_size_is_not_allocated() -> None:
    """A 4-byte header announcing 2 MiB costs what arrived, not 2 MiB (x 255 streams)."""

    async def main() -> int:
        streams = [FramedStream(_Silent(struct.pack(">I", 2 * MiB) + b"x" * 10), f"p{i}") for i in range(255)]
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        async with trio.open_nursery() as nursery:
            for s in streams:
                nursery.start_soon(s.read_frame, 4 * MiB)
            await trio.testing.wait_all_tasks_blocked()  # every reader took what arrived and waits for more
            grown = tracemalloc.get_traced_memory()[0] - base
            nursery.cancel_scope.cancel()
        tracemalloc.stop()
        return grown

    grown = trio.run(main)
    # before the fix: 255 x 2 MiB = 510 MiB preallocated
    assert grown < 8 * MiB, f"255 silent 2 MiB announcements allocated {grown / MiB:.1f} MiB"


def test_oversized_announcement_rejected_before_reading() -> None:
    async def main() -> None:
        s = FramedStream(_Silent(struct.pack(">I", 64 * MiB)), "p")
        with pytest.raises(FrameError, match="exceeds limit"):
            await s.read_frame(2 * MiB)

    trio.run(main)


@pytest.mark.parametrize("payload", [
    msgpack.packb([{}] * 500_000),                                        # an array of empty maps
    msgpack.packb({"t": "heads", "heads": {bytes(32) + i.to_bytes(4, "big"): {} for i in range(50_000)}}),
    msgpack.packb({"t": "entries", "e": [[]] * 500_000}),                 # an array of empty arrays
    b"\x91" * (2 * MiB - 1) + b"\x80",                                    # 2 MiB of nested one-element arrays
], ids=["empty-maps", "heads-of-maps", "empty-arrays", "nested-arrays"])
def test_sync_frame_decoded_size_is_bounded(payload: bytes) -> None:
    """A <= 2 MiB sync frame of empty containers decoded to ~145 MiB before; now it is refused cheaply."""
    assert len(payload) <= sync.MAX_SYNC_FRAME
    tracemalloc.start()
    try:
        with pytest.raises(SyncProtocolError):
            sync._decode(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MiB, f"decoding a {len(payload)}-byte frame peaked at {peak / MiB:.1f} MiB"


def test_sync_decode_accepts_real_messages() -> None:
    heads = {bytes([i]) * 32: i for i in range(1, 200)}
    assert sync._decode(msgpack.packb({"t": "heads", "heads": heads}))["heads"] == heads
    entries = [b"e" * 100] * 5000
    assert sync._decode(msgpack.packb({"t": "entries", "e": entries}))["e"] == entries


def _ledger(path: Path, n: int = 20) -> Ledger:
    signer = Signer.from_seed(_seed(99))
    led = Ledger.open(path)
    led.create_genesis(signer, "bounded")
    for i in range(n):
        led.append(signer, "metrics", {"i": i})
    return led


def test_silent_sync_streams_are_capped_per_peer_and_time_out(tmp_path: Path, monkeypatch) -> None:
    """255 sync streams from one peer announcing 2 MiB and going silent: at most PER_PEER_STREAMS
    are held, each for at most IDLE_TIMEOUT, and a second peer still syncs meanwhile."""
    monkeypatch.setattr(sync, "IDLE_TIMEOUT", 1.0)
    net = MemoryNetwork(seed=3)
    victim, attacker, honest = (MemoryTransport(net, _seed(i)) for i in range(3))
    access = LedgerAccess(_ledger(tmp_path / "v.db"))
    limits = PeerLimits(per_peer=sync.PER_PEER_STREAMS, total=sync.TOTAL_STREAMS)
    victim.set_stream_handler(SYNC_PROTOCOL, lambda s: serve_sync(s, access, limits))
    honest_led = LedgerAccess(Ledger.open(tmp_path / "h.db"))
    held_max = 0

    async def main() -> None:
        nonlocal held_max
        async with victim.run([]), attacker.run([]), honest.run([]):
            await attacker.connect(victim.addrs()[0])
            await honest.connect(victim.addrs()[0])
            streams = []
            for _ in range(255):
                s = await attacker.open_stream(victim.peer_id, SYNC_PROTOCOL)
                await s.raw.send_all(struct.pack(">I", 2 * MiB - 1) + b"\x82")
                streams.append(s)
            await wait_for(lambda: limits.refused >= 255 - sync.PER_PEER_STREAMS, "the victim to answer every stream")
            await trio.testing.wait_all_tasks_blocked()
            held_max = limits.live(attacker.peer_id)
            # an honest member is served meanwhile
            with trio.fail_after(10):
                res = await pull(await honest.open_stream(victim.peer_id, SYNC_PROTOCOL), honest_led)
            assert res.added == 21
            with trio.fail_after(10):  # the silent streams are reset after the idle timeout
                while limits.live():
                    await trio.sleep(0.05)
            for s in streams:
                await s.reset()

    trio.run(main)
    assert 1 <= held_max <= sync.PER_PEER_STREAMS
    assert limits.refused >= 255 - sync.PER_PEER_STREAMS


CHUNK = 64 << 10


def test_blob_slot_hog_cannot_starve_others(tmp_path: Path) -> None:
    """32 idle blob streams from one member (each re-asking for a manifest now and then) hold
    at most PER_PEER_STREAMS slots; another member's fetch still succeeds at once."""
    net = MemoryNetwork(seed=4)
    ts = [MemoryTransport(net, _seed(10 + i)) for i in range(3)]
    stores = [BlobStore(tmp_path / f"s{i}", chunk_size=CHUNK) for i in range(3)]
    svcs = [BlobService(t, st, bulk=False, config=FetchConfig(bulk=False, stall_timeout=10)) for t, st in zip(ts, stores)]
    for s in svcs:
        s.install()
    data = random.Random(1).randbytes(10 * CHUNK)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    blob = stores[0].put_file(src)
    server, hog, member = ts
    refused_before = svcs[0].server.limits.refused

    async def main() -> None:
        async with server.run([]), hog.run([]), member.run([]):
            await hog.connect(server.addrs()[0])
            await member.connect(server.addrs()[0])
            hogged = []
            for _ in range(32):
                s = await hog.open_stream(server.peer_id, BLOB_PROTOCOL)
                await s.write_frame(pack({"op": "manifest", "blob": blob}))
                hogged.append(s)
            await wait_for(lambda: svcs[0].server.limits.refused - refused_before >= 32 - blobxfer.PER_PEER_STREAMS,
                           "the server to answer every hog stream")
            assert svcs[0].server.limits.live(hog.peer_id) <= blobxfer.PER_PEER_STREAMS
            with trio.fail_after(15):
                got = await svcs[2].fetch(blob, [server.peer_id])
            assert got == blob
            for s in hogged:
                await s.reset()

    trio.run(main)
    assert stores[2].has(blob)
    assert svcs[0].server.limits.refused - refused_before >= 32 - blobxfer.PER_PEER_STREAMS


def test_peer_limits_fair_share() -> None:
    lim = PeerLimits(per_peer=2, total=3)
    a1, a2 = lim.try_acquire("a"), lim.try_acquire("a")
    assert a1 and a2 and lim.try_acquire("a") is None
    b1 = lim.try_acquire("b")
    assert b1 is not None and lim.try_acquire("c") is None  # total reached
    a1.release()
    a1.release()  # idempotent
    assert lim.live("a") == 1 and lim.try_acquire("c") is not None


def test_split_server_caps_streams_per_peer(tmp_path: Path) -> None:
    """12 split streams from one member each announcing a 64 MiB first frame (1.61 GB before):
    at most SPLIT_STREAMS_PER_PEER are held, and what they hold is what was actually sent."""
    from atdnode.node import NodeHome
    from atdnode.split import SPLIT_PROTOCOL
    from atdnode.split.service import SPLIT_STREAMS_PER_PEER, SplitService

    svc = SplitService(NodeHome.at(tmp_path), "pfesta")
    net = MemoryNetwork(seed=9)
    server, attacker = MemoryTransport(net, _seed(20)), MemoryTransport(net, _seed(21))
    server.set_stream_handler(SPLIT_PROTOCOL, svc._handle_limited)

    async def main() -> int:
        async with server.run([]), attacker.run([]):
            await attacker.connect(server.addrs()[0])
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            streams = []
            for _ in range(12):
                s = await attacker.open_stream(server.peer_id, SPLIT_PROTOCOL)
                await s.raw.send_all(struct.pack(">I", 64 * MiB) + b"x" * 100)
                streams.append(s)
            await wait_for(lambda: svc._stream_limits.refused >= 12 - SPLIT_STREAMS_PER_PEER, "every stream answered")
            await trio.testing.wait_all_tasks_blocked()  # the held streams read what was sent
            grown = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            assert svc._stream_limits.live(attacker.peer_id) <= SPLIT_STREAMS_PER_PEER
            for s in streams:
                await s.reset()
            return grown

    grown = trio.run(main)
    assert svc._stream_limits.refused >= 12 - SPLIT_STREAMS_PER_PEER
    assert grown < 8 * MiB, f"{grown / MiB:.1f} MiB"


@pytest.mark.parametrize("decode", ["blob-header", "manifest"])
def test_blob_header_and_manifest_decoding_is_bounded(decode: str) -> None:
    from atdnode.blobs.store import BlobError, Manifest
    from atdnode.blobs.wire import HEADER_MAX, unpack

    if decode == "blob-header":
        payload, fn, err = msgpack.packb([{}] * (HEADER_MAX - 8)), unpack, FrameError
    else:  # a manifest frame may be 8 MiB
        payload, fn, err = msgpack.packb({"v": [{}] * (8 * MiB - 16)}), Manifest.from_bytes, BlobError
    tracemalloc.start()
    try:
        with pytest.raises(err):
            fn(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MiB, f"{decode}: peaked at {peak / MiB:.1f} MiB"
