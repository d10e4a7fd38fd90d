"""Blob names and chunk manifests: what a blob is called and how it is cut into chunks.

A blob is named by the lower-case hex SHA-256 of its bytes. A `Manifest` lists the SHA-256
of each fixed-size chunk; its canonical msgpack bytes are what peers exchange and hash.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import msgpack

from atdnode.errors import BlobError
from atdnode.transport import DecodeBudget

DEFAULT_CHUNK_SIZE = 1 << 20
MAX_CHUNK_SIZE = 64 << 20
MAX_BLOB_SIZE = 1 << 40
_HEX = frozenset("0123456789abcdef")
_MANIFEST_VERSION = 1


def check_hash(h: object) -> str:
    """Return `h` as a lower-case 64-hex SHA-256 name, or raise BlobError."""
    if not isinstance(h, str) or len(h) != 64 or not set(h.lower()) <= _HEX:
        raise BlobError(f"not a blob hash (64 hex chars): {h!r:.80}")
    return h.lower()


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
