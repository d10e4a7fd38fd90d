"""Data specs, loaders (digits / npz / folder), label spaces, every loader error, augmentation."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from atdnode.learning.augment import OPS, SmallClassAugment, apply_ops, gaussian_blur
from atdnode.data import DataSpec, label_fingerprint, load_dataset, split_indices
from atdnode.data.select import _select
from atdnode.errors import DataError

torch.set_num_threads(1)


# --- specs and digits ---------------------------------------------------------------------

def test_spec_parsing():
    s = DataSpec.parse("digits?classes=0,1,2&limit=300&shard=1/3&seed=4")
    assert (s.source, s.path, s.classes, s.limit, s.shard, s.seed) == ("digits", None, ("0", "1", "2"), 300, (1, 3), 4)
    assert DataSpec.parse("npz:/x/y.npz").path == "/x/y.npz"
    assert DataSpec.parse("folder:/data/imgs?limit=5").limit == 5
    for bad in ("mnist", "npz:", "digits:x", "digits?shard=4/3", "digits?limit=0", "digits?colour=red", "digits?shard=a"):
        with pytest.raises(DataError, match="bad data spec"):
            DataSpec.parse(bad)


def test_digits_split_is_seeded_stratified_and_disjoint():
    tr = load_dataset("digits", 16, 3, "train")
    te = load_dataset("digits", 16, 3, "test")
    va = load_dataset("digits", 16, 3, "val")  # carved from the 80 %: the source has no val split
    assert len(tr) + len(va) + len(te) == 1797 and abs(len(te) - 0.2 * 1797) < 10 and abs(len(va) - 0.16 * 1797) < 10
    assert va.report.val_origin.startswith("carved from train")
    assert tr.images.shape == (len(tr), 3, 16, 16) and tr.images.dtype == torch.float32
    assert tr.images.min() >= -1 and tr.images.max() <= 1
    assert torch.equal(tr.images[:, 0], tr.images[:, 2])  # grayscale copied to 3 channels
    assert tr.classes == [str(i) for i in range(10)] and min(te.class_counts()) >= 30
    sp = split_indices(np.repeat(np.arange(10), 50), seed=0)
    assert not set(sp["train"]) & set(sp["test"]) and len(sp["train"]) + len(sp["test"]) == 500
    assert torch.equal(load_dataset("digits", 16, 3, "train").images, tr.images)
    assert not torch.equal(load_dataset("digits?seed=1", 16, 3, "train").labels, tr.labels)


def test_class_filter_relabels_and_fingerprints():
    a = load_dataset("digits?classes=7,3", 8, 1, "train")
    assert a.classes == ["3", "7"] and set(a.labels.tolist()) == {0, 1}
    assert a.label_fp == label_fingerprint(["3", "7"]) == load_dataset("digits?classes=3,7", 8, 1).label_fp
    assert label_fingerprint(["7", "3"]) != a.label_fp
    assert a.images.shape[1] == 1
    with pytest.raises(DataError, match="unknown classes"):
        load_dataset("digits?classes=3,x", 8, 1)


def test_test_side_does_not_depend_on_the_class_filter():
    full = load_dataset("digits", 8, 1, "test")
    sub = load_dataset("digits?classes=0,1", 8, 1, "test")
    mask = full.labels < 2
    assert torch.equal(full.images[mask], sub.images)


def test_shards_are_disjoint_and_cover():
    labels = np.repeat(np.arange(4), 25)
    parts = [_select(labels, list("abcd"), DataSpec.parse(f"digits?shard={i}/3"), 0, "x")[0] for i in (1, 2, 3)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(100))
    assert all(abs(len(p) - 33) <= 1 for p in parts)
    idx, keep, new = _select(labels, list("abcd"), DataSpec.parse("digits?classes=b,d&limit=10"), 0, "x")
    assert len(idx) == 10 and keep == ["b", "d"] and set(new.tolist()) <= {0, 1}
    assert all(labels[i] in (1, 3) for i in idx)
    assert len(load_dataset("digits?limit=50", 8, 1)) == 50


# --- npz ----------------------------------------------------------------------------------

def _npz(path, **arrays):
    np.savez(path, **arrays)
    return f"npz:{path}"


def test_npz_medmnist_layout(tmp_path):
    rng = np.random.default_rng(0)
    spec = _npz(tmp_path / "m.npz",
                train_images=rng.integers(0, 255, (30, 28, 28), dtype=np.uint8), train_labels=rng.integers(0, 3, (30, 1)),
                val_images=rng.integers(0, 255, (6, 28, 28), dtype=np.uint8), val_labels=rng.integers(0, 3, (6, 1)),
                test_images=rng.integers(0, 255, (9, 28, 28), dtype=np.uint8), test_labels=rng.integers(0, 3, (9, 1)))
    tr = load_dataset(spec, 16, 3, "train")
    te = load_dataset(spec, 16, 3, "test")
    va = load_dataset(spec, 16, 3, "val")  # MedMNIST's val split is validation, not training
    assert len(tr) == 30 and len(va) == 6 and len(te) == 9 and tr.images.shape == (30, 3, 16, 16)
    assert tr.classes == ["0", "1", "2"] and tr.report.splits == ["train", "val", "test"]
    assert sum(tr.report.counts["val"].values()) == 6
    merged = load_dataset(spec + "?val=train", 16, 3, "train")  # merged only when asked
    assert len(merged) == 36 and torch.equal(merged.images[:30], tr.images)
    with pytest.raises(DataError, match="no val split"):
        load_dataset(spec + "?val=train", 16, 3, "val")
    # RGB images, named classes, no test split -> seeded 80/20
    spec2 = _npz(tmp_path / "rgb.npz", train_images=rng.integers(0, 255, (40, 12, 12, 3), dtype=np.uint8),
                 train_labels=np.repeat(np.arange(2), 20), classes=np.array(["benign", "malignant"]))
    a, b = load_dataset(spec2 + "?val=train", 8, 1, "train"), load_dataset(spec2, 8, 1, "test")
    assert a.classes == ["benign", "malignant"] and len(a) == 32 and len(b) == 8 and a.images.shape[1] == 1
    assert len(load_dataset(spec2, 8, 1, "train")) + len(load_dataset(spec2, 8, 1, "val")) == 32  # val carved
    # pixel values: a white image normalises to 1, black to -1
    spec3 = _npz(tmp_path / "bw.npz", train_images=np.stack([np.zeros((4, 4)), np.full((4, 4), 255)]).astype(np.uint8),
                 train_labels=np.array([0, 1]), test_images=np.zeros((1, 4, 4), np.uint8), test_labels=np.array([0]))
    d = load_dataset(spec3, 4, 1, "train")
    assert d.images[0].eq(-1).all() and d.images[1].eq(1).all()


@pytest.mark.parametrize("arrays, match", [
    (dict(train_images=np.zeros((4, 8, 8), np.uint8)), "missing keys"),
    (dict(train_images=np.zeros((4, 8, 8), np.uint8), train_labels=np.zeros(3, np.int64)), "4 train_images but 3"),
    (dict(train_images=np.zeros((4, 8, 8), np.uint8), train_labels=np.array([0, 1, -1, 0])), "out of range"),
    (dict(train_images=np.zeros((2, 8, 8), np.uint8), train_labels=np.array([0, 2]), classes=np.array(["a", "b"])), "out of range"),
    (dict(train_images=np.zeros((4, 8, 8), np.complex64), train_labels=np.zeros(4, np.int64)), "expected uint8"),
    (dict(train_images=np.zeros((4, 8), np.uint8), train_labels=np.zeros(4, np.int64)), "shape"),
    (dict(train_images=np.zeros((4, 8, 8), np.uint8), train_labels=np.zeros(4, np.float32)), "integer"),
    (dict(train_images=np.zeros((4, 8, 8), np.uint8), train_labels=np.zeros(4, np.int64),
          test_images=np.zeros((1, 8, 8), np.uint8)), "without its pair"),
])
def test_npz_errors_name_the_file(tmp_path, arrays, match):
    spec = _npz(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DataError, match=match) as ei:
        load_dataset(spec, 8, 1)
    assert "bad.npz" in str(ei.value)


def test_npz_not_a_zip_missing_and_pickled(tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"this is not a zip")
    with pytest.raises(DataError, match="junk.npz"):
        load_dataset(f"npz:{junk}", 8, 1)
    with pytest.raises(DataError, match="no such file"):
        load_dataset(f"npz:{tmp_path / 'none.npz'}", 8, 1)
    objs = np.empty(2, dtype=object)
    objs[:] = [np.zeros((8, 8), np.uint8), np.zeros((8, 8), np.uint8)]
    spec = _npz(tmp_path / "obj.npz", train_images=objs, train_labels=np.zeros(2, np.int64))
    with pytest.raises(DataError, match="obj.npz"):  # object arrays need pickle: refused
        load_dataset(spec, 8, 1)


# --- folders ------------------------------------------------------------------------------

def _img(path, size=(10, 12), mode="L", value=128):
    Image.new(mode, size, value if mode == "L" else (value, 0, 255 - value)).save(path)


def test_folder_loader_mixed_sizes_and_formats(tmp_path):
    root = tmp_path / "imgs"
    for c, n in (("cat", 4), ("dog", 6)):
        (root / c).mkdir(parents=True)
        for i in range(n):
            _img(root / c / f"{i}.png" if i % 2 else root / c / f"{i}.jpg", size=(8 + i, 9), mode="RGB" if i % 3 else "L")
    (root / "dog" / "notes.txt").write_text("ignored")
    tr, te = load_dataset(f"folder:{root}?val=train", 8, 3, "train"), load_dataset(f"folder:{root}", 8, 3, "test")
    assert tr.classes == ["cat", "dog"] and len(tr) + len(te) == 10 and tr.images.shape[1:] == (3, 8, 8)
    # explicit train/test layout
    split = tmp_path / "split"
    for s in ("train", "test"):
        for c in ("a", "b"):
            (split / s / c).mkdir(parents=True)
            _img(split / s / c / "x.png")
    assert len(load_dataset(f"folder:{split}", 8, 1, "test")) == 2


def test_folder_errors_name_the_file(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no class sub-folders"):
        load_dataset(f"folder:{empty}", 8, 1)
    (empty / "a").mkdir()
    with pytest.raises(DataError, match=r"empty[/\\]a: class folder has no PNG/JPEG"):
        load_dataset(f"folder:{empty}", 8, 1)
    bad = tmp_path / "bad" / "a"
    bad.mkdir(parents=True)
    _img(bad / "ok.png")
    (bad / "broken.png").write_bytes(b"\x89PNG garbage")
    d = load_dataset(f"folder:{tmp_path / 'bad'}", 8, 1)  # an unreadable file is skipped, counted and named
    assert len(d) == 1 and [f for f, _ in d.report.skipped] == ["a/broken.png"]
    assert "unreadable image" in d.report.skipped[0][1] and "skipped 1 file(s): a/broken.png" in d.report.summary()
    (bad / "ok.png").write_bytes(b"not a png either")
    with pytest.raises(DataError, match="none of the 2 train files could be read"):
        load_dataset(f"folder:{tmp_path / 'bad'}", 8, 1)
    with pytest.raises(DataError, match="no such folder"):
        load_dataset(f"folder:{tmp_path / 'nowhere'}", 8, 1)


# --- augmentation -------------------------------------------------------------------------

def test_augmentation_only_small_classes_deterministic_three_ops():
    torch.manual_seed(0)
    x = torch.rand(40, 3, 16, 16) * 2 - 1
    y = torch.tensor([0] * 20 + [1] * 20)
    ids = torch.arange(40)
    aug = SmallClassAugment([5, 5000], threshold=1000, prob=1.0, seed=3, mode="inplace")
    out = aug(x, y, ids, epoch=0)
    assert out.shape == x.shape and out.min() >= -1 and out.max() <= 1
    assert torch.equal(out[20:], x[20:])  # the big class is untouched
    assert all(not torch.equal(out[i], x[i]) for i in range(20))
    assert torch.equal(aug(x, y, ids, epoch=0), out)  # a pure function of (seed, epoch, id)
    assert not torch.equal(aug(x, y, ids, epoch=1)[:20], out[:20])
    # batch composition does not matter: the same sample gets the same ops
    assert torch.equal(aug(x[5:6], y[5:6], ids[5:6], epoch=0), out[5:6])
    for i in range(50):
        p = aug.params(i, 0)
        assert len(p) == 3 and set(p) <= set(OPS)
        assert -30 <= p.get("rotate", 0) <= 30 and 0.8 <= p.get("zoom", 1) <= 1.2
        assert 0.1 <= p.get("blur", 1) <= 2.0 and 0.5 <= p.get("brightness", 1) <= 1.5
    assert SmallClassAugment([5], prob=0.0, mode="inplace").active is False
    assert SmallClassAugment([5000, 2000], threshold=1000).active is False


def test_single_ops_match_torchvision():
    x = torch.rand(3, 16, 16)
    for s in (0.1, 0.7, 2.0):
        k = min(2 * math.ceil(3 * s) + 1, 15)
        assert torch.allclose(gaussian_blur(x, s), TF.gaussian_blur(x, [k, k], [s, s]), atol=1e-5)
    norm = x * 2 - 1
    assert torch.allclose(apply_ops(norm, {"hflip": True}), TF.horizontal_flip(x) * 2 - 1)
    assert torch.allclose(apply_ops(norm, {"brightness": 0.5}), (x * 0.5) * 2 - 1, atol=1e-6)
