"""Tensor frames: round trips, every validation failure, stream framing."""
from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.tensor_frames import MAGIC, FrameDecodeError, FrameEncodeError, decode_frame, encode_frame

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


def _rebuild(header: dict, payload: bytes) -> bytes:
    h = msgpack.packb(header, use_bin_type=True)
    return MAGIC + len(h).to_bytes(4, "big") + h + payload


def _split(frame: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(frame[4:8], "big")
    return msgpack.unpackb(frame[8:8 + n], raw=False), frame[8 + n:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_every_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 4, 5, generator=g) * 50).to(dtype)
    f = decode_frame(encode_frame({"a": t, "scalar": t.reshape(-1)[0].clone(), "empty": t[:0]},
                                  {"k": 1}))
    assert f.meta == {"k": 1}
    assert list(f.tensors) == ["a", "scalar", "empty"]
    assert f.tensors["a"].dtype == dtype and torch.equal(f.tensors["a"], t)
    assert f.tensors["scalar"].shape == () and f.tensors["empty"].shape == (0, 4, 5)
    assert f.payload_bytes == (t.numel() + 1) * t.element_size()
    f.tensors["a"].add_(1) if dtype != torch.bool else None  # decoded tensors own writable memory


def test_sequence_single_tensor_and_noncontiguous():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous
    assert torch.equal(decode_frame(encode_frame(x)).tensors["0"], x)
    f = decode_frame(encode_frame([x, x + 1]))
    assert list(f.tensors) == ["0", "1"] and torch.equal(f.tensors["1"], x + 1)
    assert decode_frame(encode_frame(None, {"only": "meta"})).tensors == {}


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(0, 4), max_size=4),
       meta=st.dictionaries(st.text(max_size=5), st.one_of(st.integers(-2**40, 2**40), st.text(max_size=8),
                                                           st.booleans(), st.none()), max_size=4))
def test_roundtrip_property(shape, meta):
    t = torch.randn(shape) if shape else torch.randn(())
    f = decode_frame(encode_frame({"x": t}, meta))
    assert f.meta == meta and torch.equal(f.tensors["x"], t)


def test_encode_errors():
    with pytest.raises(FrameEncodeError, match="unsupported dtype"):
        encode_frame({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(FrameEncodeError, match="unsupported type"):
        encode_frame({}, {"obj": object()})
    with pytest.raises(FrameEncodeError, match="not a torch.Tensor"):
        encode_frame({"a": [1, 2]})
    with pytest.raises(FrameEncodeError, match="max"):
        encode_frame({"a": torch.zeros(1000)}, max_bytes=100)


def test_decode_rejects_unknown_dtype():
    h, p = _split(encode_frame({"a": torch.zeros(2)}))
    h["tensors"][0]["dtype"] = "pickle"
    with pytest.raises(FrameDecodeError, match="unknown dtype 'pickle'"):
        decode_frame(_rebuild(h, p))


def test_decode_rejects_shape_nbytes_mismatch():
    h, p = _split(encode_frame({"a": torch.zeros(2, 3)}))
    h["tensors"][0]["shape"] = [3, 3]
    with pytest.raises(FrameDecodeError, match="needs 36 bytes, header says 24"):
        decode_frame(_rebuild(h, p))
    h["tensors"][0]["shape"] = [-1, 6]
    with pytest.raises(FrameDecodeError, match="non-negative"):
        decode_frame(_rebuild(h, p))


def test_decode_rejects_truncated_and_trailing():
    fr = encode_frame({"a": torch.ones(10)})
    with pytest.raises(FrameDecodeError, match="truncated frame: payload"):
        decode_frame(fr[:-1])
    with pytest.raises(FrameDecodeError, match="truncated frame: header"):
        decode_frame(fr[:12])
    with pytest.raises(FrameDecodeError, match="trailing"):
        decode_frame(fr + b"\0")
    with pytest.raises(FrameDecodeError, match="bad magic"):
        decode_frame(b"PK\x03\x04" + fr[4:])
    with pytest.raises(FrameDecodeError, match="shorter than 8"):
        decode_frame(b"ATF")


def test_decode_rejects_oversized():
    fr = encode_frame({"a": torch.ones(100)})
    with pytest.raises(FrameDecodeError, match="over the limit"):
        decode_frame(fr, max_bytes=len(fr) - 1)
    bad = MAGIC + (10 << 20).to_bytes(4, "big") + b"\x80"
    with pytest.raises(FrameDecodeError, match="header length"):
        decode_frame(bad)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_policy(value):
    t = torch.tensor([1.0, value])
    fr = encode_frame({"g": t})
    with pytest.raises(FrameDecodeError, match="'g' contains NaN or inf"):
        decode_frame(fr)
    out = decode_frame(fr, nonfinite="allow").tensors["g"]
    assert out[0] == 1.0 and (torch.isnan(out[1]) if value != value else out[1] == value)


def test_decode_rejects_bad_header_structures():
    with pytest.raises(FrameDecodeError, match="not valid msgpack"):
        decode_frame(MAGIC + (2).to_bytes(4, "big") + b"\xc1\xc1")
    with pytest.raises(FrameDecodeError, match="exactly v, meta, tensors"):
        decode_frame(_rebuild({"v": 1, "meta": {}, "tensors": [], "x": 1}, b""))
    with pytest.raises(FrameDecodeError, match="version"):
        decode_frame(_rebuild({"v": 2, "meta": {}, "tensors": []}, b""))
    with pytest.raises(FrameDecodeError, match="duplicate"):
        d = {"name": "a", "dtype": "uint8", "shape": [1], "nbytes": 1}
        decode_frame(_rebuild({"v": 1, "meta": {}, "tensors": [d, d]}, b"\0\0"))
    with pytest.raises(FrameDecodeError, match="bool bytes"):
        d = {"name": "b", "dtype": "bool", "shape": [1], "nbytes": 1}
        decode_frame(_rebuild({"v": 1, "meta": {}, "tensors": [d]}, b"\x07"))
    with pytest.raises(FrameDecodeError, match="unsupported type"):
        ext = msgpack.packb({"v": 1, "meta": {"e": msgpack.ExtType(5, b"x")}, "tensors": []})
        decode_frame(MAGIC + len(ext).to_bytes(4, "big") + ext)
