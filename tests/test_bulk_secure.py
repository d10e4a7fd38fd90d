"""The encrypted bulk channel between two libp2p nodes: capture, tamper, replay, reorder,
squatters, and the fallback to streams.

A TCP proxy on 127.0.0.1 (a thread per direction) sits between the fetcher and the bulk
port: it records what crosses the wire and, per test, alters the server's frames.
"""
from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import trio

from atdnode.blobs import PROTOCOL, BlobStore, pack
from atdnode.blobs import fetch as blobfetch
from atdnode.transport import TransportError
from atdnode.blobs.xfer import _bind_host, read_header
from atdnode.blobs.bulk import BulkConn, PROVE_TIMEOUT, derive_keys, new_ephemeral
from tests.blobnet import CHUNK, blob_bytes, cluster
from tests.factories import run

FrameHook = Callable[[int, bytes], list[bytes]]  # (index of a server frame, frame) -> frames to forward


class Proxy:
    """Forwards one client <-> server TCP connection per accept; records both directions."""

    def __init__(self, target: tuple[str, int], hook: FrameHook | None = None) -> None:
        self.target, self.hook = target, hook
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.captured: list[bytearray] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.lsock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            up, down = bytearray(), bytearray()
            self.captured += [up, down]
            threading.Thread(target=self._pump, args=(client, server, up, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, down, self.hook), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray, hook: FrameHook | None) -> None:
        buf, index = bytearray(), 0
        try:
            while data := src.recv(1 << 16):
                record += data
                if hook is None:
                    dst.sendall(data)
                    continue
                buf += data
                while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
                    n = 4 + struct.unpack(">I", buf[:4])[0]
                    frame, buf = bytes(buf[:n]), buf[n:]
                    for out in hook(index, frame):
                        dst.sendall(out)
                    index += 1
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.lsock.close()


@pytest.fixture
def proxied(monkeypatch):
    """Route every bulk connection of the fetcher through a fresh Proxy (made by `hook`)."""
    proxies: list[Proxy] = []
    state: dict = {"hook": None}
    real_open = BulkConn.open.__func__

    async def via_proxy(cls, host, port, index, keys, peer, timeout=30.0):
        p = Proxy((host, port), state["hook"])
        proxies.append(p)
        return await real_open(cls, "127.0.0.1", p.port, index, keys, peer, timeout)

    monkeypatch.setattr(blobfetch.BulkConn, "open", classmethod(via_proxy))
    yield state, proxies
    for p in proxies:
        p.close()


