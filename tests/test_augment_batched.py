"""The small-class augmentation batched on the images' device (atdnode.learning.augment.augment_batch):
a pure function of (seed, epoch, sample id), independent of batch composition, and the same
operations as torchvision's per-image functions (the former implementation, kept here as
the reference)."""
from __future__ import annotations

import pytest
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from atdnode.learning.augment import OPS, SmallClassAugment, augment_batch

HAS_CUDA = torch.cuda.is_available()


def reference(img: torch.Tensor, p: dict) -> torch.Tensor:
    """Per-image torchvision operations, as atd applied them before batching."""
    x = img * 0.5 + 0.5
    if "rotate" in p or "zoom" in p:
        x = TF.affine(x, angle=float(p.get("rotate", 0.0)), translate=[0, 0], scale=float(p.get("zoom", 1.0)),
                      shear=[0.0, 0.0], interpolation=InterpolationMode.BILINEAR)
    if "hflip" in p:
        x = TF.horizontal_flip(x)
    if "blur" in p:
        s = float(p["blur"])
        k = min(2 * int(torch.tensor(3 * s).ceil()) + 1, (x.shape[-1] - 1) | 1)
        x = TF.gaussian_blur(x, [k, k], [s, s])
    if "brightness" in p:
        x = TF.adjust_brightness(x, float(p["brightness"]))
    return (x.clamp(0, 1) - 0.5) / 0.5


def images(n: int = 48, size: int = 20, chans: int = 3, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, chans, size, size, generator=g)
    x[:, :, size // 4: size // 2, size // 3:] += 0.5  # structure, so warps and flips change pixels
    return (x.clamp(0, 1) * 2 - 1).to(device)


def test_each_operation_matches_torchvision_per_image():
    x = images(6)
    cases = [{"rotate": 17.0}, {"zoom": 0.85}, {"rotate": -25.0, "zoom": 1.15}, {"hflip": True}, {"blur": 1.3},
             {"brightness": 0.6}, {"rotate": 10.0, "hflip": True, "blur": 0.4}]
    for p in cases:
        got = augment_batch(x, [p] * len(x))
        want = torch.stack([reference(im, p) for im in x])
        err = (got - want).abs()
        assert err.mean() < 1e-3 and err.max() < 0.05, (p, float(err.mean()), float(err.max()))
        assert not torch.equal(got, x)  # and each operation does change the images


def test_batched_matches_per_sample_semantics_for_drawn_params():
    x = images()
    aug = SmallClassAugment([5], threshold=1000, seed=7)
    ps = [aug.params(i, 2, always=True) for i in range(len(x))]
    got = augment_batch(x, ps)
    want = torch.stack([reference(im, p) for im, p in zip(x, ps)])
    assert got.shape == want.shape == x.shape and got.dtype == x.dtype
    assert (got - want).abs().mean() < 1e-3
    assert abs(float(got.mean() - want.mean())) < 1e-3 and abs(float(got.std() - want.std())) < 1e-3


def _determinism(device: str) -> None:
    x = images(device=device)
    y = torch.tensor([0] * 24 + [1] * 24)
    ids = torch.arange(100, 148)
    aug = SmallClassAugment([5, 5000], threshold=1000, prob=0.7, seed=3, mode="inplace")
    out = aug(x, y, ids, epoch=4)
    assert out.device == x.device and out.shape == x.shape
    assert torch.equal(aug(x, y, ids, epoch=4), out)  # same seed, epoch, ids: same bits
    assert torch.equal(out[24:], x[24:])  # the big class is untouched
    changed = [i for i in range(24) if not torch.equal(out[i], x[i])]
    drawn = [i for i in range(24) if aug.params(int(ids[i]), 4) is not None]
    assert changed == drawn and 0 < len(drawn) < 24  # exactly the samples whose draw says so
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(1))
    # batch composition does not matter (bit for bit on the CPU; on CUDA the batched matmul
    # may pick another kernel for another batch size, so to float precision there)
    same = torch.equal if device == "cpu" else (lambda a, b: torch.allclose(a, b, atol=1e-5))
    assert same(aug(x[perm], y[perm], ids[perm], epoch=4), out[perm])
    assert same(aug(x[5:6], y[5:6], ids[5:6], epoch=4), out[5:6])
    assert not torch.equal(aug(x, y, ids, epoch=5)[:24], out[:24])  # another epoch, other draws
    other = SmallClassAugment([5, 5000], threshold=1000, prob=0.7, seed=4, mode="inplace")
    assert not torch.equal(other(x, y, ids, epoch=4)[:24], out[:24])
    extra = aug.make_extra(x[:8], torch.arange(48, 56), epoch=0)
    assert torch.equal(extra, aug.make_extra(x[:8], torch.arange(48, 56), epoch=0))
    assert all(len(aug.params(i, 0, always=True)) == 3 and set(aug.params(i, 0, always=True)) <= set(OPS)
               for i in range(48, 56))


def test_batched_augmentation_is_a_pure_function_of_seed_epoch_id_on_cpu():
    _determinism("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_batched_augmentation_on_cuda_is_reproducible_and_close_to_cpu():
    _determinism("cuda")
    x = images()
    aug = SmallClassAugment([5], threshold=1000, seed=7)
    ps = [aug.params(i, 0, always=True) for i in range(len(x))]
    cpu, gpu = augment_batch(x, ps), augment_batch(x.cuda(), ps).cpu()
    assert (cpu - gpu).abs().mean() < 1e-3  # bits may differ between devices, the images do not
