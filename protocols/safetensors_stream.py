"""The one parser of peers' weight bytes: a lazy, bounds-checked safetensors reader.

Weights arrive from other members as safetensors blobs; this module reads them without
pickle and without trusting the header. A file is accepted only if (format of
https://github.com/huggingface/safetensors, little-endian hosts):

- it starts with an 8-byte little-endian header length ``n`` with ``8 + n <= size`` and
  ``n <= 100 MiB``, followed by a UTF-8 JSON object without duplicate keys;
- ``__metadata__``, if present, maps strings to strings;
- every tensor has a known dtype, a shape of at most ``MAX_DIMS`` non-negative ints whose
  product over the non-zero ones stays below 2^63 (a tensor's strides fit torch's int64:
  a zero-size tensor with a dimension of 2^63 is refused here, not by torch later) and
  ``data_offsets`` ``[start, end]`` of ints with ``end - start == numel * itemsize``;
- the tensors' byte ranges, sorted, tile the data section exactly: the first starts at 0,
  each starts where the previous ended (no overlap, no gap) and the last ends at the end
  of the file (no trailing bytes) -- the same rule as the reference implementation.

Anything else raises :class:`AggregationError` (`protocols.weightings`: every aggregation rule
raises it for bad input) naming the file and the reason; no other
exception type escapes the constructor (a fuzz test holds it to that).
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from protocols.weightings import AggregationError

WINDOW_BYTES = 16 * 1024 * 1024  # SafetensorsStream maps files in windows this large
MAX_DIMS = 64  # a tensor's largest number of dimensions
MAX_EXTENT = (1 << 63) - 1  # largest product of a shape's non-zero dimensions (torch's int64 strides)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsStream(Mapping[str, torch.Tensor]):
    """Lazy read-only mapping over a safetensors file (little-endian hosts).

    The header is parsed and checked when constructed (dtypes, shapes, offsets
    inside the file, byte sizes); tensor bytes are read only on ``[key]`` (a
    fresh tensor) or :meth:`view` (zero-copy views of mapped windows).
    Raises :class:`AggregationError` for a malformed file. Close it (or use it
    as a context manager) when done; :func:`weighted_average` does.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.window_bytes = WINDOW_BYTES
        self._window: tuple[int, int, mmap.mmap] | None = None  # file range [start, end) and its mapping
        self._f = open(self.path, "rb", buffering=0)
        try:
            self._entries, self.metadata = self._parse()
        except BaseException:
            self._f.close()
            raise

    def _parse(self) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype, int, int]], dict[str, str]]:
        size = self._size = os.fstat(self._f.fileno()).st_size
        bad = lambda why: AggregationError(f"{self.path}: not a valid safetensors file: {why}")  # noqa: E731
        if size < 8:
            raise bad("shorter than 8 bytes")
        (n,) = struct.unpack("<Q", self._read_at(0, 8))
        if n > _MAX_HEADER or 8 + n > size:
            raise bad(f"header length {n} out of range")
        try:
            header = json.loads(self._read_at(8, n).decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            raise bad(f"header is not JSON ({type(e).__name__}: {e})") from None
        if not isinstance(header, dict):
            raise bad("header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise bad("__metadata__ must map strings to strings")
        base, entries = 8 + n, {}
        for key, e in header.items():
            try:
                if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
                    raise TypeError
                dtype = _ST_DTYPES[e["dtype"]]
                shape = tuple(e["shape"])
                start, end = e["data_offsets"]
                if not all(type(v) is int for v in (*shape, start, end)):
                    raise TypeError
            except (KeyError, TypeError, ValueError):
                raise bad(f"tensor {key!r}: bad dtype/shape/data_offsets {e!r:.200}") from None
            if len(shape) > MAX_DIMS or math.prod(d for d in shape if d) > MAX_EXTENT:
                raise bad(f"tensor {key!r}: shape {shape!s:.200} exceeds {MAX_DIMS} dimensions or an extent of 2^63")
            if min(shape, default=0) < 0 or not 0 <= start <= end or base + end > size \
                    or end - start != math.prod(shape) * dtype.itemsize:
                raise bad(f"tensor {key!r}: offsets {start}..{end} do not fit shape {shape} {e['dtype']}")
            entries[key] = (shape, dtype, base + start, end - start)
        pos = base  # the byte ranges must tile the data section: no overlap, no gap, no tail
        for key, (_, _, start, nbytes) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
            if start != pos:
                raise bad(f"tensor {key!r}: data starts at {start - base}, expected {pos - base} "
                          f"({'overlaps the previous tensor' if start < pos else 'leaves a gap'})")
            pos += nbytes
        if pos != size:
            raise bad(f"{size - pos} bytes after the last tensor")
        return entries, meta

    def _read_at(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self._readinto_at(offset, memoryview(buf))
        return bytes(buf)

    def _readinto_at(self, offset: int, view: memoryview) -> None:
        # positional reads: no shared file position
        done, fd = 0, self._f.fileno()
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if not got:
                raise AggregationError(f"{self.path}: truncated at byte {offset + done}")
            done += got

    def spec(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of ``key`` without reading its data."""
        shape, dtype, _, _ = self._entries[key]
        return shape, dtype

    def __getitem__(self, key: str) -> torch.Tensor:
        shape, dtype, offset, nbytes = self._entries[key]
        out = torch.empty(shape, dtype=dtype)
        if nbytes:
            self._readinto_at(offset, memoryview(out.reshape(-1).view(torch.uint8).numpy()))
        return out

    def offset(self, key: str) -> int:
        """Where ``key``'s bytes start in the file."""
        return self._entries[key][2]

    def view(self, key: str, start: int, count: int) -> torch.Tensor:
        """Elements ``[start, start + count)`` of ``key`` (flattened), as a 1-D view
        of a mapped window of the file -- no copy.

        The window (about :attr:`window_bytes`, reused while requests fall
        inside it, so read tensors in file order) stays mapped while a view of
        it lives; at most the current window is held by the stream itself. The
        file must not be truncated while it is read (blobs are immutable).
        """
        _, dtype, offset, nbytes = self._entries[key]
        if start < 0 or count < 0 or (start + count) * dtype.itemsize > nbytes:
            raise IndexError(f"{key!r}: elements {start}..{start + count} out of range")
        lo = offset + start * dtype.itemsize
        hi = lo + count * dtype.itemsize
        w = self._window
        if w is None or lo < w[0] or hi > w[1]:
            base = lo - lo % mmap.ALLOCATIONGRANULARITY
            length = max(min(self.window_bytes, self._size - base), hi - base)
            w = self._window = (base, base + length, mmap.mmap(self._f.fileno(), length, offset=base,
                                                               access=mmap.ACCESS_COPY))  # never written
        return torch.frombuffer(w[2], dtype=dtype, count=count, offset=lo - w[0])

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._window = None
        self._f.close()

    def __enter__(self) -> SafetensorsStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SafetensorsLoader:
    """A loader (``SafetensorsLoader(path)()`` opens a :class:`SafetensorsStream`).
    When every input of :func:`weighted_average` is one of these, it reads all
    inputs side by side, chunk by chunk (see there)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)

    def __call__(self) -> SafetensorsStream:
        return SafetensorsStream(self.path)

    def __repr__(self) -> str:
        return f"SafetensorsLoader({self.path!r})"


def safetensors_loader(path: str | os.PathLike) -> SafetensorsLoader:
    """A loader for :func:`weighted_average` that streams ``path``."""
    return SafetensorsLoader(path)
