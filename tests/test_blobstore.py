"""Blob store: atomic content-addressed writes, verification, manifests, resumable partials."""
from __future__ import annotations

import errno
import hashlib
import os
import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import atdnode.blobs.fs as blobfs
import atdnode.blobs.store as bs
from atdnode.blobs.partial import BadChunks, PartialBlob
from atdnode.blobs import BlobStore
from atdnode.blobs.store import Manifest
from atdnode.errors import BlobError

CS = 1024  # small chunks keep the tests fast


def _data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture
def store(tmp_path):
    return BlobStore(tmp_path / "blobs", chunk_size=CS)


@pytest.fixture
def small_pipeline(monkeypatch):
    """Exercise the threaded hash-while-writing paths with small buffers."""
    monkeypatch.setattr(bs, "IO_BUF", 256)
    monkeypatch.setattr(blobfs, "IO_BUF", 256)
    monkeypatch.setattr(bs, "_PIPELINE_MIN", 512)


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


# ----- put / get

def test_put_get_roundtrip_and_layout(store):
    data = _data(5000)
    h = store.put_bytes(data)
    assert h == hashlib.sha256(data).hexdigest()
    assert store.path(h) == store.root / h[:2] / h
    assert store.has(h) and store.size(h) == 5000 and store.list() == [h]
    assert store.get_bytes(h) == data
    with store.open(h) as f:
        assert f.read() == data
    store.verify(h)
    assert store.put_bytes(data) == h and store.list() == [h]  # idempotent
    assert store.has(h.upper())


def test_empty_blob(store):
    h = store.put_bytes(b"")
    assert store.get_bytes(h) == b"" and store.manifest(h).chunks == ()


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 511, 512, 513, 4000])
def test_put_bytes_and_put_file_pipelined(store, small_pipeline, tmp_path, n):
    data = _data(n, seed=n)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    h = hashlib.sha256(data).hexdigest()
    assert store.put_bytes(data) == h
    store.delete(h)
    assert not store.has(h)
    assert store.put_file(src) == h
    assert store.get_bytes(h) == data
    store.verify(h)


def test_put_file_missing_source(store, tmp_path):
    with pytest.raises(BlobError, match="cannot read"):
        store.put_file(tmp_path / "nope")


def test_bad_hash_and_absent_blob(store):
    for bad in ["xyz", "g" * 64, 123, "a" * 63]:
        with pytest.raises(BlobError, match="not a blob hash"):
            store.has(bad)
    absent = "0" * 64
    assert not store.has(absent)
    for call in (store.get_bytes, store.path, store.size, store.open, store.manifest, store.verify):
        with pytest.raises(BlobError, match="not in the store"):
            call(absent)


def test_corrupt_blob_detected(store):
    data = _data(3 * CS + 10)
    h = store.put_bytes(data)
    _flip(store.path(h), CS + 5)
    with pytest.raises(BlobError, match="corrupt"):
        store.get_bytes(h)
    with pytest.raises(BlobError, match="corrupt"):
        store.verify(h)
    with pytest.raises(BlobError, match="corrupt"):
        store.manifest(h)  # never describe corrupt bytes


@pytest.mark.parametrize("n", [300, 511, 512, 4000])  # below / at _PIPELINE_MIN (inline) and above (pipelined)
def test_verify_reads_every_byte_on_both_paths(store, small_pipeline, n):
    """A small blob is hashed in the calling thread with one buffer of its size, a large one
    pipelined; either way a flipped last byte (same size, same inode) is caught, however
    often the blob was verified before, and a blob that grew is read whole."""
    data = _data(n, seed=n)
    h = store.put_bytes(data)
    for _ in range(2):
        store.verify(h)
    _flip(store.path(h), n - 1)
    with pytest.raises(BlobError, match=f"corrupt on disk: its {n} bytes"):
        store.verify(h)
    store.path(h).write_bytes(data + b"x")  # appended after the name was given
    with pytest.raises(BlobError, match=f"its {n + 1} bytes"):
        store.verify(h)


def test_read_chunk_detects_rot_after_manifest(store):
    data = _data(3 * CS + 10)
    h = store.put_bytes(data)
    store.manifest(h)
    _flip(store.path(h), CS + 5)
    assert store.read_chunk(h, 0) == data[:CS]
    with pytest.raises(BlobError, match="chunk 1 .* corrupt"):
        store.read_chunk(h, 1)


