"""Content-addressed blob store: SHA-256 named files, chunk manifests, resumable downloads.

Layout under the store root (``NodeHome.blobs_dir``)::

    <2 hex>/<sha256 hex>            a blob; appears only by atomic rename of a complete, fsync'd file
    <2 hex>/<sha256 hex>.manifest   its cached chunk manifest (canonical msgpack)
    tmp/.tmp-*                      a blob being written, before its hash is known (never listed;
                                    removed on failure; renamed within the same filesystem)
    partial/<sha256 hex>            preallocated target of a chunk-by-chunk download
    partial/<sha256 hex>.manifest   the manifest that download follows
    partial/<sha256 hex>.state      which chunks are written and verified (append-only, fsync'd)

Contract: a file is only ever given the name ``<hash>`` after its bytes were hashed to
``<hash>`` while being written and were fsync'd, so a crash or a full disk never leaves
a blob that claims a hash it does not have. Rot after that is caught by the reading
calls that verify (``get_bytes``, ``verify``, ``read_chunk``), not by ``open``/``path``.

Every method is synchronous and safe to call from several threads; the daemon runs
them via ``trio.to_thread.run_sync`` because they hash and touch the disk.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from atdnode.blobs.fs import IO_BUF, fsync, fsync_dir, remove_quiet, write_all, write_error
from atdnode.blobs.partial import PartialBlob
from atdnode.errors import BlobError
from atdnode.blobs.manifest import (_HEX, DEFAULT_CHUNK_SIZE, MAX_BLOB_SIZE, MAX_CHUNK_SIZE,  # noqa: F401 (re-exported)
                              Manifest, check_hash)

if TYPE_CHECKING:
    from atdnode.node import NodeHome

_PIPELINE_MIN = 4 * IO_BUF  # below this, hashing in a second thread is not worth a thread


class BlobStore:
    """SHA-256 content-addressed files under `root` (see the module docstring)."""

    def __init__(self, root: str | Path, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if type(chunk_size) is not int or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
            raise BlobError(f"chunk_size must be in [1, {MAX_CHUNK_SIZE}], got {chunk_size!r}")
        self.root = Path(root)
        self.chunk_size = chunk_size
        self.partial_dir = self.root / "partial"
        self._lock = threading.Lock()
        self._manifests: dict[str, Manifest] = {}
        self._partials: dict[str, PartialBlob] = {}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error(e, f"blob store directory {self.root}") from None
        self._sweep_tmp()

    @classmethod
    def of(cls, home: "NodeHome") -> "BlobStore":
        """The blob store of node `home`, opened once per `NodeHandle` (atdnode.node.handle)."""
        from atdnode.node import NodeHandle

        return NodeHandle.of(home).part(_node_store)

    def _sweep_tmp(self, max_age_s: float = 3600.0) -> None:
        """Delete temp files a crashed writer left behind (old enough not to be in use)."""
        now = time.time()
        try:
            for f in (self.root / "tmp").iterdir():
                if f.name.startswith(".tmp-") and now - f.stat().st_mtime > max_age_s:
                    remove_quiet(f)
        except OSError:
            pass

    # ----- naming
    def blob_path(self, h: str) -> Path:
        return self.root / h[:2] / h

    def shard(self, h: str) -> Path:
        d = self.root / h[:2]
        if not d.is_dir():
            d.mkdir(exist_ok=True)
            fsync_dir(self.root)
        return d

    def has(self, h: str) -> bool:
        return self.blob_path(check_hash(h)).is_file()

    def path(self, h: str) -> Path:
        """Path of a held blob (BlobError if absent). Its bytes are not re-verified."""
        p = self.blob_path(check_hash(h))
        if not p.is_file():
            raise BlobError(f"blob {h} is not in the store at {self.root}")
        return p

    def size(self, h: str) -> int:
        return self.path(h).stat().st_size

    def list(self) -> list[str]:
        """Hashes of all held blobs, sorted."""
        out = []
        for d in self.root.iterdir():
            if len(d.name) == 2 and set(d.name) <= _HEX and d.is_dir():
                out += [f.name for f in d.iterdir() if len(f.name) == 64 and set(f.name) <= _HEX]
        return sorted(out)

    # ----- writing
    def put_bytes(self, data: bytes | bytearray | memoryview) -> str:
        """Store `data`; return its SHA-256 hex. Atomic; an existing copy is replaced (same bytes)."""
        mv = memoryview(data).cast("B")

        def fill(fd: int) -> str:
            if len(mv) < _PIPELINE_MIN:
                write_all(fd, mv)
                return hashlib.sha256(mv).hexdigest()
            with ThreadPoolExecutor(1, thread_name_prefix="blob-hash") as ex:  # hash while writing
                fut = ex.submit(lambda: hashlib.sha256(mv).hexdigest())
                write_all(fd, mv)
                return fut.result()

        return self._write_new(fill)

    def put_file(self, src: str | Path) -> str:
        """Copy the file at `src` into the store, hashing while copying (one pass); return its hash."""
        try:
            f = open(src, "rb", buffering=0)
        except OSError as e:
            raise BlobError(f"cannot read {src}: {e.strerror or e}") from None
        with f:
            return self._write_new(lambda fd: _copy_hashing(f, fd, str(src))[0])

    def _write_new(self, fill) -> str:
        """Run `fill(fd) -> hash` on a fresh temp file, fsync it, rename it to its hash."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp_dir = self.root / "tmp"  # same filesystem; moved into its shard once the hash is known
        try:
            tmp_dir.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=tmp_dir)
        except OSError as e:
            raise write_error(e, f"a blob in {self.root}") from None
        try:
            h = fill(fd)
            fsync(fd)
            os.close(fd)
            fd = -1
            dest = self.blob_path(h)
            self.shard(h)
            os.replace(tmp, dest)
            fsync_dir(dest.parent)
        except OSError as e:
            raise write_error(e, f"a blob in {self.root}") from None
        finally:
            if fd >= 0:
                os.close(fd)
            remove_quiet(tmp)  # no-op after a successful rename
        return h

    def delete(self, h: str) -> None:
        """Remove a blob and its cached manifest (no error if absent)."""
        h = check_hash(h)
        self._manifests.pop(h, None)
        p = self.blob_path(h)
        remove_quiet(p)
        remove_quiet(p.with_name(h + ".manifest"))

    # ----- reading
    def open(self, h: str) -> BinaryIO:
        """Open a held blob for reading. Not verified: use get_bytes/verify/read_chunk for that."""
        return open(self.path(h), "rb")

    def get_bytes(self, h: str) -> bytes:
        """The blob's bytes, verified against its name (BlobError if corrupt, truncated or absent)."""
        h = check_hash(h)
        with self.open(h) as f:
            data = f.read()
        got = hashlib.sha256(data).hexdigest()
        if got != h:
            raise BlobError(f"blob {h} is corrupt on disk: its {len(data)} bytes hash to {got}")
        return data

    def verify(self, h: str) -> None:
        """Stream the blob and raise BlobError unless it hashes to `h`."""
        h = check_hash(h)
        with open(self.path(h), "rb", buffering=0) as f:
            got, n = _copy_hashing(f, None, h)
        if got != h:
            raise BlobError(f"blob {h} is corrupt on disk: its {n} bytes hash to {got}")

    def manifest(self, h: str) -> Manifest:
        """Chunk manifest of a held blob: from memory, else the cache file, else computed
        (which also verifies the whole blob) and cached. A manifest learnt from a completed
        download is kept as is, whatever its chunk size."""
        h = check_hash(h)
        m = self._manifests.get(h)
        if m is not None:
            return m
        p = self.path(h)
        size = p.stat().st_size
        try:
            m = Manifest.from_bytes(p.with_name(h + ".manifest").read_bytes())
            if m.blob != h or m.size != size:
                m = None
        except (OSError, BlobError):
            m = None
        if m is None:
            m = self._compute_manifest(h, p)
            self.cache_manifest(m)
        self._manifests[h] = m
        return m

    def _compute_manifest(self, h: str, p: Path) -> Manifest:
        whole, chunks, cs = hashlib.sha256(), [], self.chunk_size
        step = max(1, IO_BUF // cs) * cs  # read several chunks per syscall
        with open(p, "rb", buffering=0) as f:
            while block := f.read(step):
                mv = memoryview(block)
                whole.update(mv)
                chunks += [hashlib.sha256(mv[o:o + cs]).hexdigest() for o in range(0, len(mv), cs)]
        if whole.hexdigest() != h:
            raise BlobError(f"blob {h} is corrupt on disk: it hashes to {whole.hexdigest()}")
        return Manifest(h, p.stat().st_size, cs, tuple(chunks))

    def cache_manifest(self, m: Manifest) -> None:
        """Remember `m` and write it next to the blob (best effort: it is only a cache)."""
        self._manifests[m.blob] = m
        p = self.blob_path(m.blob).with_name(m.blob + ".manifest")
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=p.parent)
        except OSError:
            return
        try:
            write_all(fd, memoryview(m.to_bytes()))
            fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, p)
        except OSError:
            pass
        finally:
            if fd >= 0:
                os.close(fd)
            remove_quiet(tmp)

    def read_chunk(self, h: str, i: int) -> bytes:
        """Chunk `i` of a held blob per `manifest(h)`, verified (BlobError if corrupt)."""
        m = self.manifest(h)
        off, n = m.span(i)
        with open(self.blob_path(m.blob), "rb", buffering=0) as f:
            data = os.pread(f.fileno(), n, off)
        if len(data) != n or hashlib.sha256(data).hexdigest() != m.chunks[i]:
            raise BlobError(f"chunk {i} of blob {m.blob} is corrupt on disk")
        return data

    # ----- downloads
    def partial(self, manifest: Manifest) -> PartialBlob:
        """The resumable download target for `manifest` (see PartialBlob). Returns the same
        object while it is open; after a restart, resumes from what was recorded on disk."""
        with self._lock:
            p = self._partials.get(manifest.blob)
            if p is not None and not p.closed:
                if p.manifest != manifest:
                    raise BlobError(f"a download of blob {manifest.blob} with a different manifest is in progress")
                return p
            p = PartialBlob(self, manifest)
            self._partials[manifest.blob] = p
            return p

    def forget_partial(self, p: PartialBlob) -> None:
        with self._lock:
            if self._partials.get(p.manifest.blob) is p:
                del self._partials[p.manifest.blob]


