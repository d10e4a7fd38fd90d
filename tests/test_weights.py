"""Safetensors weight sets: round trips, every rejection, no pickle."""
from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import save as st_save

from atdnode.blobs import BlobStore
from atdnode.errors import BlobError, WeightsError
from atdnode.models import WeightsBlobError, load_weights, read_meta, save_weights


@pytest.fixture
def store(tmp_path):
    return BlobStore(tmp_path / "blobs")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "blocks.0.attn.qkv.weight": torch.randn(12, 4, generator=g),
        "cls_token": torch.randn(1, 1, 4, generator=g, dtype=torch.float64),
        "half": torch.randn(3, generator=g).to(torch.float16),
        "bf": torch.randn(2, 2, generator=g).to(torch.bfloat16),
        "steps": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False]),
    }


def _expect(ts: dict[str, torch.Tensor]) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in ts.items()}


def test_roundtrip(store):
    ts = _tensors()
    meta = {"part": "extractor", "labels": ["a", "b"], "samples": 10}
    h = save_weights(store, ts, meta)
    out, got_meta = load_weights(store, h, expect=_expect(ts))
    assert got_meta == meta and read_meta(store, h) == meta
    assert set(out) == set(ts)
    for k in ts:
        assert out[k].dtype == ts[k].dtype and torch.equal(out[k], ts[k])
    out["cls_token"].add_(1)  # loaded tensors are ordinary writable tensors


def test_deterministic_and_dtype_names(store):
    ts = _tensors()
    h = save_weights(store, ts, {"b": 1, "a": 2})
    assert save_weights(store, ts, {"a": 2, "b": 1}) == h
    expect = {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in ts.items()}
    load_weights(store, h, expect=expect)


def test_views_shared_storage_grad_and_noncontiguous(store):
    w = torch.randn(4, 6, requires_grad=True)
    ts = {"w": w, "tied": w, "half": w[:2], "t": w.t(), "empty": torch.zeros(0, 3)}
    h = save_weights(store, ts, {})
    out, meta = load_weights(store, h)
    assert meta == {}
    for k, v in ts.items():
        assert torch.equal(out[k], v.detach()), k


def test_foreign_safetensors_without_meta(store):
    h = store.put_bytes(st_save({"x": torch.ones(2)}))
    out, meta = load_weights(store, h)
    assert meta == {} and read_meta(store, h) == {} and torch.equal(out["x"], torch.ones(2))


def test_save_rejects_bad_input(store):
    with pytest.raises(WeightsError, match="not a tensor"):
        save_weights(store, {"x": [1.0]}, {})
    with pytest.raises(WeightsError, match="non-empty strings"):
        save_weights(store, {1: torch.ones(1)}, {})
    with pytest.raises(WeightsError, match="not JSON"):
        save_weights(store, {"x": torch.ones(1)}, {"t": torch.ones(1)})
    with pytest.raises(WeightsError, match="not JSON"):
        save_weights(store, {"x": torch.ones(1)}, {"lr": float("nan")})
    with pytest.raises(WeightsError, match="mapping"):
        save_weights(store, [torch.ones(1)], {})
    with pytest.raises(WeightsError, match="dense"):
        save_weights(store, {"s": torch.eye(3).to_sparse()}, {})
    assert store.list() == []


def test_missing_extra_shape_dtype_each_named(store):
    ts = {"a": torch.zeros(2, 3), "b": torch.zeros(4), "extra1": torch.zeros(1)}
    h = save_weights(store, ts, {})
    expect = {"a": ((3, 2), torch.float32), "b": ((4,), torch.float16), "gone": ((1,), torch.float32)}
    with pytest.raises(WeightsError) as ei:
        load_weights(store, h, expect=expect)
    msg = str(ei.value)
    assert "missing keys: 'gone'" in msg
    assert "extra keys: 'extra1'" in msg
    assert "'a' is (2, 3), expected (3, 2)" in msg
    assert "'b' is torch.float32, expected torch.float16" in msg


@pytest.mark.parametrize("bad,what", [(float("nan"), "1 NaN and 0 inf"), (float("inf"), "0 NaN and 1 inf"),
                                      (float("-inf"), "0 NaN and 1 inf")])
