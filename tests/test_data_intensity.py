"""16-bit / float images keep their information: min-max, window=lo,hi, window=auto, frames."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from atdnode.data import load_dataset, split_indices
from atdnode.errors import DataError
from tests.medimg import damaged, outcomes_of, write_png16

torch.set_num_threads(1)


def _norm01(d, i=0):
    return (d.images[i, 0] * 0.5 + 0.5).numpy().astype(np.float64)


def test_16bit_gradient_survives_monotonic_and_unclipped(tmp_path):
    grad = np.tile(np.linspace(0, 65535, 64).round().astype(np.uint16), (64, 1))  # full-range, (64, 64)
    write_png16(tmp_path / "a" / "g.png", grad)
    d = load_dataset(f"folder:{tmp_path}", 64, 1, "train")
    x = _norm01(d)
    row = x[0]
    assert np.all(np.diff(row) > 0)  # strictly monotonic: nothing collapsed
    assert len(np.unique(row.round(6))) == 64 and row[0] == 0.0 and row[-1] == pytest.approx(1.0)
    assert (x >= 1.0 - 1e-6).mean() == pytest.approx(1 / 64)  # 8-bit clipping made 99.6% white
    assert np.allclose(row, grad[0] / 65535.0, atol=1e-6)  # min-max of a full-range image is v / 65535
    assert d.report.scaling == {"uint16, min-max per image": 1} and d.report.value_range == (0.0, 65535.0)
    assert d.report.dtypes == {"uint16": 1} and d.report.shapes == {"64x64": 1}


def test_window_option_maps_linearly_and_saturates_outside(tmp_path):
    v = np.array([[0, 1000, 1500, 2000, 3000, 60000]], dtype=np.uint16).repeat(6, 0)
    write_png16(tmp_path / "a" / "w.png", v)
    d = load_dataset(f"folder:{tmp_path}?window=1000,2000", 6, 1, "train")
    assert np.allclose(_norm01(d)[0], [0, 0, 0.5, 1, 1, 1], atol=1e-6)
    assert d.report.scaling == {"window 1000..2000": 1}
    # an 8-bit image with a window: the same rule (default for 8-bit stays fixed 0..255)
    Image.fromarray(np.array([[0, 64, 128, 255]] * 4, np.uint8)).save(tmp_path / "a" / "e.png")
    d8 = load_dataset(f"folder:{tmp_path}", 4, 1, "train")
    i8 = d8.report.scaling
    assert i8 == {"8-bit, fixed 0..255": 1, "uint16, min-max per image": 1}


def test_window_auto_uses_training_percentiles(tmp_path):
    rng = np.random.default_rng(0)
    imgs = [rng.integers(100, 4000, (16, 16)).astype(np.uint16) for _ in range(10)]
    imgs[0][0, 0] = 65000  # an outlier: auto ignores it, min-max would not
    for i, im in enumerate(imgs):
        write_png16(tmp_path / "a" / f"{i}.png", im)
    tr = load_dataset(f"folder:{tmp_path}?window=auto&val=train", 16, 1, "train")  # no val carved: all 8
    te = load_dataset(f"folder:{tmp_path}?window=auto&val=train", 16, 1, "test")
    train_files = split_indices(np.zeros(10, np.int64), seed=0)["train"]  # the seeded 80/20 split
    lo, hi = tr.report.auto_window
    assert te.report.auto_window == (lo, hi)  # the same window on both sides: from training data only
    pooled = np.concatenate([imgs[i].ravel() for i in train_files]).astype(np.float64)
    assert (lo, hi) == pytest.approx(tuple(np.percentile(pooled, [0.5, 99.5])))
    assert 100 <= lo < 200 and 3900 < hi < 4000  # the 65000 outlier does not stretch the window
    assert list(tr.report.scaling) == [f"window=auto {lo:g}..{hi:g} (percentiles)"] and len(tr) == 8


def test_float_tiff_and_multipage_tiff_frames(tmp_path):
    f = np.linspace(-3.5, 1e4, 64, dtype=np.float32).reshape(8, 8)
    (tmp_path / "a").mkdir()
    Image.fromarray(f, mode="F").save(tmp_path / "a" / "f.tif")
    d = load_dataset(f"folder:{tmp_path}", 8, 1, "train")
    x = _norm01(d).ravel()
    assert np.all(np.diff(x) > 0) and x[0] == 0 and x[-1] == pytest.approx(1.0)
    assert d.report.scaling == {"float32, min-max per image": 1}
    pages = [Image.fromarray(np.full((8, 8), v, np.uint8)) for v in (10, 20, 30)]
    mp = tmp_path / "mp"
    (mp / "a").mkdir(parents=True)
    pages[0].save(mp / "a" / "stack.tif", save_all=True, append_images=pages[1:])
    with pytest.raises(DataError, match=r"stack.tif: multi-page image \(3 pages\); choose one with frame=K"):
        load_dataset(f"folder:{mp}", 8, 1)
    got = load_dataset(f"folder:{mp}?frame=2", 8, 1).images[0, 0] * 0.5 + 0.5
    assert torch.allclose(got, torch.full((8, 8), 30 / 255))


def test_npz_uint16_and_float_images(tmp_path):
    imgs = np.stack([np.arange(16, dtype=np.uint16).reshape(4, 4) * 4000 for _ in range(4)])
    np.savez(tmp_path / "m.npz", train_images=imgs, train_labels=np.array([0, 1, 0, 1]),
             test_images=imgs[:2], test_labels=np.array([0, 1]))
    d = load_dataset(f"npz:{tmp_path / 'm.npz'}", 4, 1)
    assert np.allclose(_norm01(d).ravel(), np.arange(16) / 15, atol=1e-6)
    assert d.report.scaling == {"uint16, min-max per image": 4}
    bad = imgs.astype(np.float32)
    bad[0, 0, 0] = np.nan
    np.savez(tmp_path / "nan.npz", train_images=bad, train_labels=np.array([0, 1, 0, 1]))
    with pytest.raises(DataError, match="nan.npz: train_images has NaN"):
        load_dataset(f"npz:{tmp_path / 'nan.npz'}", 4, 1)


def test_damaged_image_files_are_skipped_never_raised(tmp_path):
    import io

    from atdnode.data.images import read_image
    rng = np.random.default_rng(0)
    outcomes = set()
    for fmt, arr in (("PNG", (np.arange(256).reshape(16, 16) * 200).astype(np.uint16)),
                     ("TIFF", np.arange(256, dtype=np.float32).reshape(16, 16)),
                     ("JPEG", np.arange(256).reshape(16, 16).astype(np.uint8))):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format=fmt)
        cases = damaged(buf.getvalue(), rng, keep=8, step=37, flips=40)
        outcomes |= outcomes_of(lambda q: read_image(q, None, str(q)), tmp_path / f"y.{fmt.lower()}", cases)
    assert {"ok", "Skip"} <= outcomes
