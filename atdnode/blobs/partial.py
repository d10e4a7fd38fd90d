"""Resumable chunk-by-chunk downloads into the blob store (`BlobStore.partial`).

Split out of blobstore.py: a `PartialBlob` writes verified chunks into a preallocated file
under `partial/`, records each one in an append-only, fsync'd sidecar, and on `complete()`
checks the whole-blob hash and renames the file into the store atomically.
"""
from __future__ import annotations
import errno
import hashlib
import mmap
import os
import struct
import threading
from pathlib import Path
from typing import Protocol

from atdnode.errors import BlobError
from atdnode.blobs.fs import fsync, fsync_dir, remove_quiet, write_all, write_error
from atdnode.blobs.manifest import Manifest



class PartialHost(Protocol):
    """What a download needs from its store (`BlobStore` is the one implementation)."""

    partial_dir: Path

    def has(self, h: str) -> bool: ...
    def blob_path(self, h: str) -> Path: ...
    def shard(self, h: str) -> Path: ...
    def cache_manifest(self, m: Manifest) -> None: ...
    def forget_partial(self, p: "PartialBlob") -> None: ...


class BadChunks(BlobError):
    """`complete()` found chunks that do not match the manifest (unverified writes, or disk
    rot): they are un-recorded (missing again); `chunks` lists them."""

    def __init__(self, chunks: list[int], message: str) -> None:
        super().__init__(message)
        self.chunks = chunks


_STATE_MAGIC = b"ATDPART1"
_REC = struct.Struct("<II")
_REC_CHECK = 0x5A7DC0DE  # second word of a record = index ^ this; catches garbage records


