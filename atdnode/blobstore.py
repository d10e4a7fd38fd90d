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

import errno
import hashlib
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import msgpack

from atdnode.errors import BlobError
from atdnode.transport.limits import DecodeBudget

if TYPE_CHECKING:
    from atdnode.blobpartial import PartialBlob

DEFAULT_CHUNK_SIZE = 1 << 20
MAX_CHUNK_SIZE = 64 << 20
MAX_BLOB_SIZE = 1 << 40
IO_BUF = 8 << 20  # large buffers: hashlib releases the GIL, syscalls are amortised
_PIPELINE_MIN = 4 * IO_BUF  # below this, hashing in a second thread is not worth a thread
_HEX = frozenset("0123456789abcdef")
_MANIFEST_VERSION = 1


def check_hash(h: object) -> str:
    """Return `h` as a lower-case 64-hex SHA-256 name, or raise BlobError."""
    if not isinstance(h, str) or len(h) != 64 or not set(h.lower()) <= _HEX:
        raise BlobError(f"not a blob hash (64 hex chars): {h!r:.80}")
    return h.lower()


def _write_error(e: OSError, what: str) -> BlobError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return BlobError(f"disk full while writing {what}: {e.strerror or e}")
    return BlobError(f"cannot write {what}: {e}")


def _write_all(fd: int, data: memoryview, offset: int | None = None) -> None:
    """Write all of `data` (os.write/pwrite may write less than asked)."""
    done, n = 0, len(data)
    while done < n:
        piece = data[done:done + IO_BUF]
        w = os.write(fd, piece) if offset is None else os.pwrite(fd, piece, offset + done)
        if w <= 0:
            raise OSError(errno.EIO, "write returned 0")
        done += w


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(p: Path | str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Manifest:
    """Fixed-size chunking of one blob: `chunks[i]` is the SHA-256 hex of bytes
    [i*chunk_size, min(size, (i+1)*chunk_size)). An empty blob has no chunks.

    Invariants are checked on construction. `to_bytes()` is canonical msgpack;
    `from_bytes()` accepts exactly the canonical form, so `hash` names one manifest.
    """

    blob: str
    size: int
    chunk_size: int
    chunks: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "blob", check_hash(self.blob))
        object.__setattr__(self, "chunks", tuple(check_hash(c) for c in self.chunks))
        for name, v, lo, hi in (("size", self.size, 0, MAX_BLOB_SIZE),
                                ("chunk_size", self.chunk_size, 1, MAX_CHUNK_SIZE)):
            if type(v) is not int or not lo <= v <= hi:
                raise BlobError(f"manifest {name} must be an int in [{lo}, {hi}], got {v!r:.40}")
        want = _ceil_div(self.size, self.chunk_size)
        if len(self.chunks) != want:
            raise BlobError(f"manifest lists {len(self.chunks)} chunks, a {self.size}-byte blob "
                            f"in {self.chunk_size}-byte chunks has {want}")

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def span(self, i: int) -> tuple[int, int]:
        """(offset, length) of chunk `i`; BlobError when out of range."""
        if type(i) is not int or not 0 <= i < len(self.chunks):
            raise BlobError(f"chunk index {i!r} out of range (blob {self.blob[:16]} has {len(self.chunks)} chunks)")
        off = i * self.chunk_size
        return off, min(self.chunk_size, self.size - off)

    def to_bytes(self) -> bytes:
        return msgpack.packb({
            "v": _MANIFEST_VERSION, "blob": bytes.fromhex(self.blob), "size": self.size,
            "chunk_size": self.chunk_size, "chunks": b"".join(bytes.fromhex(c) for c in self.chunks),
        }, use_bin_type=True)

    @cached_property
    def hash(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Manifest":
        """Parse canonical manifest bytes; BlobError on anything malformed, truncated or non-canonical."""
        try:
            budget = DecodeBudget(maps=1, lists=1)  # one flat map: a peer's bytes decode to a bounded size
            d = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True, max_map_len=8, max_array_len=8,
                                max_str_len=64, max_ext_len=0, object_hook=budget.map, list_hook=budget.list)
        except (ValueError, TypeError, msgpack.UnpackException) as e:  # ExtraData, truncated, bad utf-8
            raise BlobError(f"malformed manifest ({type(e).__name__}: {e})") from None
        keys = {"v", "blob", "size", "chunk_size", "chunks"}
        if not isinstance(d, dict) or set(d) != keys:
            raise BlobError("malformed manifest: expected a map with keys " + ", ".join(sorted(keys)))
        if d["v"] != _MANIFEST_VERSION:
            raise BlobError(f"unsupported manifest version {d['v']!r:.20}")
        blob, chunks = d["blob"], d["chunks"]
        if not isinstance(blob, bytes) or len(blob) != 32 or not isinstance(chunks, bytes) or len(chunks) % 32:
            raise BlobError("malformed manifest: blob/chunk hashes must be 32-byte binaries")
        m = cls(blob.hex(), d["size"], d["chunk_size"],
                tuple(chunks[i:i + 32].hex() for i in range(0, len(chunks), 32)))
        if m.to_bytes() != bytes(raw):
            raise BlobError("manifest is not in canonical encoding")
        return m

    @classmethod
    def of_bytes(cls, data: bytes | memoryview, chunk_size: int = DEFAULT_CHUNK_SIZE) -> "Manifest":
        """Manifest of in-memory bytes."""
        mv = memoryview(data).cast("B")
        chunks = tuple(hashlib.sha256(mv[o:o + chunk_size]).hexdigest() for o in range(0, len(mv), chunk_size))
        return cls(hashlib.sha256(mv).hexdigest(), len(mv), chunk_size, chunks)


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
            raise _write_error(e, f"blob store directory {self.root}") from None
        self._sweep_tmp()

    def _sweep_tmp(self, max_age_s: float = 3600.0) -> None:
        """Delete temp files a crashed writer left behind (old enough not to be in use)."""
        now = time.time()
        try:
            for f in (self.root / "tmp").iterdir():
                if f.name.startswith(".tmp-") and now - f.stat().st_mtime > max_age_s:
                    _remove(f)
        except OSError:
            pass

    # ----- naming
    def _blob_path(self, h: str) -> Path:
        return self.root / h[:2] / h

    def _shard(self, h: str) -> Path:
        d = self.root / h[:2]
        if not d.is_dir():
            d.mkdir(exist_ok=True)
            _fsync_dir(self.root)
        return d

    def has(self, h: str) -> bool:
        return self._blob_path(check_hash(h)).is_file()

    def path(self, h: str) -> Path:
        """Path of a held blob (BlobError if absent). Its bytes are not re-verified."""
        p = self._blob_path(check_hash(h))
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
                _write_all(fd, mv)
                return hashlib.sha256(mv).hexdigest()
            with ThreadPoolExecutor(1, thread_name_prefix="blob-hash") as ex:  # hash while writing
                fut = ex.submit(lambda: hashlib.sha256(mv).hexdigest())
                _write_all(fd, mv)
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
            raise _write_error(e, f"a blob in {self.root}") from None
        try:
            h = fill(fd)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            dest = self._blob_path(h)
            self._shard(h)
            os.replace(tmp, dest)
            _fsync_dir(dest.parent)
        except OSError as e:
            raise _write_error(e, f"a blob in {self.root}") from None
        finally:
            if fd >= 0:
                os.close(fd)
            _remove(tmp)  # no-op after a successful rename
        return h

    def delete(self, h: str) -> None:
        """Remove a blob and its cached manifest (no error if absent)."""
        h = check_hash(h)
        self._manifests.pop(h, None)
        p = self._blob_path(h)
        _remove(p)
        _remove(p.with_name(h + ".manifest"))

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
            self._cache_manifest(m)
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

    def _cache_manifest(self, m: Manifest) -> None:
        """Remember `m` and write it next to the blob (best effort: it is only a cache)."""
        self._manifests[m.blob] = m
        p = self._blob_path(m.blob).with_name(m.blob + ".manifest")
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=p.parent)
        except OSError:
            return
        try:
            _write_all(fd, memoryview(m.to_bytes()))
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, p)
        except OSError:
            pass
        finally:
            if fd >= 0:
                os.close(fd)
            _remove(tmp)

    def read_chunk(self, h: str, i: int) -> bytes:
        """Chunk `i` of a held blob per `manifest(h)`, verified (BlobError if corrupt)."""
        m = self.manifest(h)
        off, n = m.span(i)
        with open(self._blob_path(m.blob), "rb", buffering=0) as f:
            data = os.pread(f.fileno(), n, off)
        if len(data) != n or hashlib.sha256(data).hexdigest() != m.chunks[i]:
            raise BlobError(f"chunk {i} of blob {m.blob} is corrupt on disk")
        return data

    # ----- downloads
    def partial(self, manifest: Manifest) -> "PartialBlob":
        """The resumable download target for `manifest` (see PartialBlob). Returns the same
        object while it is open; after a restart, resumes from what was recorded on disk."""
        with self._lock:
            p = self._partials.get(manifest.blob)
            if p is not None and not p.closed:
                if p.manifest != manifest:
                    raise BlobError(f"a download of blob {manifest.blob} with a different manifest is in progress")
                return p
            from atdnode.blobpartial import PartialBlob

            p = PartialBlob(self, manifest)
            self._partials[manifest.blob] = p
            return p

    def _forget_partial(self, p: "PartialBlob") -> None:
        with self._lock:
            if self._partials.get(p.manifest.blob) is p:
                del self._partials[p.manifest.blob]


def _copy_hashing(src: BinaryIO, dst_fd: int | None, what: str) -> tuple[str, int]:
    """Read `src` in IO_BUF blocks, hashing each in a worker thread while the block is
    written to `dst_fd` (if any) and the next one read (two buffers). Returns (hash, n)."""
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
                _write_all(dst_fd, mv)
            n += r
            k ^= 1
        for f in prev:
            if f is not None:
                f.result()
    return hasher.hexdigest(), n


def __getattr__(name: str):
    # PartialBlob lives in atdnode.blobpartial; keep `from atdnode.blobstore import PartialBlob` working.
    if name == "PartialBlob":
        from atdnode.blobpartial import PartialBlob

        return PartialBlob
    raise AttributeError(name)