def test_truncated_blob_detected(store):
    data = _data(2 * CS)
    h = store.put_bytes(data)
    with open(store.path(h), "r+b") as f:
        f.truncate(CS)
    with pytest.raises(BlobError, match="1024 bytes hash to"):
        store.get_bytes(h)


def _enospc_after(monkeypatch, n_ok: int, name: str = "write"):
    real = getattr(os, name)
    calls = {"n": 0}

    def fake(*a):
        calls["n"] += 1
        if calls["n"] > n_ok:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a)

    monkeypatch.setattr(os, name, fake)
    return calls


@pytest.mark.parametrize("how", ["bytes", "file"])
def test_disk_full_leaves_nothing(store, small_pipeline, monkeypatch, tmp_path, how):
    data = _data(3000)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    calls = _enospc_after(monkeypatch, 3)
    with pytest.raises(BlobError, match="disk full"):
        store.put_bytes(data) if how == "bytes" else store.put_file(src)
    assert calls["n"] == 4  # it failed mid-way, after some writes succeeded
    monkeypatch.undo()
    assert store.list() == [] and _files(store.root) == []
    assert store.put_bytes(data) == hashlib.sha256(data).hexdigest()  # the store still works


def test_crash_before_rename_leaves_no_blob(store, monkeypatch):
    def boom(*a):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(BlobError, match="cannot write"):
        store.put_bytes(b"hello")
    monkeypatch.undo()
    assert store.list() == [] and _files(store.root) == []


def test_stale_temp_files_are_swept(tmp_path):
    s = BlobStore(tmp_path)
    stale, fresh = tmp_path / "tmp" / ".tmp-old", tmp_path / "tmp" / ".tmp-new"
    (tmp_path / "tmp").mkdir()
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    os.utime(stale, (1, 1))
    BlobStore(tmp_path)
    assert not stale.exists() and fresh.exists() and s.list() == []


# ----- manifests

def test_manifest_roundtrip_and_hash(store):
    data = _data(3 * CS + 1)
    h = store.put_bytes(data)
    m = store.manifest(h)
    assert m == Manifest.of_bytes(data, CS)
    assert (m.blob, m.size, m.chunk_size, m.num_chunks) == (h, len(data), CS, 4)
    assert m.chunks[3] == hashlib.sha256(data[3 * CS:]).hexdigest()
    raw = m.to_bytes()
    assert m.hash == hashlib.sha256(raw).hexdigest()
    assert Manifest.from_bytes(raw) == m and Manifest.from_bytes(raw).hash == m.hash
    assert m.span(3) == (3 * CS, 1)
    with pytest.raises(BlobError, match="out of range"):
        m.span(4)


def test_manifest_known_answer():
    m = Manifest.of_bytes(b"abc", 2)
    assert m.blob == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert m.to_bytes() == msgpack.packb({"v": 1, "blob": bytes.fromhex(m.blob), "size": 3, "chunk_size": 2,
                                          "chunks": hashlib.sha256(b"ab").digest() + hashlib.sha256(b"c").digest()})


def test_manifest_cached_next_to_blob(store, monkeypatch):
    h = store.put_bytes(_data(2 * CS))
    m = store.manifest(h)
    cache = store.path(h).with_name(h + ".manifest")
    assert cache.read_bytes() == m.to_bytes()
    fresh = BlobStore(store.root, chunk_size=CS)

    def no(*a):
        raise AssertionError("recomputed")

    monkeypatch.setattr(fresh, "_compute_manifest", no)
    assert fresh.manifest(h) == m
    assert fresh.list() == [h]  # cache files are not blobs
    cache.write_bytes(b"garbage")  # a broken cache is recomputed, not trusted
    assert BlobStore(store.root, chunk_size=CS).manifest(h) == m


def test_manifest_from_bytes_rejects_every_truncation():
    raw = Manifest.of_bytes(_data(5 * CS), CS).to_bytes()
    for n in range(len(raw)):
        with pytest.raises(BlobError):
            Manifest.from_bytes(raw[:n])
    with pytest.raises(BlobError):
        Manifest.from_bytes(raw + b"\x00")