class PartialBlob:
    """A download of one blob, chunk by chunk in any order, that survives restarts.

    `write_chunk` verifies a chunk against the manifest (unless `verify=False`) before
    writing it into a preallocated file, and records it in an append-only sidecar after the
    data is on disk (fsync'd unless `sync=False`; then `flush()` records it). After a
    restart, `store.partial(same manifest).missing()` lists only unrecorded chunks.
    `complete()` verifies the whole-blob hash -- computed as chunks are written, over the
    written prefix, so each byte is hashed once -- and renames the file into the store
    atomically; on a mismatch it un-records the chunks that do not match the manifest
    (`BadChunks`). A sidecar or data file that does not match the manifest restarts the
    download.
    """

    def __init__(self, store: PartialHost, manifest: Manifest) -> None:
        self.store, self.manifest = store, manifest
        h, d = manifest.blob, store.partial_dir
        self._data_p, self._state_p, self._man_p = d / h, d / (h + ".state"), d / (h + ".manifest")
        self._lock = threading.Lock()  # guards the sets below
        self._flush_lock = threading.Lock()  # guards the state fd (one flush at a time)
        self._done: set[int] = set()  # recorded on disk
        self._pending: set[int] = set()  # written, not yet recorded (sync=False)
        self._writing: set[int] = set()  # being written by a thread now
        self._hash_lock = threading.Lock()  # whole-blob hash over the written prefix
        self._hasher, self._hashed = hashlib.sha256(), 0
        self._ready = threading.Condition(self._lock)  # a chunk was written / hashed (start_hasher)
        self._hash_thread: threading.Thread | None = None
        self._hash_lag = 0  # start_hasher: writers wait while this many written bytes await the hash
        self._fd = self._state_fd = -1
        self.closed = False
        if store.has(h):  # already held: nothing to fetch
            self._held = True
            return
        self._held = False
        try:
            d.mkdir(parents=True, exist_ok=True)
            if not self._resume():
                self._start()
        except OSError as e:
            self._close_fds()
            raise write_error(e, f"the download of blob {h}") from None

    def _resume(self) -> bool:
        try:
            st = self._state_p.read_bytes()
            if self._data_p.stat().st_size != self.manifest.size:
                return False
        except FileNotFoundError:
            return False
        head = _STATE_MAGIC + bytes.fromhex(self.manifest.hash)
        if not st.startswith(head):
            return False
        body, valid = st[len(head):], len(head)
        for off in range(0, len(body) - len(body) % _REC.size, _REC.size):
            i, chk = _REC.unpack_from(body, off)
            if chk != i ^ _REC_CHECK or i >= self.manifest.num_chunks:
                break  # keep the valid prefix, drop the rest
            self._done.add(i)
            valid += _REC.size
        self._fd = os.open(self._data_p, os.O_RDWR)
        self._state_fd = os.open(self._state_p, os.O_WRONLY | os.O_APPEND)
        os.ftruncate(self._state_fd, valid)  # cut a torn or garbage tail
        self._state_len = valid
        return True

    def _start(self) -> None:
        self._close_fds()
        self._done.clear()
        m = self.manifest
        self._fd = os.open(self._data_p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        if m.size:
            try:
                os.posix_fallocate(self._fd, 0, m.size)  # reserve the space now: a full disk fails here
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    self._discard_files()
                    raise
                os.ftruncate(self._fd, m.size)
        for p, raw in ((self._man_p, m.to_bytes()), (self._state_p, _STATE_MAGIC + bytes.fromhex(m.hash))):
            tmp = p.with_name(p.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                write_all(fd, memoryview(raw))
                fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, p)
        fsync_dir(self._data_p.parent)
        self._state_fd = os.open(self._state_p, os.O_WRONLY | os.O_APPEND)
        self._state_len = len(_STATE_MAGIC) + 32

    # ----- progress
    def missing(self) -> list[int]:
        """Chunk indexes not yet written and verified, ascending."""
        if self._held:
            return []
        with self._lock:
            have = self._done | self._pending
        return [i for i in range(self.manifest.num_chunks) if i not in have]

    def have(self) -> list[int]:
        """Chunk indexes written and verified, ascending."""
        if self._held:
            return list(range(self.manifest.num_chunks))
        with self._lock:
            return sorted(self._done | self._pending)

    def _check_open(self) -> None:
        if self.closed:
            raise BlobError(f"download of blob {self.manifest.blob} is closed")

    def write_chunk(self, i: int, data: bytes | bytearray | memoryview, sync: bool = True,
                    verify: bool = True) -> bool:
        """Verify chunk `i` against the manifest and write it. BlobError (nothing recorded)
        on a wrong length or hash, or a full disk. Returns False if already held (or being
        written by another thread). With sync=False the chunk is recorded durably only at
        the next `flush()`. (`sync` and `verify` are positional too, for trio.to_thread.)

        verify=False skips the chunk's own SHA-256 (its length is still checked): the chunk
        is then checked only by the whole-blob hash in `complete()`, which un-records every
        chunk that does not match the manifest (`BadChunks`). A fetcher uses it to hash each
        byte once instead of twice; nothing unverified ever enters the store."""
        self._check_open()
        off, n = self.manifest.span(i)
        mv = memoryview(data).cast("B")
        if len(mv) != n:
            raise BlobError(f"chunk {i} of blob {self.manifest.blob[:16]} has {len(mv)} bytes, expected {n}")
        if verify:
            self.check_chunk(i, mv)
        with self._lock:
            if self._held or i in self._done or i in self._pending or i in self._writing:
                return False
            self._writing.add(i)  # one writer per chunk: a concurrent second copy is dropped
        try:
            write_all(self._fd, mv, off)
        except OSError as e:
            with self._lock:
                self._writing.discard(i)
            raise write_error(e, f"chunk {i} of blob {self.manifest.blob}") from None
        with self._lock:
            self._writing.discard(i)
            self._pending.add(i)
            if self._hash_thread is not None:  # the hasher thread extends the hash
                self._ready.notify_all()
                while self._hash_thread is not None and self._unhashed_bytes() > self._hash_lag:
                    self._ready.wait(1.0)  # backpressure: the hasher can always progress here
        if self._hash_thread is None:
            self._advance_hash(i, mv)
        if sync:
            self.flush()
        return True

    def check_chunk(self, i: int, data: bytes | bytearray | memoryview) -> None:
        """BlobError unless `data` hashes to chunk `i` of the manifest."""
        got = hashlib.sha256(data).hexdigest()
        if got != self.manifest.chunks[i]:
            raise BlobError(f"chunk {i} of blob {self.manifest.blob[:16]} does not match the manifest "
                            f"(hash {got[:16]}, expected {self.manifest.chunks[i][:16]}); rejected")

    def flush(self) -> None:
        """Make the data of every written chunk durable, then record those chunks."""
        self._check_open()
        with self._flush_lock:  # the syncs run outside `_lock`: writers go on meanwhile
            with self._lock:
                todo = sorted(self._pending)
            if not todo:
                return
            try:
                fsync(self._fd, data_only=True)  # every chunk in `todo` was written before it became pending
                write_all(self._state_fd, memoryview(b"".join(_REC.pack(i, i ^ _REC_CHECK) for i in todo)))
                fsync(self._state_fd, data_only=True)
            except OSError as e:
                os.ftruncate(self._state_fd, self._state_len)  # never leave a torn record
                raise write_error(e, f"the download state of blob {self.manifest.blob}") from None
            self._state_len += _REC.size * len(todo)
            with self._lock:
                self._done.update(todo)
                self._pending.difference_update(todo)

    def _advance_hash(self, i: int | None = None, mv: memoryview | None = None, *, wait: bool = False) -> None:
        """Extend the whole-blob hash over the written prefix, so complete() rarely has to
        re-read the file. Non-blocking unless `wait`: a busy thread will catch up."""
        if not self._hash_lock.acquire(blocking=wait):
            return
        try:
            while self._hashed < self.manifest.num_chunks:
                k = self._hashed
                with self._lock:
                    if k not in self._done and k not in self._pending:
                        return
                if k == i and mv is not None:
                    self._hasher.update(mv)
                else:
                    off, n = self.manifest.span(k)
                    self._hasher.update(os.pread(self._fd, n, off))
                self._hashed += 1
        finally:
            self._hash_lock.release()

    # ----- the whole-blob hash in a thread of its own
    def start_hasher(self, lag: int = 8 << 20) -> None:
        """Extend the whole-blob hash in a background thread from now on (until `complete`,
        `close` or `discard`), re-reading written chunks from the page cache, so that the
        threads writing chunks (receive, decrypt, write) and the hash run on two cores at
        once. A writer waits while more than `lag` bytes of written chunks, in
        order from the hashed prefix, await the hash (the hasher can always take those, so
        this cannot deadlock): the receivers never run far ahead of the page cache."""
        with self._lock:
            if (self._held or self.closed or self._hash_thread is not None or not self.manifest.size
                    or self._hashed >= self.manifest.num_chunks):
                return
            self._hash_lag = max(lag, self.manifest.chunk_size)
            self._hash_thread = threading.Thread(target=self._hash_loop, name=f"blob-hash-{self.manifest.blob[:8]}",
                                                 daemon=True)
            self._hash_thread.start()

    def stop_hasher(self) -> None:
        """Stop the hasher thread (what it hashed stays hashed); the caller's thread goes on."""
        with self._lock:
            t, self._hash_thread = self._hash_thread, None
            self._ready.notify_all()
        if t is not None and t is not threading.current_thread():
            t.join()

    def _unhashed_bytes(self) -> int:
        """Bytes of written chunks, in order from the hashed prefix (call with `_lock` held)."""
        k, n, cap = self._hashed, 0, self._hash_lag
        while n <= cap and k < self.manifest.num_chunks and (k in self._done or k in self._pending):
            n += self.manifest.span(k)[1]
            k += 1
        return n

    def _hash_loop(self) -> None:
        """The hasher thread: hash written chunks in order, straight from the page cache (a
        read-only map of the preallocated file: no copy). Ends when every chunk is hashed,
        when stopped, or on an error (then `complete` hashes what is left itself)."""
        me = threading.current_thread()
        try:
            while True:
                with self._lock:
                    while self._hash_thread is me and not self._unhashed_bytes():
                        self._ready.wait()
                    if self._hash_thread is not me:
                        return
                with self._hash_lock:
                    off, n = self.manifest.span(self._hashed)
                    at = off - off % mmap.ALLOCATIONGRANULARITY  # one map per chunk: RSS stays one chunk
                    with mmap.mmap(self._fd, off + n - at, prot=mmap.PROT_READ, offset=at) as mm, memoryview(mm) as view:
                        self._hasher.update(view[off - at:])
                    self._hashed += 1
                with self._lock:
                    self._ready.notify_all()
                    if self._hashed >= self.manifest.num_chunks:
                        return
        except (OSError, ValueError):
            pass
        finally:
            with self._lock:
                if self._hash_thread is me:
                    self._hash_thread = None
                self._ready.notify_all()

    def complete(self) -> str:
        """Verify the whole blob and move it into the store; returns its hash.
        BlobError if chunks are missing; if the whole hash is wrong, chunks that changed on
        disk are un-recorded (fetch them again) or, if every chunk still matches, the
        manifest itself is inconsistent and the download is discarded."""
        self._check_open()
        h = self.manifest.blob
        if self._held:
            self.close()
            return h
        self.flush()  # the hasher (if any) catches up meanwhile
        if miss := self.missing():
            raise BlobError(f"blob {h} is incomplete: {len(miss)} of {self.manifest.num_chunks} chunks missing")
        self.stop_hasher()
        self._advance_hash(wait=True)
        got = self._hasher.hexdigest()
        if got != h:
            self._recover_from_bad_hash(got)
        try:
            fsync(self._fd)
            self._close_fds()
            dest = self.store.blob_path(h)
            self.store.shard(h)
            os.replace(self._data_p, dest)
            fsync_dir(dest.parent)
        except OSError as e:
            raise write_error(e, f"blob {h}") from None
        self.store.cache_manifest(self.manifest)
        self._discard_files()
        self.closed = True
        self.store.forget_partial(self)
        return h

    def _recover_from_bad_hash(self, got: str) -> None:
        m = self.manifest
        bad = [k for k in range(m.num_chunks)
               if hashlib.sha256(os.pread(self._fd, m.span(k)[1], m.span(k)[0])).hexdigest() != m.chunks[k]]
        if not bad:
            self.discard()
            raise BlobError(f"manifest {m.hash[:16]} of blob {m.blob} is inconsistent: every chunk matches "
                            f"but the whole blob hashes to {got}; download discarded")
        with self._lock:
            self._done.difference_update(bad)
            keep = sorted(self._done)
        with self._hash_lock:
            self._hasher, self._hashed = hashlib.sha256(), 0
        with self._flush_lock:
            self._rewrite_state(keep)
        raise BadChunks(bad, f"blob {m.blob}: chunks {bad[:10]} changed on disk or arrived corrupt "
                        "(they do not match the manifest); fetch them again")

    def _rewrite_state(self, keep: list[int]) -> None:
        """Replace the sidecar atomically by one recording exactly `keep`."""
        tmp = self._state_p.with_name(self._state_p.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            write_all(fd, memoryview(_STATE_MAGIC + bytes.fromhex(self.manifest.hash)
                                      + b"".join(_REC.pack(k, k ^ _REC_CHECK) for k in keep)))
            fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self._state_p)
        os.close(self._state_fd)
        self._state_fd = os.open(self._state_p, os.O_WRONLY | os.O_APPEND)
        self._state_len = os.fstat(self._state_fd).st_size

    # ----- lifecycle
    def _close_fds(self) -> None:
        for attr in ("_fd", "_state_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)

    def _discard_files(self) -> None:
        for p in (self._data_p, self._state_p, self._man_p):
            remove_quiet(p)

    def close(self) -> None:
        """Flush and release files; the download can be resumed later via store.partial()."""
        if self.closed:
            return
        self.stop_hasher()
        if not self._held:
            try:
                self.flush()
            finally:
                self._close_fds()
        self.closed = True
        self.store.forget_partial(self)

    def discard(self) -> None:
        """Abandon the download and delete its files."""
        self.stop_hasher()
        self._close_fds()
        if not self._held:
            self._discard_files()
        self.closed = True
        self.store.forget_partial(self)

    def __enter__(self) -> "PartialBlob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def partial_bytes(store: PartialHost, blob: str) -> int:
    """Bytes of `blob` a download (by any process) has recorded so far: read-only, from the
    sidecar's records and the manifest's chunk size (0 before a download starts; the full size
    once the blob is held). For progress bars; never used to decide what is verified."""
    if store.has(blob):
        return store.blob_path(blob).stat().st_size
    d = store.partial_dir
    try:
        man = Manifest.from_bytes((d / (blob + ".manifest")).read_bytes())
        st = (d / (blob + ".state")).read_bytes()
    except (OSError, BlobError, ValueError):
        return 0
    head = len(_STATE_MAGIC) + 32
    done = set()
    for off in range(head, len(st) - (len(st) - head) % _REC.size, _REC.size):
        i, chk = _REC.unpack_from(st, off)
        if chk != i ^ _REC_CHECK or i >= man.num_chunks:
            break
        done.add(i)
    last = man.size - (man.num_chunks - 1) * man.chunk_size if man.num_chunks else 0
    return sum(last if i == man.num_chunks - 1 else man.chunk_size for i in done)
