"""Weightings (known answers), streaming weighted average, safetensors streaming."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import protocols.aggregation as agg
from protocols.aggregation import (AggregationError, SafetensorsStream, check_weights, compute_weights,
                                   fedwavg_weights, last_layer_key, load_tensor, model_count_weights,
                                   part_filter, safetensors_loader, sample_weights, sqrt_class_weights,
                                   uniform_weights, weighted_average)


# ------------------------------------------------------------ weightings

def test_uniform_known_answer():
    assert uniform_weights(4).tolist() == [0.25, 0.25, 0.25, 0.25]
    assert uniform_weights(4).dtype == np.float64


def test_samples_known_answer():
    np.testing.assert_allclose(sample_weights([10, 30]), [0.25, 0.75], rtol=0, atol=1e-15)
    np.testing.assert_allclose(sample_weights([0, 5, 5]), [0.0, 0.5, 0.5], rtol=0, atol=1e-15)


def test_sqrt_classes_known_answer():
    # sqrt([4, 9, 1]) = [2, 3, 1]; / 6
    np.testing.assert_allclose(sqrt_class_weights([4, 9, 1]), [1 / 3, 1 / 2, 1 / 6], rtol=0, atol=1e-15)
    # the paper's 3-group example shape: 3 and 4 classes
    np.testing.assert_allclose(sqrt_class_weights([3, 4]),
                               [math.sqrt(3) / (math.sqrt(3) + 2), 2 / (math.sqrt(3) + 2)], atol=1e-15)


def test_model_count_known_answer():
    np.testing.assert_allclose(model_count_weights([2, 6]), [0.25, 0.75], rtol=0, atol=1e-15)
    np.testing.assert_allclose(model_count_weights([1, 1, 2]), [0.25, 0.25, 0.5], rtol=0, atol=1e-15)


def test_fedwavg_known_answer():
    ref = torch.tensor([1.0, 0.0])
    layers = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([-1.0, 0.0])]
    # cos = [1, 0, -1]; softmax: e^1, e^0, e^-1 over 4.0861612696...
    expect = [0.6652409557748219, 0.24472847105479764, 0.09003057317038046]
    np.testing.assert_allclose(fedwavg_weights(ref, layers, q=1.0), expect, rtol=1e-12)
    # q scales the logits: q=2 -> softmax(2, 0, -2)
    e = np.exp([2.0, 0.0, -2.0])
    np.testing.assert_allclose(fedwavg_weights(ref, layers, q=2.0), e / e.sum(), rtol=1e-12)
    # q = 0 is uniform; cosine ignores scale; numpy arrays and 2-D layers work
    np.testing.assert_allclose(fedwavg_weights(ref, layers, q=0.0), [1 / 3] * 3, rtol=1e-12)
    np.testing.assert_allclose(fedwavg_weights(np.array([[2.0, 0.0]]), [np.array([[5.0, 0.0]]), np.array([[0, 3.0]])]),
                               [math.e / (math.e + 1), 1 / (math.e + 1)], rtol=1e-12)


def test_compute_weights_dispatch():
    np.testing.assert_allclose(compute_weights("uniform", n=2), [0.5, 0.5])
    np.testing.assert_allclose(compute_weights("samples", counts=[1, 3]), [0.25, 0.75])
    np.testing.assert_allclose(compute_weights("sqrt-classes", counts=[4, 16]), [1 / 3, 2 / 3])
    np.testing.assert_allclose(compute_weights("model-count", counts=[3, 1]), [0.75, 0.25])
    w = compute_weights("fedwavg", reference=[1.0, 0.0], layers=[[1.0, 0.0], [0.0, 1.0]], q=3.0)
    np.testing.assert_allclose(w, [math.exp(3) / (math.exp(3) + 1), 1 / (math.exp(3) + 1)])
    assert set(agg.WEIGHTINGS) == {"uniform", "samples", "sqrt-classes", "model-count", "fedwavg"}


def test_one_weighting_table_for_node_inputs_and_groups():
    """What each weighting counts is said once (agg.COUNTED); the node's input weights and the
    hierarchical group weights read their counts by that name."""
    from types import SimpleNamespace

    from atdnode.aggregation.aggregate import ENTRY_COUNTS
    from protocols.hierarchical import group_weights

    assert {w: agg.counted_quantity(w) for w in agg.WEIGHTINGS} == {
        "uniform": None, "samples": "samples", "sqrt-classes": "classes", "model-count": "models", "fedwavg": None}
    with pytest.raises(AggregationError, match="unknown weighting"):
        agg.counted_quantity("median")
    entries = [SimpleNamespace(body={"samples": 30, "labels": ["a", "b", "c", "d"]}),
               SimpleNamespace(body={"samples": 10, "labels": ["a"] * 16})]
    assert [ENTRY_COUNTS["samples"](e) for e in entries] == [30, 10]
    assert [ENTRY_COUNTS["classes"](e) for e in entries] == [4, 16]
    groups = [SimpleNamespace(n_classes=4, n_models=3), SimpleNamespace(n_classes=16, n_models=1)]
    np.testing.assert_allclose(group_weights(groups, "sqrt-classes"), [1 / 3, 2 / 3])
    np.testing.assert_allclose(group_weights(groups, "model-count"), [0.75, 0.25])


@pytest.mark.parametrize("fn, arg", [
    (sample_weights, []), (sample_weights, [1, -1]), (sample_weights, [1, float("nan")]),
    (sample_weights, [0, 0]), (sqrt_class_weights, [3, float("inf")]), (model_count_weights, [[1, 2]]),
    (model_count_weights, ["x"]), (uniform_weights, 0), (uniform_weights, True), (uniform_weights, 2.5),
])
def test_bad_counts_rejected(fn, arg):
    with pytest.raises(AggregationError):
        fn(arg)
    assert issubclass(AggregationError, ValueError)


def test_fedwavg_rejects_bad_layers():
    with pytest.raises(AggregationError, match="non-zero norm"):
        fedwavg_weights([1.0, 0.0], [[0.0, 0.0]])
    with pytest.raises(AggregationError, match="elements"):
        fedwavg_weights([1.0, 0.0], [[1.0, 0.0, 0.0]])
    with pytest.raises(AggregationError, match="finite"):
        fedwavg_weights([1.0, 0.0], [[float("nan"), 1.0]])
    with pytest.raises(AggregationError):
        fedwavg_weights([1.0, 0.0], [])
    with pytest.raises(AggregationError, match="q"):
        fedwavg_weights([1.0, 0.0], [[1.0, 0.0]], q=float("inf"))
    with pytest.raises(AggregationError, match="unknown weighting"):
        compute_weights("median", n=2)
    with pytest.raises(AggregationError, match="needs counts"):
        compute_weights("samples")


def test_check_weights():
    np.testing.assert_array_equal(check_weights([0.5, 0.5], 2), [0.5, 0.5])
    for bad, n in [([0.5, 0.6], 2), ([1.5, -0.5], 2), ([0.5, 0.5], 3), ([], None), ([float("nan"), 1], 2)]:
        with pytest.raises(AggregationError):
            check_weights(bad, n)


def test_last_layer_key():
    keys = ["blocks.2.mlp.fc2.weight", "blocks.11.mlp.fc2.weight", "blocks.11.mlp.fc2.bias", "head.weight"]
    assert last_layer_key(keys, heads_comparable=True) == "head.weight"
    assert last_layer_key(keys, heads_comparable=False) == "blocks.11.mlp.fc2.weight"  # numeric, not lexical
    assert last_layer_key(keys[:2], heads_comparable=True) == "blocks.11.mlp.fc2.weight"
    with pytest.raises(AggregationError):
        last_layer_key(["norm.weight"], heads_comparable=False)


# ------------------------------------------------------------ averaging

def _model(seed: int, head: int = 3, dim: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"patch_embed.proj.weight": torch.randn(dim, 3, 2, 2, generator=g),
            "blocks.0.mlp.fc2.weight": torch.randn(dim, 4 * dim, generator=g),
            "norm.bias": torch.randn(dim, generator=g),
            "head.weight": torch.randn(head, dim, generator=g), "head.bias": torch.randn(head, generator=g)}


def _loader(d):
    return lambda: d


def test_average_known_answer():
    a = {"w": torch.tensor([1.0, 2.0, 4.0]), "b": torch.tensor([[0.0]])}
    b = {"w": torch.tensor([3.0, 6.0, 0.0]), "b": torch.tensor([[8.0]])}
    out = weighted_average([_loader(a), _loader(b)], [0.25, 0.75])
    assert list(out) == ["w", "b"]
    assert out["w"].tolist() == [2.5, 5.0, 1.0] and out["b"].tolist() == [[6.0]]
    assert out["w"].dtype == torch.float32


def test_arithmetic_contract_is_bit_exact():
    # acc = w0*x0; acc += w1*x1 ... each a separately rounded float32 operation
    models = [_model(s) for s in range(4)]
    w = sample_weights([3, 7, 11, 13])
    out = weighted_average([_loader(m) for m in models], w)
    for key in out:
        ref = np.float32(w[0]) * models[0][key].numpy()
        for m, wi in zip(models[1:], w[1:]):
            ref = ref + np.float32(wi) * m[key].numpy()
        assert np.array_equal(out[key].numpy(), ref), key


def test_order_invariance_and_accuracy():
    models = [_model(s) for s in range(5)]
    w = sample_weights([5, 1, 9, 2, 7])
    exact = {k: sum(float(wi) * m[k].double() for m, wi in zip(models, w)) for k in models[0]}
    base = weighted_average([_loader(m) for m in models], w)
    for perm in ([4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        out = weighted_average([_loader(models[i]) for i in perm], w[perm])
        for k in base:
            torch.testing.assert_close(out[k], base[k], rtol=1e-6, atol=1e-6)
    out64 = weighted_average([_loader(m) for m in models], w, accumulate_dtype=torch.float64)
    for k in base:
        assert (base[k].double() - exact[k]).abs().max() < 1e-5
        assert (out64[k].double() - exact[k]).abs().max() <= (base[k].double() - exact[k]).abs().max()
        assert out64[k].dtype == torch.float32


def test_one_input_in_memory_at_a_time():
    live: list[int] = []
    events: list[str] = []

    class Source(dict):
        def __init__(self, i):
            super().__init__(_model(i))
            self.i = i
            live.append(i)
            events.append(f"open {i}")

        def close(self):
            live.remove(self.i)
            events.append(f"close {self.i}")

    def loader(i):
        def load():
            assert live == [], f"input {i} loaded while {live} still open"
            return Source(i)
        return load

    weighted_average([loader(i) for i in range(3)], uniform_weights(3))
    assert events == ["open 0", "close 0", "open 1", "close 1", "open 2", "close 2"] and live == []


def test_key_filter_extractor_only_across_label_spaces():
    a, b = _model(0, head=3), _model(1, head=5)  # heads differ: label spaces differ
    with pytest.raises(AggregationError, match="head.weight"):
        weighted_average([_loader(a), _loader(b)], [0.5, 0.5])
    out = weighted_average([_loader(a), _loader(b)], [0.5, 0.5], key_filter=part_filter(include_head=False))
    assert set(out) == {"patch_embed.proj.weight", "blocks.0.mlp.fc2.weight", "norm.bias"}
    full = weighted_average([_loader(a), _loader(a)], [0.5, 0.5], key_filter=part_filter(include_head=True))
    assert "head.weight" in full


@pytest.mark.parametrize("mutate, match", [
    (lambda m: m.pop("norm.bias"), r"input 2 \(node-c\), key 'norm.bias': missing"),
    (lambda m: m.update(extra=torch.zeros(2)), r"input 2 \(node-c\), key 'extra': not present in input 0"),
    (lambda m: m.update({"norm.bias": torch.zeros(9)}), r"input 2 \(node-c\), key 'norm.bias': \(9,\)"),
    (lambda m: m.update({"norm.bias": torch.zeros(8, dtype=torch.float64)}), r"key 'norm.bias'.*float64"),
    (lambda m: m["head.bias"].__setitem__(1, float("nan")), r"input 2 \(node-c\), key 'head.bias': .*NaN"),
    (lambda m: m["blocks.0.mlp.fc2.weight"].__setitem__((0, 5), float("inf")),
     r"input 2 \(node-c\), key 'blocks.0.mlp.fc2.weight': .*infinity"),
    (lambda m: m.update({"norm.bias": [1.0] * 8}), r"input 2 \(node-c\), key 'norm.bias': value is not"),
])
def test_incompatible_input_named(mutate, match):
    models = [_model(s) for s in range(4)]
    mutate(models[2])
    with pytest.raises(AggregationError, match=match) as info:
        weighted_average([_loader(m) for m in models], uniform_weights(4), names=["a", "b", "node-c", "d"])
    assert info.value.index == 2 and info.value.name == "node-c"


def test_non_finite_found_even_with_zero_weight():
    models = [_model(s) for s in range(3)]
    models[1]["norm.bias"][0] = float("inf")
    with pytest.raises(AggregationError, match="input 1, key 'norm.bias'"):
        weighted_average([_loader(m) for m in models], [0.5, 0.0, 0.5])


def test_overflow_of_finite_inputs_reported():
    big = {"x": torch.full((3,), torch.finfo(torch.float32).max)}
    with pytest.raises(AggregationError, match="overflows"):
        weighted_average([_loader(big), _loader(big)], [0.5, 0.5 + 9e-7])  # within the sum tolerance


def test_bad_call_arguments():
    m = _model(0)
    with pytest.raises(AggregationError, match="2 weights"):
        weighted_average([_loader(m)] * 3, [0.5, 0.5])
    with pytest.raises(AggregationError, match="names"):
        weighted_average([_loader(m)] * 2, [0.5, 0.5], names=["x"])
    with pytest.raises(AggregationError, match="accumulate_dtype"):
        weighted_average([_loader(m)], [1.0], accumulate_dtype=torch.float16)
    with pytest.raises(AggregationError, match="not a mapping"):
        weighted_average([lambda: [1, 2]], [1.0])
    with pytest.raises(AggregationError, match="no tensors"):
        weighted_average([_loader(m)], [1.0], key_filter=lambda k: False)


def test_loader_error_gets_a_note():
    def broken():
        raise OSError("disk gone")
    with pytest.raises(OSError) as info:
        weighted_average([_loader(_model(0)), broken], [0.5, 0.5], names=["a", "b"])
    assert "aggregation input 1 (b)" in " ".join(info.value.__notes__)


def test_integer_tensors_pass_through_when_equal():
    a = {"w": torch.ones(2), "steps": torch.tensor([7])}
    b = {"w": torch.zeros(2), "steps": torch.tensor([7])}
    out = weighted_average([_loader(a), _loader(b)], [0.5, 0.5])
    assert out["steps"].tolist() == [7] and out["w"].tolist() == [0.5, 0.5]
    c = {"w": torch.zeros(2), "steps": torch.tensor([8])}
    with pytest.raises(AggregationError, match="input 1, key 'steps'"):
        weighted_average([_loader(a), _loader(c)], [0.5, 0.5])


def test_stream_structure_errors_named(tmp_path):
    models = [_model(s) for s in range(3)]
    models[2]["norm.bias"] = torch.zeros(9)
    del models[1]["head.bias"]
    paths = []
    for i, m in enumerate(models):
        paths.append(tmp_path / f"s{i}.safetensors")
        save_file(m, paths[-1])
    with pytest.raises(AggregationError, match=r"input 1 \(b\), key 'head.bias': missing"):
        weighted_average([safetensors_loader(p) for p in paths], uniform_weights(3), names=["a", "b", "c"])
    with pytest.raises(AggregationError, match=r"input 1, key 'norm.bias': \(9,\)"):
        weighted_average([safetensors_loader(p) for p in (paths[0], paths[2])], [0.5, 0.5])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_keep_dtype(dtype, tmp_path):
    models = [{k: v.to(dtype) for k, v in _model(s).items()} for s in range(3)]
    w = [0.2, 0.3, 0.5]
    out = weighted_average([_loader(m) for m in models], w)
    paths = []
    for i, m in enumerate(models):
        paths.append(tmp_path / f"{i}.safetensors")
        save_file(m, paths[-1])
    streamed = weighted_average([safetensors_loader(p) for p in paths], w)
    for k, v in out.items():
        assert v.dtype == dtype
        ref = sum(wi * m[k].double() for m, wi in zip(models, w))
        torch.testing.assert_close(v.double(), ref, rtol=1e-2, atol=1e-2)
        assert torch.equal(streamed[k], v)


# ------------------------------------------------------------ safetensors streaming

def test_stream_equals_in_memory_bitwise(tmp_path, monkeypatch):
    # small windows and chunks: tensors span several windows, windows start unaligned
    monkeypatch.setattr(agg, "WINDOW_BYTES", 8192)
    monkeypatch.setattr(agg, "CHUNK_BYTES", 1024)
    models = [_model(s, dim=24) for s in range(3)]
    paths = []
    for i, m in enumerate(models):
        paths.append(tmp_path / f"m{i}.safetensors")
        save_file(m, paths[-1], metadata={"atd": "{}"})
    w = sample_weights([1, 2, 3])
    mem = weighted_average([_loader(m) for m in models], w)
    disk = weighted_average([safetensors_loader(p) for p in paths], w, names=[p.name for p in paths])
    assert set(disk) == set(mem)  # safetensors files store keys sorted
    for k in mem:
        assert torch.equal(mem[k], disk[k]), k
    # the one-by-one schedule (any other loader) gives the same bits
    wrapped = weighted_average([lambda p=p: SafetensorsStream(p) for p in paths], w)
    for k in mem:
        assert torch.equal(wrapped[k], disk[k]), k
    with SafetensorsStream(paths[0]) as s:
        assert s.metadata == {"atd": "{}"}
        assert torch.equal(s.view("norm.bias", 3, 5), models[0]["norm.bias"][3:8])
        with pytest.raises(IndexError):
            s.view("norm.bias", 20, 5)
        assert s.spec("norm.bias") == ((24,), torch.float32)
        assert torch.equal(s["head.weight"], models[0]["head.weight"])
        assert len(s) == 5 and set(s) == set(models[0])


def test_stream_nan_named(tmp_path):
    paths = []
    for i in range(3):
        m = _model(i)
        if i == 1:
            m["blocks.0.mlp.fc2.weight"][3, 3] = float("nan")
        paths.append(tmp_path / f"n{i}.safetensors")
        save_file(m, paths[-1])
    with pytest.raises(AggregationError, match=r"input 1 \(n1\), key 'blocks.0.mlp.fc2.weight'"):
        weighted_average([safetensors_loader(p) for p in paths], uniform_weights(3), names=["n0", "n1", "n2"])


def _write_raw(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize("header, data, match", [
    (b"not json", b"", "not JSON"),
    (b'["list"]', b"", "not a JSON object"),
    (b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', b"1234", "do not fit"),
    (b'{"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}', b"12345678", "do not fit"),
    (b'{"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}', b"12345678", "bad dtype"),
    (b'{"x": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}', b"12345678", "bad dtype"),
    (b'{"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}', b"12345678", "do not fit"),
    (b'{"__metadata__": {"a": 1}}', b"", "__metadata__"),
])
def test_malformed_safetensors_rejected(tmp_path, header, data, match):
    p = _write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(AggregationError, match=match):
        SafetensorsStream(p)


def test_truncated_and_tiny_files_rejected(tmp_path):
    (tmp_path / "tiny").write_bytes(b"abc")
    with pytest.raises(AggregationError, match="shorter"):
        SafetensorsStream(tmp_path / "tiny")
    (tmp_path / "len").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(AggregationError, match="header length"):
        SafetensorsStream(tmp_path / "len")


def test_load_tensor(tmp_path):
    m = _model(3)
    save_file(m, tmp_path / "m.safetensors")
    t = load_tensor(safetensors_loader(tmp_path / "m.safetensors"), "head.weight")
    assert torch.equal(t, m["head.weight"])
    with pytest.raises(AggregationError, match="missing"):
        load_tensor(_loader(m), "nope")


def test_heads_are_comparable_only_over_one_ordered_label_list():
    from protocols.vgs import heads_comparable

    assert heads_comparable([["x", "y", "z"], ["x", "y", "z"]])
    assert not heads_comparable([["x", "y", "z"], ["z", "y", "x"]])  # same set, other order
    assert not heads_comparable([]) and heads_comparable([["a"]])


def test_conv_stem_extractors_average_with_their_batch_norm_buffers(tmp_path):
    """Two conv-stem extractors (protocols.vit_stem) trained on different numbers of batches
    average through the streaming average: running statistics as floats, and the stem's
    num_batches_tracked an int64 that is the same on every model (its BatchNorm keeps no count,
    so the equal-integers rule holds)."""
    from atdnode.learning import build_model, extractor_state, resolve_config

    cfg = resolve_config("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                         num_classes=2, stem="conv")
    paths, states = [], []
    for seed, batches in ((0, 1), (1, 3)):
        torch.manual_seed(seed)
        m = build_model(cfg).train()
        for _ in range(batches):
            m(torch.randn(4, 3, 16, 16))
        states.append(extractor_state(m))
        paths.append(tmp_path / f"x{seed}.safetensors")
        save_file(states[-1], paths[-1])
    out = weighted_average([safetensors_loader(p) for p in paths], [0.5, 0.5],
                           key_filter=part_filter(include_head=False))
    assert set(out) == set(states[0])
    count = "patch_embed.stem.1.num_batches_tracked"
    assert out[count].dtype == torch.int64 and out[count].tolist() == 0
    mean = "patch_embed.stem.1.running_mean"
    assert not torch.equal(states[0][mean], states[1][mean])
    assert torch.allclose(out[mean], (states[0][mean] + states[1][mean]) / 2)
    m.load_state_dict(out, strict=False)  # the average is a model again