def _mk(**kw) -> bytes:
    base = {"v": 1, "blob": b"\x01" * 32, "size": 3, "chunk_size": 2, "chunks": b"\x02" * 64}
    base.update(kw)
    return msgpack.packb({k: v for k, v in base.items() if v is not None}, use_bin_type=True)


@pytest.mark.parametrize("raw,msg", [
    (b"", "malformed"),
    (b"\xc1", "malformed"),
    (msgpack.packb([1, 2]), "expected a map"),
    (_mk(v=2), "version"),
    (_mk(size=None), "expected a map"),
    (_mk(extra=1), "expected a map"),
    (_mk(blob=b"\x01" * 31), "32-byte"),
    (_mk(blob="01" * 32), "32-byte"),
    (_mk(chunks=b"\x02" * 63), "32-byte"),
    (_mk(chunks=b"\x02" * 96), "lists 3 chunks"),
    (_mk(size=-1), "size must be"),
    (_mk(size=True), "size must be"),
    (_mk(size=3.0), "size must be"),
    (_mk(chunk_size=0, chunks=b""), "chunk_size must be"),
    (_mk(chunk_size=bs.MAX_CHUNK_SIZE + 1, chunks=b"\x02" * 32), "chunk_size must be"),
    (msgpack.packb({"chunks": b"\x02" * 64, "v": 1, "blob": b"\x01" * 32, "size": 3, "chunk_size": 2}),
     "canonical"),
])
def test_manifest_malformed(raw, msg):
    with pytest.raises(BlobError, match=msg):
        Manifest.from_bytes(raw)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.data())
def test_manifest_mutations_only_raise_blob_error(data, draw):
    raw = bytearray(Manifest.of_bytes(data, 64).to_bytes())
    for _ in range(draw.draw(st.integers(1, 4))):
        raw[draw.draw(st.integers(0, len(raw) - 1))] = draw.draw(st.integers(0, 255))
    try:
        m = Manifest.from_bytes(bytes(raw))
    except BlobError:
        return
    assert m.to_bytes() == bytes(raw)  # anything accepted is canonical


