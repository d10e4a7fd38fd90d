"""Tensor frames: the wire form of tensors between split-learning peers. Never pickle.

A frame carries zero or more named tensors plus a small msgpack ``meta`` map::

    b"ATF1" | header_len: uint32 big-endian | header: msgpack | payload: raw bytes

    header = {"v": 1, "meta": {...}, "tensors": [{"name", "dtype", "shape", "nbytes"}, ...]}

The payload is the tensors' little-endian element bytes, concatenated in header order.
Decoding is strict: an unknown dtype, a shape that disagrees with ``nbytes``, a payload
shorter or longer than the header says, a frame over ``max_bytes``, duplicate names,
meta values other than plain msgpack types, or (by default) a NaN/inf in a floating
tensor all raise :class:`FrameDecodeError` naming the fault. Nothing executable is ever
decoded: msgpack with ``strict_map_key`` and a whitelist of value types, and raw buffers.

Streams carry frames with a 4-byte big-endian length prefix (the transport's
``read_frame`` / ``write_frame``), because a stream read returns whatever is buffered.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import numpy as np
import torch

MAGIC = b"ATF1"
VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 256 << 20  # 256 MiB: a ViT-B batch of features fits, a runaway sender does not
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 4096
MAX_NDIM = 8
LENGTH_PREFIX_BYTES = 4

# name -> (torch dtype, same-size integer torch dtype used to move raw bits, little-endian numpy dtype)
_DTYPES: dict[str, tuple[torch.dtype, torch.dtype, str]] = {
    "float32": (torch.float32, torch.int32, "<i4"),
    "float64": (torch.float64, torch.int64, "<i8"),
    "float16": (torch.float16, torch.int16, "<i2"),
    "bfloat16": (torch.bfloat16, torch.int16, "<i2"),
    "int64": (torch.int64, torch.int64, "<i8"),
    "int32": (torch.int32, torch.int32, "<i4"),
    "int16": (torch.int16, torch.int16, "<i2"),
    "int8": (torch.int8, torch.int8, "|i1"),
    "uint8": (torch.uint8, torch.uint8, "|u1"),
    "bool": (torch.bool, torch.uint8, "|u1"),
}
_NAME_OF = {v[0]: k for k, v in _DTYPES.items()}
_FLOATS = {"float32", "float64", "float16", "bfloat16"}


class FrameError(ValueError):
    """Base of tensor-frame errors."""


class FrameEncodeError(FrameError):
    """Something cannot be put in a frame (unsupported dtype, meta type, too large)."""


class FrameDecodeError(FrameError):
    """Received bytes are not a valid frame; the message says which check failed."""


@dataclass
class Frame:
    """A decoded frame: ``meta`` (plain msgpack values) and ``tensors`` in wire order."""

    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def payload_bytes(self) -> int:
        """Sum of the tensors' raw byte sizes (what the paper's formulas count)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _check_meta(value: Any, where: str, encode: bool, depth: int = 0) -> None:
    err = FrameEncodeError if encode else FrameDecodeError
    if depth > 16:
        raise err(f"meta nested deeper than 16 levels at {where}")
    if value is None or type(value) in (bool, int, float, str, bytes):
        return
    if type(value) in (list, tuple):  # exact: msgpack.ExtType is a tuple subclass
        for i, v in enumerate(value):
            _check_meta(v, f"{where}[{i}]", encode, depth + 1)
        return
    if type(value) is dict:
        for k, v in value.items():
            if not isinstance(k, str):
                raise err(f"meta key {k!r} at {where} is not a string")
            _check_meta(v, f"{where}.{k}", encode, depth + 1)
        return
    raise err(f"meta value at {where} has unsupported type {type(value).__name__}")


def _as_named(tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | torch.Tensor | None
              ) -> list[tuple[str, torch.Tensor]]:
    if tensors is None:
        return []
    if isinstance(tensors, torch.Tensor):
        return [("0", tensors)]
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    return [(str(i), t) for i, t in enumerate(tensors)]


def _raw_le_bytes(t: torch.Tensor, bits: torch.dtype, np_dtype: str) -> bytes:
    arr = t.detach().cpu().contiguous().view(bits).numpy()
    if sys.byteorder != "little" and arr.dtype.itemsize > 1:
        arr = arr.byteswap()
    return np.ascontiguousarray(arr).tobytes()