def _contains_plaintext_run(captured: bytes, plain: bytes, run_len: int = 64) -> bool:
    """Does `captured` contain a `run_len`-byte run of `plain`? (Conservative: True as soon
    as it contains one of plain's blocks of run_len//2 bytes at a multiple of run_len//2,
    which every run of run_len bytes contains.)

    Candidate positions of the capture are found vectorised -- 8 bytes whose low 24 bits
    hit a bitmap of the blocks' first 8 bytes, then an exact 8-byte match -- and each
    candidate is compared in full."""
    half = run_len // 2
    blocks = np.frombuffer(plain[: len(plain) // half * half], dtype=np.uint8).reshape(-1, half)
    keys = np.sort(np.ascontiguousarray(blocks[:, :8]).view(np.uint64).ravel())
    bitmap = np.zeros(1 << 24, dtype=bool)
    bitmap[(keys & np.uint64((1 << 24) - 1)).astype(np.int64)] = True
    block_set = {plain[o:o + half] for o in range(0, len(blocks) * half, half)}
    for k in range(8):  # the 8-byte values at offsets k, k+8, k+16, ... of the capture
        n = (len(captured) - k) // 8
        if n <= 0:
            continue
        vals = np.frombuffer(captured, dtype=np.uint64, count=n, offset=k)
        cand = np.nonzero(bitmap[(vals & np.uint64((1 << 24) - 1)).astype(np.int64)])[0]
        pos = np.minimum(np.searchsorted(keys, vals[cand]), len(keys) - 1)
        exact = cand[keys[pos] == vals[cand]]
        for j in exact:
            at = k + 8 * int(j)
            if captured[at:at + half] in block_set:
                return True
    return False


def test_capture_contains_no_plaintext_run(tmp_path: Path, proxied) -> None:
    _, proxies = proxied
    plain = np.random.default_rng(7).integers(0, 256, 12 << 20, dtype=np.uint8).tobytes()  # 12 MiB

    async def body() -> None:
        async with cluster("libp2p", 2, tmp_path) as (a, b):
            a.store = BlobStore(tmp_path / "big-a", chunk_size=1 << 20)
            a.svc.server.store = a.store
            b.svc.fetcher.store = BlobStore(tmp_path / "big-b", chunk_size=1 << 20)
            h = a.store.put_bytes(plain)
            with trio.fail_after(120):
                assert await b.svc.fetch(h, [a.t.peer_id]) == h
            rep = b.svc.fetcher.reports[h]
            assert rep.modes[a.t.peer_id] == "bulk" and not rep.bulk_failed
            assert b.svc.fetcher.store.path(h).read_bytes() == plain

    run(body)
    wire = b"".join(bytes(c) for p in proxies for c in p.captured)
    assert len(wire) >= len(plain)  # the blob did cross the proxy
    assert _contains_plaintext_run(wire[:1 << 20] + plain[5000:5070], plain)  # the detector itself works
    assert not _contains_plaintext_run(wire, plain)


def _flip(at: int) -> FrameHook:
    def hook(i: int, frame: bytes) -> list[bytes]:
        if i == at:
            frame = frame[:-1] + bytes([frame[-1] ^ 1])
        return [frame]

    return hook


def _replay(at: int) -> FrameHook:
    seen: dict[int, bytes] = {}

    def hook(i: int, frame: bytes) -> list[bytes]:
        seen[i] = frame
        return [frame, seen[at - 2]] if i == at else [frame]

    return hook


def _reorder(at: int) -> FrameHook:
    held: list[bytes] = []

    def hook(i: int, frame: bytes) -> list[bytes]:
        if i == at:
            held.append(frame)
            return []
        if i == at + 1:
            return [frame, held.pop()]
        return [frame]

    return hook


@pytest.mark.parametrize("attack", [_flip, _replay, _reorder], ids=["tampered", "replayed", "reordered"])
def test_altered_bulk_frames_abort_and_fall_back_to_streams(tmp_path: Path, proxied, attack) -> None:
    state, _ = proxied
    state["hook"] = attack(5)
    data = blob_bytes()

    async def body() -> None:
        async with cluster("libp2p", 2, tmp_path) as (a, b):
            h = a.store.put_bytes(data)
            with trio.fail_after(60):
                assert await b.svc.fetch(h, [a.t.peer_id]) == h
            rep = b.svc.fetcher.reports[h]
            peer = a.t.peer_id
            assert "failed authentication" in rep.bulk_failed[peer]
            assert rep.modes[peer] == "stream" and peer in b.svc.fetcher.no_bulk  # marked: no bulk again
            assert not rep.bad_peers  # the data itself never failed its hash: bad frames never got through
            assert b.store.path(h).read_bytes() == data

    run(body)


def test_failed_bulk_connect_falls_back_to_streams(tmp_path: Path, monkeypatch) -> None:
    async def refuse(*args, **kwargs):
        raise TransportError("bulk connect refused (test)")

    monkeypatch.setattr(blobfetch.BulkConn, "open", refuse)

    async def body() -> None:
        async with cluster("libp2p", 2, tmp_path) as (a, b):
            h = a.store.put_bytes(blob_bytes())
            with trio.fail_after(60):
                assert await b.svc.fetch(h, [a.t.peer_id]) == h
            rep = b.svc.fetcher.reports[h]
            assert rep.modes[a.t.peer_id] == "stream" and a.t.peer_id in rep.bulk_failed

    run(body)


def _raw_conn(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(PROVE_TIMEOUT + 10)
    return s


def test_squatters_do_not_block_the_client_and_are_dropped(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster("libp2p", 2, tmp_path) as (a, b):
            h = a.store.put_bytes(blob_bytes())
            s = await b.t.open_stream(a.t.peer_id, PROTOCOL)
            priv, pub = new_ephemeral()
            await s.write_frame(pack({"op": "bulk", "blob": h, "conns": 2, "x25519": pub}))
            offer = await read_header(s)
            keys = derive_keys(priv, offer["x25519"], server_peer=a.t.peer_id, client_peer=b.t.peer_id,
                               server_pub=offer["x25519"], client_pub=pub, conns=2)
            # squatters arrive first: silent ones and one that sends garbage
            squat = [await trio.to_thread.run_sync(_raw_conn, offer["port"]) for _ in range(4)]
            squat[0].sendall(b"\x00\x00\x00\x22" + b"\x00" * 34)  # a hello that does not decrypt
            squat[1].sendall(b"\x00\x00\x00\x00")  # an empty frame
            t0 = trio.current_time()
            conn = await BulkConn.open(s.remote_host, offer["port"], 0, keys[0], a.t.peer_id)
            await conn.request(pack({"op": "get", "blob": h, "chunk_size": CHUNK, "chunks": [0]}))
            with trio.fail_after(PROVE_TIMEOUT):  # served while the squatters still wait
                assert bytes(await conn.chunk(0, CHUNK)) == blob_bytes()[:CHUNK]
            assert trio.current_time() - t0 < PROVE_TIMEOUT
            # the same connection index again (a replayed hello) is refused
            again = await BulkConn.open(s.remote_host, offer["port"], 0, keys[0], a.t.peer_id)
            with pytest.raises(TransportError), trio.fail_after(PROVE_TIMEOUT + 10):
                await again.request(pack({"op": "get", "blob": h, "chunk_size": CHUNK, "chunks": [0]}))
                await again.chunk(0, CHUNK)
            await again.close()
            # squatters are cut off once their time to prove the key is up
            with trio.fail_after(PROVE_TIMEOUT + 10):
                for q in squat:
                    assert await trio.to_thread.run_sync(q.recv, 1) == b""
                    q.close()
            await conn.close()
            await s.close()

    run(body)


def test_bulk_never_binds_the_wildcard_address() -> None:
    class Wildcard:
        def addrs(self) -> list[str]:
            return ["/ip4/0.0.0.0/tcp/4001/p2p/12D3KooWtest"]

    class Specific:
        def addrs(self) -> list[str]:
            return ["/ip4/127.0.0.2/tcp/4001/p2p/12D3KooWtest"]

    assert _bind_host(Wildcard(), "127.0.0.1") == "127.0.0.1"  # type: ignore[arg-type]
    assert _bind_host(Specific(), "127.0.0.1") == "127.0.0.2"  # type: ignore[arg-type]


def test_bulk_can_be_turned_off(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster("libp2p", 2, tmp_path, bulk=False) as (a, b):
            h = a.store.put_bytes(blob_bytes())
            s = await b.t.open_stream(a.t.peer_id, PROTOCOL)
            await s.write_frame(pack({"op": "bulk", "blob": h, "conns": 1, "x25519": new_ephemeral()[1]}))
            with trio.fail_after(10):
                assert (await read_header(s))["ok"] is False
            await s.close()

    run(body)


def test_fixed_bulk_port_serves_one_offer_at_a_time(tmp_path: Path) -> None:
    """With a fixed port, a second concurrent offer is answered 'busy' (the client uses streams)."""

    async def body() -> None:
        async with cluster("libp2p", 2, tmp_path) as (a, b):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            a.svc.server.bulk_port = port
            h = a.store.put_bytes(blob_bytes())
            s1 = await b.t.open_stream(a.t.peer_id, PROTOCOL)
            await s1.write_frame(pack({"op": "bulk", "blob": h, "conns": 1, "x25519": new_ephemeral()[1]}))
            with trio.fail_after(10):
                assert (await read_header(s1))["port"] == port
            s2 = await b.t.open_stream(a.t.peer_id, PROTOCOL)
            await s2.write_frame(pack({"op": "bulk", "blob": h, "conns": 1, "x25519": new_ephemeral()[1]}))
            with trio.fail_after(10):
                assert (await read_header(s2)) == {"ok": False, "error": "bulk channel busy"}
            await s1.close()
            await s2.close()

    run(body)