@settings(max_examples=40, deadline=None)
@given(cs=st.integers(1, 64), k=st.integers(0, 5), delta=st.integers(-1, 1), seed=st.integers(0, 9))
def test_chunks_around_boundaries(cs, k, delta, seed):
    n = max(0, k * cs + delta)
    data = _data(n, seed)
    with tempfile.TemporaryDirectory() as d:
        s = BlobStore(d, chunk_size=cs)
        h = s.put_bytes(data)
        m = s.manifest(h)
        assert m.num_chunks == -(-n // cs)
        assert b"".join(s.read_chunk(h, i) for i in range(m.num_chunks)) == data
        assert Manifest.from_bytes(m.to_bytes()) == m
        # a fresh store fetches it chunk by chunk, in random order, and ends with the same blob
        t = BlobStore(Path(d) / "other", chunk_size=7)
        p = t.partial(m)
        order = list(range(m.num_chunks))
        random.Random(seed).shuffle(order)
        for i in order:
            p.write_chunk(i, s.read_chunk(h, i), sync=False)
        assert p.complete() == h
        assert t.get_bytes(h) == data and t.manifest(h) == m  # the announced manifest is kept


# ----- partial downloads

@pytest.fixture
def src(store):
    data = _data(6 * CS + 100, seed=7)
    h = store.put_bytes(data)
    return store, h, store.manifest(h), data


def _chunk(data: bytes, m: Manifest, i: int) -> bytes:
    off, n = m.span(i)
    return data[off:off + n]


def test_partial_resume_after_restart(src, tmp_path):
    _, h, m, data = src
    dst = tmp_path / "dst"
    p = BlobStore(dst, chunk_size=CS).partial(m)
    assert p.missing() == list(range(7))
    for i in (5, 0, 2):
        assert p.write_chunk(i, _chunk(data, m, i))
    assert p.write_chunk(2, _chunk(data, m, 2)) is False  # already held
    assert p.missing() == [1, 3, 4, 6]
    # "restart": a new store object on the same directory, the old one abandoned without close
    q = BlobStore(dst, chunk_size=CS).partial(m)
    assert q is not p and q.missing() == [1, 3, 4, 6] and q.have() == [0, 2, 5]
    for i in q.missing():
        q.write_chunk(i, _chunk(data, m, i))
    assert q.complete() == h
    s2 = BlobStore(dst, chunk_size=CS)
    assert s2.get_bytes(h) == data and s2.list() == [h]
    assert list((dst / "partial").iterdir()) == []
    with pytest.raises(BlobError, match="closed"):
        q.write_chunk(0, _chunk(data, m, 0))


def test_unflushed_chunks_are_lost_on_crash_flushed_ones_kept(src, tmp_path):
    _, _, m, data = src
    p = BlobStore(tmp_path, chunk_size=CS).partial(m)
    p.write_chunk(0, _chunk(data, m, 0), sync=False)
    p.write_chunk(1, _chunk(data, m, 1), sync=False)
    assert p.missing() == [2, 3, 4, 5, 6]
    assert BlobStore(tmp_path).partial(m).missing() == list(range(7))
    p.flush()
    assert BlobStore(tmp_path).partial(m).missing() == [2, 3, 4, 5, 6]


def test_bad_chunks_rejected_and_never_recorded(src, tmp_path):
    _, _, m, data = src
    p = BlobStore(tmp_path, chunk_size=CS).partial(m)
    good = _chunk(data, m, 1)
    wrong = bytes([good[0] ^ 1]) + good[1:]
    with pytest.raises(BlobError, match="chunk 1 .* does not match the manifest"):
        p.write_chunk(1, wrong)
    with pytest.raises(BlobError, match="has 1023 bytes, expected 1024"):
        p.write_chunk(1, good[:-1])
    with pytest.raises(BlobError, match="has 1024 bytes, expected 100"):
        p.write_chunk(6, good)
    with pytest.raises(BlobError, match="out of range"):
        p.write_chunk(7, good)
    with pytest.raises(BlobError, match="out of range"):
        p.write_chunk(-1, good)
    assert p.missing() == list(range(7))
    assert BlobStore(tmp_path).partial(m).missing() == list(range(7))
    with open(tmp_path / "partial" / m.blob, "rb") as f:  # nothing of the bad data was written
        f.seek(CS)
        assert f.read(CS) == b"\x00" * CS


def test_complete_refuses_incomplete(src, tmp_path):
    _, h, m, data = src
    s = BlobStore(tmp_path, chunk_size=CS)
    p = s.partial(m)
    p.write_chunk(0, _chunk(data, m, 0))
    with pytest.raises(BlobError, match="6 of 7 chunks missing"):
        p.complete()
    assert not s.has(h) and p.missing() == [1, 2, 3, 4, 5, 6]


def test_complete_catches_chunk_changed_on_disk(src, tmp_path):
    _, h, m, data = src
    s = BlobStore(tmp_path, chunk_size=CS)
    p = s.partial(m)
    for i in range(7):
        p.write_chunk(i, _chunk(data, m, i), sync=False)
    p.close()
    _flip(tmp_path / "partial" / h, 3 * CS + 1)  # disk rot after verification
    q = s.partial(m)
    assert q.missing() == []
    with pytest.raises(BlobError, match=r"chunks \[3\] changed on disk"):
        q.complete()
    assert q.missing() == [3] and not s.has(h)
    assert BlobStore(tmp_path).partial(m).missing() == [3]
    q.write_chunk(3, _chunk(data, m, 3))
    assert q.complete() == h and s.get_bytes(h) == data


def test_unverified_chunks_are_checked_by_the_whole_hash_only(src, tmp_path):
    """verify=False (a fetcher's path: one SHA-256 per byte) writes a wrong chunk, but
    complete() stores nothing, names exactly the wrong chunks and un-records them."""
    _, h, m, data = src
    s = BlobStore(tmp_path, chunk_size=CS)
    p = s.partial(m)
    for i in (6, 0, 1, 2, 3, 4, 5):  # out of order: the whole hash catches up by reading back
        chunk = _chunk(data, m, i)
        assert p.write_chunk(i, bytes([chunk[0] ^ 1]) + chunk[1:] if i in (2, 6) else chunk, False, False)
    with pytest.raises(BadChunks, match=r"chunks \[2, 6\]") as e:
        p.complete()
    assert e.value.chunks == [2, 6] and not s.has(h) and p.missing() == [2, 6]
    assert BlobStore(tmp_path).partial(m).missing() == [2, 6]  # un-recorded on disk too
    with pytest.raises(BlobError, match="does not match the manifest"):
        p.write_chunk(2, _chunk(data, m, 3)[:CS])  # verify=True (the default) still rejects
    p.write_chunk(2, _chunk(data, m, 2), False, False)
    p.write_chunk(6, _chunk(data, m, 6))
    assert p.complete() == h and s.get_bytes(h) == data


def test_inconsistent_manifest_is_discarded(tmp_path):
    a, b = _data(2 * CS, 1), _data(2 * CS, 2)
    ma = Manifest.of_bytes(a, CS)
    lying = Manifest(hashlib.sha256(b).hexdigest(), ma.size, CS, ma.chunks)
    s = BlobStore(tmp_path, chunk_size=CS)
    p = s.partial(lying)
    p.write_chunk(0, a[:CS])
    p.write_chunk(1, a[CS:])
    with pytest.raises(BlobError, match="inconsistent"):
        p.complete()
    assert s.list() == [] and list((tmp_path / "partial").iterdir()) == []


def test_partial_restarts_on_broken_sidecar_or_data(src, tmp_path):
    _, h, m, data = src
    s = BlobStore(tmp_path, chunk_size=CS)
    p = s.partial(m)
    p.write_chunk(0, _chunk(data, m, 0))
    p.write_chunk(1, _chunk(data, m, 1))
    p.close()
    state = tmp_path / "partial" / (h + ".state")
    raw = state.read_bytes()
    state.write_bytes(raw + b"\x01\x02\x03")  # torn tail: dropped, earlier records kept
    assert s.partial(m).missing() == list(range(2, 7))
    s.partial(m).close()
    state.write_bytes(raw[:-8] + b"\xff" * 8)  # garbage record: valid prefix kept
    assert s.partial(m).missing() == list(range(1, 7))
    s.partial(m).close()
    state.write_bytes(b"rubbish")  # unrecognised sidecar: start over
    assert s.partial(m).missing() == list(range(7))
    s.partial(m).write_chunk(0, _chunk(data, m, 0))
    s.partial(m).close()
    with open(tmp_path / "partial" / h, "r+b") as f:  # wrong-size data file: start over
        f.truncate(10)
    assert s.partial(m).missing() == list(range(7))


def test_partial_same_object_and_conflicting_manifest(src, tmp_path):
    _, _, m, data = src
    s = BlobStore(tmp_path, chunk_size=CS)
    p = s.partial(m)
    assert s.partial(m) is p
    other = Manifest.of_bytes(data, 2 * CS)
    with pytest.raises(BlobError, match="different manifest"):
        s.partial(other)
    p.discard()
    assert list((tmp_path / "partial").iterdir()) == []
    q = s.partial(other)  # a discarded download frees the slot
    assert q.missing() == list(range(4))


def test_partial_of_held_blob(src):
    store, h, m, _ = src
    p = store.partial(m)
    assert p.missing() == [] and p.complete() == h


def test_partial_empty_blob(tmp_path):
    m = Manifest.of_bytes(b"", CS)
    s = BlobStore(tmp_path)
    assert s.partial(m).missing() == []
    assert s.partial(m).complete() == m.blob and s.get_bytes(m.blob) == b""


def test_partial_disk_full_on_preallocate(src, tmp_path, monkeypatch):
    _, _, m, _ = src

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(BlobError, match="disk full"):
        BlobStore(tmp_path / "dst", chunk_size=CS).partial(m)
    assert _files(tmp_path / "dst") == []


def test_partial_disk_full_on_chunk_write(src, tmp_path, monkeypatch):
    _, _, m, data = src
    p = BlobStore(tmp_path, chunk_size=CS).partial(m)
    _enospc_after(monkeypatch, 0, "pwrite")
    with pytest.raises(BlobError, match="disk full"):
        p.write_chunk(2, _chunk(data, m, 2))
    monkeypatch.undo()
    assert p.missing() == list(range(7))
    p.write_chunk(2, _chunk(data, m, 2))
    assert p.missing() == [0, 1, 3, 4, 5, 6]


def test_partial_disk_full_on_record_leaves_state_clean(src, tmp_path, monkeypatch):
    _, _, m, data = src
    p = BlobStore(tmp_path, chunk_size=CS).partial(m)
    p.write_chunk(0, _chunk(data, m, 0))
    p.write_chunk(1, _chunk(data, m, 1), sync=False)
    _enospc_after(monkeypatch, 0, "write")
    with pytest.raises(BlobError, match="disk full"):
        p.flush()
    monkeypatch.undo()
    p.write_chunk(2, _chunk(data, m, 2))  # records 1 and 2 now
    assert BlobStore(tmp_path).partial(m).missing() == [3, 4, 5, 6]


def test_parallel_chunk_writes(src, tmp_path):
    _, h, m, data = src
    s = BlobStore(tmp_path, chunk_size=CS)
    p = s.partial(m)
    order = list(range(7)) * 2
    random.Random(3).shuffle(order)
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda i: p.write_chunk(i, _chunk(data, m, i)), order))
    assert p.missing() == [] and p.complete() == h and s.get_bytes(h) == data


