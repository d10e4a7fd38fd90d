"""Hierarchical aggregation: group weights, combination, a late group reusing stored groups."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from protocols.aggregation import AggregationError, part_filter, weighted_average
from protocols.hierarchical import (GroupModel, add_group, build_group, combine_groups, group_weights,
                                    persist_safetensors)


def _model(seed: int, head: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"blocks.0.attn.qkv.weight": torch.randn(24, 8, generator=g), "norm.weight": torch.randn(8, generator=g),
            "head.weight": torch.randn(head, 8, generator=g)}


class Counted:
    """A loader that counts its calls (wrapping tensors or another loader)."""

    def __init__(self, tensors=None, *, loader=None):
        self.load = loader or (lambda: tensors)
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.load()


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_group_weights_known_answers():
    a = GroupModel("a", lambda: {}, n_classes=3, n_models=2)
    b = GroupModel("b", lambda: {}, n_classes=4, n_models=6)
    np.testing.assert_allclose(group_weights([a, b], "sqrt-classes"),
                               [math.sqrt(3) / (math.sqrt(3) + 2), 2 / (math.sqrt(3) + 2)], atol=1e-15)
    np.testing.assert_allclose(group_weights([a, b], "model-count"), [0.25, 0.75], atol=1e-15)
    with pytest.raises(AggregationError, match="group weighting"):
        group_weights([a, b], "uniform")
    with pytest.raises(AggregationError):
        group_weights([], "model-count")


def test_late_group_reuses_existing_groups(tmp_path):
    members_a = [Counted(_model(s)) for s in (1, 2)]
    members_b = [Counted(_model(s)) for s in (3, 4, 5)]
    group_a = build_group("A", members_a, [0.5, 0.5], n_classes=3,
                          persist=persist_safetensors(tmp_path / "A.safetensors"))
    assert [m.calls for m in members_a] == [1, 1] and group_a.n_models == 2
    stored_a = _digest(tmp_path / "A.safetensors")

    # the later group is built on its own ...
    group_b = build_group("B", members_b, [0.2, 0.3, 0.5], n_classes=4,
                          persist=persist_safetensors(tmp_path / "B.safetensors"))
    # ... and combined with A as stored: A is read once, its members are not touched
    reads_a = Counted(loader=group_a.tensors_loader)
    reused_a = GroupModel("A", reads_a, group_a.n_classes, group_a.n_models)
    groups, combo = add_group([reused_a], group_b, weighting="sqrt-classes")
    assert [g.name for g in groups] == ["A", "B"]
    assert reads_a.calls == 1
    assert [m.calls for m in members_a] == [1, 1] and [m.calls for m in members_b] == [1, 1, 1]
    assert _digest(tmp_path / "A.safetensors") == stored_a

    w = [math.sqrt(3) / (math.sqrt(3) + 2), 2 / (math.sqrt(3) + 2)]
    np.testing.assert_allclose(combo.weights, w, atol=1e-15)
    expect = weighted_average([group_a.tensors_loader, group_b.tensors_loader], combo.weights)
    for k, v in expect.items():
        assert torch.equal(combo.tensors[k], v)
    # the combination is what averaging the groups' members in two stages gives
    stage_a = {k: 0.5 * _model(1)[k].double() + 0.5 * _model(2)[k].double() for k in expect}
    stage_b = {k: sum(wi * _model(s)[k].double() for s, wi in zip((3, 4, 5), (0.2, 0.3, 0.5))) for k in expect}
    for k in expect:
        torch.testing.assert_close(combo.tensors[k].double(), w[0] * stage_a[k] + w[1] * stage_b[k],
                                   rtol=1e-5, atol=1e-5)
    assert combo.record() == {"groups": ["A", "B"], "weighting": "sqrt-classes", "weights": list(combo.weights)}
    assert group_b.record() == {"name": "B", "n_classes": 4, "n_models": 3}


def test_model_count_and_extractor_only_combination(tmp_path):
    a = build_group("A", [Counted(_model(1, head=3))], [1.0], n_classes=3,
                    persist=lambda t: (lambda: t), n_models=4)  # members that were groups of 4 models
    b = build_group("B", [Counted(_model(2, head=5))], [1.0], n_classes=5, persist=lambda t: (lambda: t))
    with pytest.raises(AggregationError, match=r"input 1 \(B\), key 'head.weight'"):
        combine_groups([a, b], weighting="model-count")
    combo = combine_groups([a, b], weighting="model-count", key_filter=part_filter(include_head=False))
    assert "head.weight" not in combo.tensors
    np.testing.assert_allclose(combo.weights, [0.8, 0.2])


def test_group_validation():
    with pytest.raises(AggregationError):
        GroupModel("", lambda: {}, 1, 1)
    with pytest.raises(AggregationError, match="n_classes"):
        GroupModel("g", lambda: {}, 0, 1)
    with pytest.raises(AggregationError, match="n_models"):
        GroupModel("g", lambda: {}, 2, True)
    with pytest.raises(AggregationError, match="callable"):
        GroupModel("g", {}, 2, 1)
    g = GroupModel("g", lambda: _model(0), 3, 1)
    with pytest.raises(AggregationError, match="already exists"):
        add_group([g], GroupModel("g", lambda: _model(1), 3, 1))
    with pytest.raises(AggregationError, match="distinct"):
        combine_groups([g, g])
    with pytest.raises(AggregationError, match="weights"):
        build_group("x", [lambda: _model(0)], [0.5], n_classes=2, persist=lambda t: (lambda: t))