def test_non_finite_named(store, bad, what):
    t = torch.zeros(3, 3)
    t[1, 2] = bad
    h = save_weights(store, {"ok": torch.ones(2), "head.weight": t, "ints": torch.arange(3)}, {})
    with pytest.raises(WeightsError, match=f"'head.weight' has {what} values"):
        load_weights(store, h)


def test_non_finite_half_precision(store):
    h = save_weights(store, {"h": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)}, {})
    with pytest.raises(WeightsError, match="'h' has 1 NaN"):
        load_weights(store, h)


def test_corrupt_blob_is_both_weights_and_blob_error(store):
    h = save_weights(store, _tensors(), {"x": 1})
    p = store.path(h)
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0x10
    p.write_bytes(bytes(raw))
    with pytest.raises(WeightsBlobError, match="corrupt") as ei:
        load_weights(store, h)
    assert isinstance(ei.value, BlobError) and isinstance(ei.value, WeightsError)


def test_truncated_blob(store):
    h = save_weights(store, _tensors(), {})
    with open(store.path(h), "r+b") as f:
        f.truncate(50)
    with pytest.raises(WeightsBlobError, match="corrupt"):
        load_weights(store, h)


def test_absent_blob_and_bad_name(store):
    with pytest.raises(WeightsBlobError, match="not in the store"):
        load_weights(store, "a" * 64)
    with pytest.raises(WeightsBlobError, match="not in the store"):
        read_meta(store, "a" * 64)
    with pytest.raises(WeightsBlobError, match="not a blob hash"):
        load_weights(store, "nope")


def test_truncated_safetensors_stored_as_valid_blob(store):
    data = st_save(_tensors())
    h = store.put_bytes(data[:-7])  # hashes fine, but the safetensors payload is cut
    with pytest.raises(WeightsError, match="not a safetensors weight set"):
        load_weights(store, h)


@pytest.mark.parametrize("raw", [b"", b"garbage bytes that are not safetensors", b"\xff" * 8 + b"{}",
                                 (5).to_bytes(8, "little") + b"nojso"])
def test_garbage_not_safetensors(store, raw):
    h = store.put_bytes(raw)
    with pytest.raises(WeightsError, match="not a safetensors weight set"):
        load_weights(store, h)
    with pytest.raises(WeightsError, match="not a safetensors weight set"):
        read_meta(store, h)


class _Evil:
    def __reduce__(self):
        return (exec, ("import atdnode; atdnode.PWNED = True",))


def test_pickle_is_never_unpickled(store):
    import atdnode
    h = store.put_bytes(pickle.dumps({"w": _Evil()}))
    with pytest.raises(WeightsError, match="not a safetensors weight set"):
        load_weights(store, h)
    assert not hasattr(atdnode, "PWNED")


@pytest.mark.parametrize("meta_raw,msg", [("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object")])
def test_bad_metadata(store, meta_raw, msg):
    h = store.put_bytes(st_save({"x": torch.ones(1)}, metadata={"atd": meta_raw}))
    with pytest.raises(WeightsError, match=msg):
        load_weights(store, h)
    with pytest.raises(WeightsError, match=msg):
        read_meta(store, h)


def test_meta_is_json_in_header(store):
    h = save_weights(store, {"x": torch.ones(1)}, {"k": [1, "two"]})
    raw = store.get_bytes(h)
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert json.loads(header["__metadata__"]["atd"]) == {"k": [1, "two"]}


def test_non_finite_mixed_and_complex(store):
    t = torch.ones(100)
    t[3], t[7], t[9] = float("nan"), float("inf"), float("-inf")
    c = torch.zeros(3, dtype=torch.complex64)
    c[1] = complex(0.0, float("inf"))
    h = save_weights(store, {"mixed": t, "c": c, "fine": torch.zeros(0)}, {})
    with pytest.raises(WeightsError) as ei:
        load_weights(store, h)
    assert "'mixed' has 1 NaN and 2 inf values" in str(ei.value)
    assert "'c' has 0 NaN and 1 inf values" in str(ei.value)
