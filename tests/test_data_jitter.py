"""`digits-jitter` (atdnode/data/jitter.py): the real digits, placed in a 32 px canvas at
random size / angle / offset with random contrast, background and noise -- one fixed,
seeded data set."""
from __future__ import annotations

import numpy as np
import pytest

from atdnode.data import DataSpec, load_dataset
from atdnode.data.jitter import CANVAS, render
from atdnode.errors import DataError


def test_rendering_is_fixed_and_moves_the_digits() -> None:
    from sklearn.datasets import load_digits

    d = load_digits().images[:200]
    a, b = render(d), render(d)
    assert a.shape == (200, CANVAS, CANVAS) and a.dtype == np.uint8
    assert np.array_equal(a, b)  # a pure function of the render seed
    assert not np.array_equal(a, render(d, seed=1))
    # the ink's centre of mass moves from image to image (the 8x8 originals are centred):
    # its spread is several pixels, where a fixed placement would give well under one
    ink = np.clip(a.astype(np.float64) - np.median(a, axis=(1, 2), keepdims=True), 0, None)
    ys, xs = np.mgrid[:CANVAS, :CANVAS]
    cy = (ink * ys).sum((1, 2)) / ink.sum((1, 2))
    cx = (ink * xs).sum((1, 2)) / ink.sum((1, 2))
    assert cy.std() > 2.0 and cx.std() > 2.0, (cy.std(), cx.std())


def test_loads_like_digits_with_the_same_labels_and_split() -> None:
    tr = load_dataset("digits-jitter?val=train", 28, 1, "train", seed=0)
    te = load_dataset("digits-jitter", 28, 1, "test", seed=0)
    ref = load_dataset("digits?val=train", 8, 1, "train", seed=0)
    assert tr.images.shape[1:] == (1, 28, 28) and tr.classes == [str(i) for i in range(10)]
    assert len(tr) + len(te) == 1797 and np.array_equal(tr.labels.numpy(), ref.labels.numpy())
    assert "digits-jitter" in next(iter(tr.report.scaling))
    sub = load_dataset("digits-jitter?classes=6,7&val=train", 28, 1, "train", seed=0)
    assert sub.classes == ["6", "7"] and len(sub) < len(tr) // 4


def test_takes_no_path() -> None:
    assert DataSpec.parse("digits-jitter").path is None
    with pytest.raises(DataError, match="digits-jitter"):
        DataSpec.parse("digits-jitter:/tmp/x")


def test_variants_multiply_the_data_without_train_test_leakage() -> None:
    from atdnode.data.jitter import digits_jitter_catalog

    cat = digits_jitter_catalog(3)
    assert len(cat.keys) == 3 * 1797 and cat.groups is not None
    one = digits_jitter_catalog(1)
    a, _ = one.read(5)
    b, _ = cat.read(5)
    c, _ = cat.read(1797 + 5)
    assert np.array_equal(a, b) and not np.array_equal(b, c)  # variant 0 is the K = 1 data set
    # the split deals source digits (groups): all 3 variants of a digit land on one side, so
    # no test image is a re-rendering of a training digit; the test digits are those of K = 1
    from atdnode.data import resolve_data

    sides3 = resolve_data("digits-jitter?variants=3").sides
    sides1 = resolve_data("digits-jitter").sides
    src = np.arange(3 * 1797) % 1797
    test_src, train_src = set(src[sides3 == "test"]), set(src[sides3 == "train"])
    assert test_src and not test_src & train_src
    assert test_src == set(np.flatnonzero(sides1 == "test"))
    assert all((sides3[src == i] == sides3[i]).all() for i in range(0, 1797, 97))
    te = load_dataset("digits-jitter?variants=3", 28, 1, "test", seed=0)
    assert len(te) == 3 * len(test_src)


def test_variants_is_checked() -> None:
    assert DataSpec.parse("digits-jitter?variants=4").variants == 4
    with pytest.raises(DataError, match="variants"):
        DataSpec.parse("digits-jitter?variants=0")
    with pytest.raises(DataError, match="does not apply"):
        DataSpec.parse("digits?variants=2")
