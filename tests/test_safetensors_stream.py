"""The one parser of peers' weight bytes (`protocols.safetensors_stream`): a file made by the
reference implementation reads back exactly; a header that lies about its data — overlapping
or gapped ranges, trailing bytes, duplicate keys, extra fields — is refused with
AggregationError; and no byte-level corruption makes it raise anything else (fuzzed)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from protocols.weightings import AggregationError
from protocols.safetensors_stream import SafetensorsStream

TENSORS = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.float16),
           "c": torch.tensor([1, -2], dtype=torch.int64)}


def _reference(tmp_path: Path) -> Path:
    p = tmp_path / "w.safetensors"
    save_file(TENSORS, str(p), metadata={"part": "extractor"})
    return p


def _craft(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_a_reference_file_reads_back_exactly(tmp_path):
    with SafetensorsStream(_reference(tmp_path)) as s:
        assert set(s) == set(TENSORS) and s.metadata == {"part": "extractor"}
        for k, v in TENSORS.items():
            assert torch.equal(s[k], v) and s.spec(k) == (tuple(v.shape), v.dtype)


@pytest.mark.parametrize("header, data, why", [
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "overlaps"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "y": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, bytes(12), "gap"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(8), "after the last tensor"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4), "do not fit"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}}, bytes(4), "bad dtype"),
    ({"x": {"dtype": "Q8", "shape": [1], "data_offsets": [0, 1]}}, bytes(1), "bad dtype"),
    ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", "do not fit"),
    ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
    ({"x": {"dtype": "F32", "shape": [0, 1 << 63], "data_offsets": [0, 0]}}, b"", "extent of 2"),
    ({"x": {"dtype": "F32", "shape": [0, 1 << 40, 1 << 30], "data_offsets": [0, 0]}}, b"", "extent of 2"),
    ({"x": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}, bytes(4), "65|dimensions"),
])
def test_a_lying_header_is_refused(tmp_path, header, data, why):
    with pytest.raises(AggregationError, match=why):
        SafetensorsStream(_craft(tmp_path / "bad", header, data))


def test_a_zero_size_tensor_with_a_huge_dimension_never_reaches_aggregation(tmp_path):
    """The file is refused at header parse, so `weighted_average` over it raises the typed
    error too (not torch's TypeError / ValueError from an extent beyond int64)."""
    from protocols.aggregation import weighted_average
    from protocols.safetensors_stream import safetensors_loader

    bad = _craft(tmp_path / "huge", {"x": {"dtype": "F32", "shape": [1 << 63, 0], "data_offsets": [0, 0]}}, b"")
    good = _craft(tmp_path / "ok", {"x": {"dtype": "F32", "shape": [0, 1], "data_offsets": [0, 0]}}, b"")
    with pytest.raises(AggregationError, match="extent"):
        weighted_average([safetensors_loader(good), safetensors_loader(bad)], [0.5, 0.5])


def test_two_tensors_sharing_bytes_are_refused_even_when_sizes_add_up(tmp_path):
    # both name bytes 0..8: each range fits the file, only the overlap check catches it
    h = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "y": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    with pytest.raises(AggregationError, match="overlaps"):
        SafetensorsStream(_craft(tmp_path / "bad", h, bytes(8)))


def test_duplicate_keys_in_the_header_are_refused(tmp_path):
    one = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    raw = ('{"x": %s, "x": %s}' % (one, one)).encode()
    p = tmp_path / "dup"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))
    with pytest.raises(AggregationError, match="duplicate key"):
        SafetensorsStream(p)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzzed_bytes_give_a_tensor_or_an_aggregation_error(tmp_path, data):
    good = _reference(tmp_path).read_bytes()
    raw = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if kind == "flip" and raw:
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "cut":
            del raw[pos:pos + data.draw(st.integers(1, 16))]
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    p = tmp_path / "fuzz.safetensors"
    p.write_bytes(bytes(raw))
    try:
        s = SafetensorsStream(p)
    except AggregationError:
        return
    with s:  # accepted: every tensor reads in full, and only bytes inside the file are named
        for k in s:
            shape, dtype = s.spec(k)
            assert s[k].shape == torch.Size(shape) and s[k].dtype == dtype