def encode_frame(tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | torch.Tensor | None = None,
                 meta: Mapping[str, Any] | None = None, *,
                 max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Encode named tensors (a mapping, a sequence -> names "0", "1", ..., or one tensor -> "0")
    and a plain-msgpack ``meta`` map into one frame. Raises FrameEncodeError."""
    meta = dict(meta or {})
    _check_meta(meta, "meta", encode=True)
    named = _as_named(tensors)
    if len(named) > MAX_TENSORS:
        raise FrameEncodeError(f"{len(named)} tensors exceed the limit of {MAX_TENSORS}")
    descs, parts, seen = [], [], set()
    for name, t in named:
        if not isinstance(name, str) or name in seen:
            raise FrameEncodeError(f"tensor name {name!r} is not a unique string")
        seen.add(name)
        if not isinstance(t, torch.Tensor):
            raise FrameEncodeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        dname = _NAME_OF.get(t.dtype)
        if dname is None:
            raise FrameEncodeError(f"{name!r} has unsupported dtype {t.dtype}")
        if t.dim() > MAX_NDIM:
            raise FrameEncodeError(f"{name!r} has {t.dim()} dims (max {MAX_NDIM})")
        _, bits, np_dtype = _DTYPES[dname]
        raw = _raw_le_bytes(t, bits, np_dtype)
        descs.append({"name": name, "dtype": dname, "shape": list(t.shape), "nbytes": len(raw)})
        parts.append(raw)
    header = msgpack.packb({"v": VERSION, "meta": meta, "tensors": descs}, use_bin_type=True)
    if len(header) > MAX_HEADER_BYTES:
        raise FrameEncodeError(f"frame header is {len(header)} bytes (max {MAX_HEADER_BYTES})")
    frame = b"".join([MAGIC, len(header).to_bytes(4, "big"), header, *parts])
    if len(frame) > max_bytes:
        raise FrameEncodeError(f"frame is {len(frame)} bytes (max {max_bytes})")
    return frame


def _parse_desc(d: Any, i: int) -> tuple[str, str, list[int], int]:
    if not isinstance(d, dict) or set(d) != {"name", "dtype", "shape", "nbytes"}:
        raise FrameDecodeError(f"tensor #{i}: descriptor must be a map of name, dtype, shape, nbytes")
    name, dname, shape, nbytes = d["name"], d["dtype"], d["shape"], d["nbytes"]
    if not isinstance(name, str):
        raise FrameDecodeError(f"tensor #{i}: name is not a string")
    if dname not in _DTYPES:
        raise FrameDecodeError(f"tensor {name!r}: unknown dtype {dname!r}")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise FrameDecodeError(f"tensor {name!r}: shape {shape!r} is not a list of <= {MAX_NDIM} "
                               "non-negative ints")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise FrameDecodeError(f"tensor {name!r}: nbytes {nbytes!r} is not a non-negative int")
    itemsize = np.dtype(_DTYPES[dname][2]).itemsize
    if math.prod(shape) * itemsize != nbytes:
        raise FrameDecodeError(f"tensor {name!r}: shape {shape} of {dname} needs "
                               f"{math.prod(shape) * itemsize} bytes, header says {nbytes}")
    return name, dname, shape, nbytes


def decode_frame(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 nonfinite: Literal["reject", "allow"] = "reject") -> Frame:
    """Decode and validate one frame (without length prefix). Raises FrameDecodeError.

    ``nonfinite="reject"`` (default) refuses NaN/inf in floating tensors; the returned
    tensors own their memory (safe to modify)."""
    mv = memoryview(data).cast("B")
    if len(mv) > max_bytes:
        raise FrameDecodeError(f"frame is {len(mv)} bytes, over the limit of {max_bytes}")
    if len(mv) < 8 or bytes(mv[:4]) != MAGIC:
        raise FrameDecodeError("not a tensor frame (bad magic or shorter than 8 bytes)")
    hlen = int.from_bytes(mv[4:8], "big")
    if hlen > MAX_HEADER_BYTES:
        raise FrameDecodeError(f"header length {hlen} over the limit of {MAX_HEADER_BYTES}")
    if 8 + hlen > len(mv):
        raise FrameDecodeError(f"truncated frame: header needs {hlen} bytes, {len(mv) - 8} present")
    try:
        header = msgpack.unpackb(bytes(mv[8:8 + hlen]), raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise FrameDecodeError(f"header is not valid msgpack: {e}") from None
    if not isinstance(header, dict) or set(header) != {"v", "meta", "tensors"}:
        raise FrameDecodeError("header must be a map with exactly v, meta, tensors")
    if header["v"] != VERSION:
        raise FrameDecodeError(f"unsupported frame version {header['v']!r}")
    meta, descs = header["meta"], header["tensors"]
    if not isinstance(meta, dict):
        raise FrameDecodeError("meta is not a map")
    _check_meta(meta, "meta", encode=False)
    if not isinstance(descs, list) or len(descs) > MAX_TENSORS:
        raise FrameDecodeError(f"tensors must be a list of at most {MAX_TENSORS} descriptors")
    parsed = [_parse_desc(d, i) for i, d in enumerate(descs)]
    names = [p[0] for p in parsed]
    if len(set(names)) != len(names):
        raise FrameDecodeError("duplicate tensor names")
    payload = mv[8 + hlen:]
    need = sum(p[3] for p in parsed)
    if len(payload) < need:
        raise FrameDecodeError(f"truncated frame: payload has {len(payload)} bytes, header says {need}")
    if len(payload) > need:
        raise FrameDecodeError(f"{len(payload) - need} trailing bytes after the payload")
    out: dict[str, torch.Tensor] = {}
    off = 0
    for name, dname, shape, nbytes in parsed:
        tdtype, bits, np_dtype = _DTYPES[dname]
        arr = np.frombuffer(payload[off:off + nbytes], dtype=np_dtype).astype(np_dtype[1:], copy=True)
        off += nbytes
        t = torch.from_numpy(arr).view(bits)
        if dname == "bool":
            if t.numel() and int(t.max()) > 1:
                raise FrameDecodeError(f"tensor {name!r}: bool bytes other than 0/1")
        t = t.view(tdtype).reshape(shape)
        if dname in _FLOATS and nonfinite == "reject" and t.numel() and not bool(torch.isfinite(t).all()):
            raise FrameDecodeError(f"tensor {name!r} contains NaN or inf")
        out[name] = t
    return Frame(meta=meta, tensors=out)
