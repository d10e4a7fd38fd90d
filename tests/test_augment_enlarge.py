"""The paper's augmentation rule (§4.2): classes below the threshold are enlarged with extra
samples, each made by three of the five operations; the in-place variant is an option."""
from __future__ import annotations

import torch

from atdnode.learning import ddp
from atdnode.learning.augment import SmallClassAugment
from atdnode.data import LabeledImages
from atdnode.learning import TrainOptions, Trainer, build_model, resolve_config


def data(n_small: int = 3, n_big: int = 30) -> LabeledImages:
    torch.manual_seed(0)
    x = torch.rand(n_small + n_big, 1, 8, 8) * 2 - 1
    y = torch.tensor([0] * n_small + [1] * n_big)
    return LabeledImages(images=x, labels=y, classes=["small", "big"], spec="test")


def test_small_classes_get_extra_samples_up_to_the_threshold() -> None:
    d = data()
    aug = SmallClassAugment(d.class_counts(), threshold=10, seed=1)
    src = aug.extra_sources(d.labels)
    assert src.tolist() == [0, 1, 2]  # one augmented copy of each small-class sample (3 < 10 - 3)
    assert SmallClassAugment(d.class_counts(), threshold=5, seed=1).extra_sources(d.labels).tolist() == [0, 1]
    assert len(SmallClassAugment(d.class_counts(), threshold=10, copies=3).extra_sources(d.labels)) == 7  # to 10
    assert len(SmallClassAugment(d.class_counts(), threshold=10, mode="inplace").extra_sources(d.labels)) == 0
    ids = torch.arange(len(d), len(d) + 3)
    made = aug.make_extra(d.images[src], ids, epoch=0)
    assert made.shape == (3, 1, 8, 8) and not torch.equal(made, d.images[src])
    assert all(len(aug.params(int(i), 0, always=True)) == 3 for i in ids)  # three of the five operations


def test_the_trainer_sees_the_enlarged_set_and_in_place_keeps_its_size() -> None:
    d = data()
    cfg = resolve_config("vit_tiny_patch16_224", img_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                          in_chans=1, num_classes=2)
    seen = {}
    for mode in ("enlarge", "inplace"):
        opts = TrainOptions(epochs=1, batch_size=8, lr=1e-3, augment_threshold=10, augment_mode=mode, plots=False)
        t = Trainer(build_model(cfg), d, opts, ddp.DistContext())
        t.train_epoch(0)
        seen[mode] = (len(t.sources), t.steps_per_epoch)
    assert seen == {"enlarge": (36, 5), "inplace": (33, 5)}


def test_the_progress_total_counts_the_augmented_extras() -> None:
    """The training bar's total is what one epoch reports through `on_batch` (it used to be
    len(data), so the bar ran past it with augmentation on: `40/20`)."""
    d = data()
    cfg = resolve_config("vit_tiny_patch16_224", img_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                          in_chans=1, num_classes=2)
    opts = TrainOptions(epochs=1, batch_size=8, lr=1e-3, augment_threshold=10, plots=False)
    t = Trainer(build_model(cfg), d, opts, ddp.DistContext())
    advanced = []
    t.train_epoch(0, lambda n, loss, acc: advanced.append(n))
    assert sum(advanced) == t.samples_per_epoch == 36 > len(d)
