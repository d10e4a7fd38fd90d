"""The real-image recipe bench's recipe parser: a public start names its pool, a pool needs a
public start, and a data spec's own `=` and `&` survive the NAME:key=value,... syntax."""
from __future__ import annotations

import pytest

from bench.medmnist_recipe_bench import parse_recipe


def test_a_public_start_keeps_its_pool_spec_whole() -> None:
    name, r = parse_recipe("wp:start=public,pool=digits-jitter?variants=1&seed=3,pool_epochs=10,probe=3")
    assert name == "wp"
    assert r == {"start": "public", "pool": "digits-jitter?variants=1&seed=3", "pool_epochs": 10, "probe": 3}


@pytest.mark.parametrize("text", ["wp:start=public", "wp:pool=npz:x.npz", "wp:start=msd,pool=npz:x.npz"])
def test_a_public_start_and_a_pool_go_together(text: str) -> None:
    with pytest.raises(SystemExit, match="start=public and pool=SPEC go together"):
        parse_recipe(text)


def test_an_unknown_key_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown key 'pools'"):
        parse_recipe("wp:start=public,pools=npz:x.npz")
