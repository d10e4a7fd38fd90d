"""Blob protocol on both transports: fetch, resume, bad-chunk peer, multi-holder, bad frames.

libp2p runs use the bulk TCP channel by default (one test also forces plain streams);
the in-memory transport always uses streams. Every wait has a deadline.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import trio

from atdnode.blobs import PROTOCOL, BlobStore, FetchError, pack
from atdnode.transport import TransportError
from atdnode.blobs.fetch import FetchConfig
from atdnode.blobs.xfer import BulkConn, read_header
from atdnode.blobs.bulk import derive_keys, new_ephemeral
from tests.blobnet import CHUNK, NCHUNKS, blob_bytes, cluster
from tests.factories import KINDS, run, wait_for


def corrupt(store: BlobStore, h: str, chunks: list[int]) -> None:
    """Flip one byte in each listed chunk of a held blob (its cached manifest stays right)."""
    store.manifest(h)  # computed while the bytes are still good
    p = store.path(h)
    p.chmod(0o600)
    raw = bytearray(p.read_bytes())
    for i in chunks:
        raw[i * CHUNK + 7] ^= 0xFF
    p.write_bytes(bytes(raw))


@pytest.mark.parametrize("kind", KINDS)
def test_fetch_one_holder(kind: str, tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(kind, 2, tmp_path) as (a, b):
            data = blob_bytes()
            h = a.store.put_bytes(data)
            m = a.store.manifest(h)
            assert await b.svc.fetch(h, [a.t.peer_id], manifest_hash=m.hash) == h
            assert b.store.get_bytes(h) == data
            rep = b.svc.fetcher.reports[h]
            assert rep.chunks_from[a.t.peer_id] == NCHUNKS and rep.bytes == len(data)
            assert rep.modes[a.t.peer_id] == ("bulk" if kind == "libp2p" else "stream")
            assert a.svc.server.served_chunks == NCHUNKS
            # already held: no traffic; unknown blob: clear error
            assert await b.svc.fetch(h, [a.t.peer_id]) == h
            with pytest.raises(FetchError, match="no peer holds"):
                await b.svc.fetch("ab" * 32, [a.t.peer_id])
            with pytest.raises(FetchError, match="offers manifest"):
                await b.svc.fetch(a.store.put_bytes(b"other"), [a.t.peer_id], manifest_hash="00" * 32)

    run(body)


def test_libp2p_plain_streams_when_bulk_disabled(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster("libp2p", 2, tmp_path, bulk=False) as (a, b):
            h = a.store.put_bytes(blob_bytes())
            assert await b.svc.fetch(h, [a.t.peer_id]) == h
            assert b.svc.fetcher.reports[h].modes == {a.t.peer_id: "stream"}

    run(body)


@pytest.mark.parametrize("kind", KINDS)
def test_resume_after_holder_dies(kind: str, tmp_path: Path) -> None:
    """The only holder dies mid-fetch: FetchError, chunks so far kept; after a 'restart' of
    the fetching store, a second holder supplies only the missing chunks."""

    async def body() -> None:
        cfg = FetchConfig(batch_bytes=CHUNK, per_peer=1, flush_bytes=CHUNK)
        async with cluster(kind, 3, tmp_path, cfg=cfg) as (a, b, c):
            data = blob_bytes()
            h = a.store.put_bytes(data)
            c.store.put_bytes(data)
            m = a.store.manifest(h)
            result: list[BaseException] = []
            stuck = trio.Event()

            async def stall_after_six(peer: str, idx: list[int]) -> None:  # the holder hangs, then dies
                if a.svc.server.served_chunks >= 6:
                    await stuck.wait()  # never set

            a.svc.server.before_batch = stall_after_six

            async def fetch() -> None:
                try:
                    await b.svc.fetch(h, [a.t.peer_id], manifest_hash=m.hash)
                except FetchError as e:
                    result.append(e)

            async with trio.open_nursery() as n:
                n.start_soon(fetch)
                await wait_for(lambda: h in b.svc.fetcher.reports and b.svc.fetcher.reports[h].bytes >= 4 * CHUNK,
                               "4 chunks fetched", interval=0.005)
                a.stop.set()  # the holder goes away mid-transfer
            assert result and isinstance(result[0], FetchError)
            got = b.svc.fetcher.reports[h].chunks_from[a.t.peer_id]
            assert 4 <= got <= 6
            # "restart": a fresh store object on the same directory resumes from disk
            b.svc.fetcher.store = b.store = BlobStore(b.store.root, chunk_size=CHUNK)
            assert len(b.store.partial(m).missing()) == NCHUNKS - got
            await b.t.connect(c.t.addrs()[0])
            assert await b.svc.fetch(h, [c.t.peer_id], manifest_hash=m.hash) == h
            rep = b.svc.fetcher.reports[h]
            assert rep.resumed_chunks == got
            assert c.svc.server.served_chunks == NCHUNKS - got
            assert b.store.get_bytes(h) == data

    run(body)


@pytest.mark.parametrize("kind", KINDS)
def test_holder_dies_mid_fetch_other_holder_finishes(kind: str, tmp_path: Path) -> None:
    """Holder a hangs on its first batch and is then killed: its chunk goes back to the
    queue and holder c, which has served everything else, serves it too."""

    async def body() -> None:
        cfg = FetchConfig(batch_bytes=CHUNK, per_peer=1)
        async with cluster(kind, 3, tmp_path, cfg=cfg) as (a, b, c):
            data = blob_bytes()
            h = a.store.put_bytes(data)
            c.store.put_bytes(data)
            await b.t.connect(c.t.addrs()[0])
            hang = trio.Event()

            async def hang_forever(peer: str, idx: list[int]) -> None:
                await hang.wait()  # never set

            a.svc.server.before_batch = hang_forever
            async with trio.open_nursery() as n:
                n.start_soon(b.svc.fetch, h, [a.t.peer_id, c.t.peer_id])
                await wait_for(lambda: c.svc.server.served_chunks == NCHUNKS - 1, "all but one chunk served", interval=0.005)
                a.stop.set()  # "kill" a while b waits for its chunk
            rep = b.svc.fetcher.reports[h]
            assert rep.chunks_from == {c.t.peer_id: NCHUNKS}
            assert a.t.peer_id in rep.failed_peers
            assert b.store.get_bytes(h) == data

    run(body)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_chunk_peer_detected_and_chunk_refetched(kind: str, tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(kind, 3, tmp_path) as (a, b, c):
            data = blob_bytes()
            h = a.store.put_bytes(data)
            c.store.put_bytes(data)
            m = a.store.manifest(h)
            corrupt(a.store, h, list(range(NCHUNKS)))  # a now serves wrong bytes for every chunk
            await b.t.connect(c.t.addrs()[0])
            # only the bad peer: every chunk it sends is rejected, nothing is written
            with pytest.raises(FetchError, match="still missing"):
                await b.svc.fetch(h, [a.t.peer_id], manifest_hash=m.hash)
            rep = b.svc.fetcher.reports[h]
            assert a.t.peer_id in rep.bad_peers and "does not match" in rep.bad_peers[a.t.peer_id]
            assert rep.bytes == 0 and len(b.store.partial(m).missing()) == NCHUNKS
            # bad + good peer: the good one supplies everything, including re-fetched chunks
            assert await b.svc.fetch(h, [a.t.peer_id, c.t.peer_id], manifest_hash=m.hash) == h
            rep = b.svc.fetcher.reports[h]
            assert rep.chunks_from[a.t.peer_id] == 0 and rep.chunks_from[c.t.peer_id] == NCHUNKS
            assert b.store.get_bytes(h) == data

    run(body)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_chunks_past_the_first_are_caught_by_the_whole_blob_hash(kind: str, tmp_path: Path) -> None:
    """Chunks are hashed once (the whole-blob hash): a holder whose first chunk is right but
    some later ones are not gets through the transfer, then the whole-blob check finds
    exactly those chunks, marks the holder bad, stores nothing, and a good holder supplies
    only them."""
    bad_chunks = [5, 9, NCHUNKS - 1]

    async def body() -> None:
        cfg = FetchConfig(batch_bytes=4 * CHUNK, per_peer=1)
        async with cluster(kind, 3, tmp_path, cfg=cfg) as (a, b, c):
            data = blob_bytes()
            h = a.store.put_bytes(data)
            c.store.put_bytes(data)
            m = a.store.manifest(h)
            corrupt(a.store, h, bad_chunks)  # chunk 0, the first of a's connection, stays right
            await b.t.connect(c.t.addrs()[0])
            with pytest.raises(FetchError, match="still missing"):
                await b.svc.fetch(h, [a.t.peer_id], manifest_hash=m.hash)
            rep = b.svc.fetcher.reports[h]
            assert "found by the whole-blob hash" in rep.bad_peers[a.t.peer_id]
            assert rep.chunks_from[a.t.peer_id] == NCHUNKS - len(bad_chunks)  # bad ones not credited
            assert not b.store.has(h) and b.store.partial(m).missing() == bad_chunks
            assert await b.svc.fetch(h, [c.t.peer_id], manifest_hash=m.hash) == h
            assert b.svc.fetcher.reports[h].chunks_from == {c.t.peer_id: len(bad_chunks)}
            assert b.store.get_bytes(h) == data
            # both at once, into a fresh store: the same fetch re-fetches a's bad chunks from c
            corrupt(a.store, h, [i for i in range(NCHUNKS) if i % 4])  # every batch's first chunk is right

            async def after_a_served(peer: str, idx: list[int]) -> None:
                await wait_for(lambda: a.svc.server.served_chunks > 0, "a served a chunk")  # a surely sends some of them

            c.svc.server.before_batch = after_a_served
            b.svc.fetcher.store = fresh = BlobStore(tmp_path / "fresh", chunk_size=CHUNK)
            assert await b.svc.fetch(h, [a.t.peer_id, c.t.peer_id], manifest_hash=m.hash) == h
            rep = b.svc.fetcher.reports[h]
            assert "found by the whole-blob hash" in rep.bad_peers[a.t.peer_id]
            assert sum(rep.chunks_from.values()) == NCHUNKS and rep.chunks_from[c.t.peer_id] < NCHUNKS
            assert fresh.get_bytes(h) == data

    run(body)


@pytest.mark.parametrize("kind", KINDS)
def test_multi_holder_parallel(kind: str, tmp_path: Path) -> None:
    async def body() -> None:
        cfg = FetchConfig(batch_bytes=CHUNK, per_peer=2, max_streams=6)
        async with cluster(kind, 4, tmp_path, cfg=cfg) as nodes:
            data = blob_bytes()
            holders = nodes[1:]
            for n in holders:
                h = n.store.put_bytes(data)
            fetcher = nodes[0]
            assert await fetcher.svc.fetch(h, [n.t.peer_id for n in holders]) == h
            rep = fetcher.svc.fetcher.reports[h]
            assert sum(rep.chunks_from.values()) == NCHUNKS
            assert set(rep.chunks_from) == {n.t.peer_id for n in holders}  # work was spread
            assert fetcher.store.get_bytes(h) == data

    run(body)


@pytest.mark.parametrize("kind", KINDS)
def test_malformed_and_oversized_requests_reset_only_that_stream(kind: str, tmp_path: Path, caplog) -> None:
    async def body() -> None:
        async with cluster(kind, 2, tmp_path) as (a, b):
            h = a.store.put_bytes(blob_bytes())
            bad_requests = [
                b"\xc1 not msgpack",
                pack({"op": "get", "blob": h, "chunk_size": CHUNK, "chunks": ["x"]}),
                pack({"op": "get", "blob": h, "chunk_size": 1 << 30, "chunks": [0]}),
                pack({"op": "teleport", "blob": h}),
                pack({"op": "manifest", "blob": "not-a-hash"}),
                b"\x00" * (70 << 10),  # over the 64 KiB header limit
            ]
            for req in bad_requests:
                s = await b.t.open_stream(a.t.peer_id, PROTOCOL)
                with pytest.raises(TransportError), trio.fail_after(10):
                    # the reset may already reach us during a long write (the 70 KiB frame)
                    await s.write_frame(req)
                    await s.read_frame()
            # a chunk index past the end is answered (not a protocol violation)
            s = await b.t.open_stream(a.t.peer_id, PROTOCOL)
            await s.write_frame(pack({"op": "get", "blob": h, "chunk_size": CHUNK, "chunks": [NCHUNKS + 5]}))
            with trio.fail_after(10):
                assert "error" in await read_header(s)
            await s.close()
            if kind == "libp2p":  # a bulk connection with keys from another exchange is refused
                s = await b.t.open_stream(a.t.peer_id, PROTOCOL)
                priv, pub = new_ephemeral()
                await s.write_frame(pack({"op": "bulk", "blob": h, "conns": 1, "x25519": pub}))
                offer = await read_header(s)
                wrong, _ = new_ephemeral()
                keys = derive_keys(wrong, offer["x25519"], server_peer=a.t.peer_id, client_peer=b.t.peer_id,
                                   server_pub=offer["x25519"], client_pub=pub, conns=1)
                bulk = await BulkConn.open(s.remote_host, offer["port"], 0, keys[0], a.t.peer_id)
                with pytest.raises(TransportError), trio.fail_after(10):
                    await bulk.request(pack({"op": "get", "blob": h, "chunk_size": CHUNK, "chunks": [0]}))
                    await bulk.chunk(0, CHUNK)
                await bulk.close()
                await s.close()
            # the node still serves normally
            assert await b.svc.fetch(h, [a.t.peer_id]) == h
            assert a.t.peer_id in b.t.peers()

    run(body)
    assert any("reset" in r.getMessage() or "closed" in r.getMessage() for r in caplog.records)