def test_partial_blob_context_manager_closes(src, tmp_path):
    _, _, m, data = src
    s = BlobStore(tmp_path, chunk_size=CS)
    with s.partial(m) as p:
        assert isinstance(p, PartialBlob)
        p.write_chunk(4, _chunk(data, m, 4), sync=False)
    assert p.closed
    assert s.partial(m).missing() == [0, 1, 2, 3, 5, 6]  # close() flushed


def test_write_chunk_sync_flag_positional(src, tmp_path):
    """trio.to_thread.run_sync passes positional arguments only."""
    _, _, m, data = src
    s = BlobStore(tmp_path, chunk_size=CS)
    p = s.partial(m)
    assert p.write_chunk(0, _chunk(data, m, 0), False)
    assert BlobStore(tmp_path).partial(m).missing() == list(range(7))
    p.flush()
    assert BlobStore(tmp_path).partial(m).missing() == list(range(1, 7))


# ----- durability: always, except inside a throw-away simulation

def _count_syncs(monkeypatch) -> list[str]:
    calls: list[str] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append("fdatasync"), real_fdatasync(fd))[1])
    return calls


def _writes(store: BlobStore, root: Path, seed: int) -> None:
    """A blob put, a manifest cached, a chunked download completed, a registry record written."""
    from atdnode.node import NodeHome
    from atdnode.models import ModelRecord, ModelRegistry

    data = _data(3 * CS + 7, seed=seed)
    store.manifest(store.put_bytes(data))
    other = BlobStore(root / f"other{seed}", chunk_size=CS)
    m = store.manifest(store.put_bytes(_data(2 * CS, seed=seed + 100)))
    p = other.partial(m)
    for i in range(m.num_chunks):
        p.write_chunk(i, store.read_chunk(m.blob, i))
    p.complete()
    ModelRegistry(NodeHome.at(root / f"home{seed}")).add(ModelRecord(
        model={}, labels=["0", "1"], label_fp="x", samples=2, metrics={}, blobs={"full": m.blob}))


def test_writes_are_fsynced_unless_a_simulation_says_its_disk_is_volatile(store, tmp_path, monkeypatch):
    """A node's blobs, downloads and registry files reach the disk (fsync per file, per rename,
    per download record); only inside `volatile_disk()` (netsim's in-memory back-end) are
    the syncs skipped, and durability is back when the block ends, even on an error."""
    calls = _count_syncs(monkeypatch)
    assert blobfs.durable()
    _writes(store, tmp_path, 1)
    assert calls.count("fsync") >= 6 and calls.count("fdatasync") >= 2, calls
    calls.clear()
    with pytest.raises(RuntimeError), blobfs.volatile_disk():
        with blobfs.volatile_disk():  # nested: the outer block stays volatile
            pass
        assert not blobfs.durable()
        _writes(store, tmp_path, 2)
        raise RuntimeError("the simulation failed")
    assert calls == [] and blobfs.durable()
    _writes(store, tmp_path, 3)
    assert calls.count("fsync") >= 6, calls
