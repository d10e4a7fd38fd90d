"""Entry bodies are typed in one module: writers and readers reject a body that lacks a field
or has one of the wrong type, naming the kind and the field."""
from __future__ import annotations

import pytest

from atdnode.bodies import SPECS, BodyError, check_body

WEIGHTS = {"blob": "ab" * 32, "size": 10, "manifest": "cd" * 32, "part": "extractor", "model": {},
           "labels": ["normal", "pneumonia"], "label_fp": "x", "samples": 5, "metrics": {}, "provenance": []}


def test_a_valid_body_passes_and_extra_fields_are_allowed() -> None:
    assert check_body("weights", {**WEIGHTS, "future_field": 1})["samples"] == 5
    assert check_body("metrics", {"anything": [1, 2]}) == {"anything": [1, 2]}
    assert set(SPECS) >= {"weights", "features", "aggregate", "hello", "metrics", "service"}


@pytest.mark.parametrize("change, why", [
    ({"samples": None}, "'samples' must be int"),
    ({"samples": True}, "'samples' must be int"),
    ({"labels": ["a", 3]}, "'labels' must list str"),
    ({"model_id": 7}, "'model_id' must be str"),
])
def test_wrong_types_are_named(change: dict, why: str) -> None:
    with pytest.raises(BodyError, match=why):
        check_body("weights", {**WEIGHTS, **change})


def test_missing_fields_and_non_maps_are_named() -> None:
    body = dict(WEIGHTS)
    del body["manifest"]
    with pytest.raises(BodyError, match="weights entry body lacks field 'manifest'"):
        check_body("weights", body)
    with pytest.raises(BodyError, match="must be a map"):
        check_body("aggregate", [1, 2])
    with pytest.raises(BodyError, match="'x25519' must be bytes"):
        check_body("hello", {"addrs": [], "x25519": "not bytes"})