def _copy_hashing(src: BinaryIO, dst_fd: int | None, what: str) -> tuple[str, int]:
    """Read `src` in IO_BUF blocks, hashing each in a worker thread while the block is
    written to `dst_fd` (if any) and the next one read (two buffers). Returns (hash, n).
    A file below _PIPELINE_MIN (by its size when opened) is read in this thread into one
    buffer of about its size: no worker thread and no 2 x IO_BUF of zeroed buffers (which cost
    ~9 ms per call, the whole cost of verifying a small weight blob)."""
    try:
        size = os.fstat(src.fileno()).st_size
    except (AttributeError, OSError, ValueError):  # not a real file: the pipelined loop
        size = _PIPELINE_MIN
    if size < _PIPELINE_MIN:
        # at least 64 KiB: a pipe or a file still being written reads as small, but is not
        return _copy_hashing_inline(src, dst_fd, what, bytearray(min(IO_BUF, max(size + 1, 1 << 16))))
    hasher, n = hashlib.sha256(), 0
    bufs = [bytearray(IO_BUF), bytearray(IO_BUF)]
    prev: list[Future | None] = [None, None]
    with ThreadPoolExecutor(1, thread_name_prefix="blob-hash") as ex:
        k = 0
        while True:
            if prev[k] is not None:
                prev[k].result()  # the hash of the last block in this buffer is done
            try:
                r = src.readinto(bufs[k])
            except OSError as e:
                raise BlobError(f"cannot read {what}: {e.strerror or e}") from None
            if not r:
                break
            mv = memoryview(bufs[k])[:r]
            prev[k] = ex.submit(hasher.update, mv)
            if dst_fd is not None:
                write_all(dst_fd, mv)
            n += r
            k ^= 1
        for f in prev:
            if f is not None:
                f.result()
    return hasher.hexdigest(), n


def _copy_hashing_inline(src: BinaryIO, dst_fd: int | None, what: str, buf: bytearray) -> tuple[str, int]:
    """`_copy_hashing` in the calling thread with one buffer (reads until EOF, so a file that
    grew since its size was taken is still read whole)."""
    hasher, n = hashlib.sha256(), 0
    while True:
        try:
            r = src.readinto(buf)
        except OSError as e:
            raise BlobError(f"cannot read {what}: {e.strerror or e}") from None
        if not r:
            return hasher.hexdigest(), n
        mv = memoryview(buf)[:r]
        hasher.update(mv)
        if dst_fd is not None:
            write_all(dst_fd, mv)
        n += r


def _node_store(home: "NodeHome") -> BlobStore:
    return BlobStore(home.blobs_dir)
