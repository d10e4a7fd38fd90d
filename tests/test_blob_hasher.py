"""PartialBlob.start_hasher: the whole-blob hash in a thread of its own.

Writers run out of order in several threads with the smallest lag (one chunk), so the
backpressure wait is exercised; the hash the hasher builds is the one complete() checks.
"""
from __future__ import annotations

import hashlib
import random
import threading

import pytest

from atdnode.blobs.partial import BadChunks
from atdnode.blobs import BlobStore
from atdnode.blobs.store import Manifest

CS = 1024


def _blob(n: int) -> tuple[bytes, Manifest]:
    data = random.Random(7).randbytes(n)
    return data, Manifest.of_bytes(data, CS)


def _write_concurrently(p, data: bytes, m: Manifest, order: list[int], bad: set[int]) -> None:
    def span(i: int) -> bytes:
        off, n = m.span(i)
        chunk = data[off:off + n]
        return bytes([chunk[0] ^ 1]) + chunk[1:] if i in bad else chunk

    errors: list[BaseException] = []

    def run(part: list[int]) -> None:
        try:
            for i in part:
                assert p.write_chunk(i, span(i), False, False)
        except BaseException as e:  # noqa: BLE001 -- re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(order[k::3],)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a writer is stuck (backpressure deadlock)"
    if errors:
        raise errors[0]


def test_hasher_thread_hashes_out_of_order_writes_from_several_threads(tmp_path):
    data, m = _blob(40 * CS + 100)
    s = BlobStore(tmp_path, chunk_size=CS)
    p = s.partial(m)
    p.start_hasher(lag=CS)
    order = list(range(m.num_chunks))
    random.Random(1).shuffle(order)
    _write_concurrently(p, data, m, order, set())
    for _ in range(200):  # the hasher finishes on its own once every chunk is written
        if p._hash_thread is None:
            break
        threading.Event().wait(0.01)
    assert p._hash_thread is None and p._hashed == m.num_chunks  # it did the whole hash
    assert p.complete() == m.blob and s.get_bytes(m.blob) == data
    assert hashlib.sha256(s.get_bytes(m.blob)).hexdigest() == m.blob


def test_hasher_thread_still_catches_bad_chunks(tmp_path):
    data, m = _blob(12 * CS)
    s = BlobStore(tmp_path, chunk_size=CS)
    p = s.partial(m)
    p.start_hasher(lag=CS)
    _write_concurrently(p, data, m, [5, 0, 11, 1, 2, 3, 4, 6, 7, 8, 9, 10], {3, 11})
    with pytest.raises(BadChunks, match=r"chunks \[3, 11\]"):
        p.complete()
    assert not s.has(m.blob) and p.missing() == [3, 11]
    p.start_hasher(lag=CS)  # a second round (the fetcher re-fetches the bad chunks)
    for i in (11, 3):
        off, n = m.span(i)
        p.write_chunk(i, data[off:off + n], False, False)
    assert p.complete() == m.blob and s.get_bytes(m.blob) == data


def test_close_stops_the_hasher_and_resume_rehashes(tmp_path):
    data, m = _blob(8 * CS)
    s = BlobStore(tmp_path, chunk_size=CS)
    p = s.partial(m)
    p.start_hasher(lag=CS)
    for i in (0, 1, 2):
        off, n = m.span(i)
        p.write_chunk(i, data[off:off + n], False, False)
    p.close()
    assert p._hash_thread is None
    q = BlobStore(tmp_path, chunk_size=CS).partial(m)
    assert q.missing() == [3, 4, 5, 6, 7]
    q.start_hasher()
    for i in q.missing():
        off, n = m.span(i)
        q.write_chunk(i, data[off:off + n], False, False)
    assert q.complete() == m.blob
