"""PGD, adversarial batch mixing and robust accuracy on a tiny MLP over digits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from protocols.adversarial import (AdversarialError, PGDConfig, adversarial_batch, pgd_attack,
                                   robust_accuracy)

MEAN, STD = 0.3, 0.4  # inputs are normalised, eps is given in pixel units
# 8x8 digits have 17 grey levels: eps 0.1 shows the effect in a few epochs
STRONG = dict(eps=0.1, step=0.025, steps=7, mean=MEAN, std=STD)


@pytest.fixture(scope="module")
def digits():
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, stratify=y, random_state=0)
    norm = lambda a: torch.from_numpy((a - MEAN) / STD)  # noqa: E731
    return norm(Xtr), torch.from_numpy(ytr), norm(Xte), torch.from_numpy(yte)


def _train(digits, adversarial: bool, epochs: int = 15) -> nn.Module:
    torch.set_num_threads(1)
    xtr, ytr, _, _ = digits
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        perm = torch.randperm(len(xtr), generator=g)
        for i in range(0, len(xtr), 128):
            xb, yb = xtr[perm[i:i + 128]], ytr[perm[i:i + 128]]
            if adversarial:
                xb = adversarial_batch(model, xb, yb, ratio=0.5, generator=g, **STRONG)
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return model


@pytest.fixture(scope="module")
def plain(digits):
    return _train(digits, adversarial=False)


@pytest.fixture(scope="module")
def robust_model(digits):
    return _train(digits, adversarial=True)


def test_pgd_lowers_plain_accuracy(plain, digits):
    _, _, xte, yte = digits
    g = torch.Generator().manual_seed(1)
    default = robust_accuracy(plain, (xte, yte), generator=g, mean=MEAN, std=STD)  # 8/255, 2/255, 7 steps
    assert default.clean > 0.95 and default.n == len(yte)
    assert default.robust < default.clean - 0.02
    strong = robust_accuracy(plain, (xte, yte), generator=g, **STRONG)
    assert strong.robust < strong.clean - 0.3


def test_adversarial_training_raises_robust_accuracy(plain, robust_model, digits):
    _, _, xte, yte = digits
    p = robust_accuracy(plain, (xte, yte), generator=torch.Generator().manual_seed(1), **STRONG)
    r = robust_accuracy(robust_model, (xte, yte), generator=torch.Generator().manual_seed(1), **STRONG)
    assert r.robust > p.robust + 0.15, (p, r)
    assert r.clean > 0.93  # ten digit classes: chance 0.1; the plain model's clean accuracy is > 0.95


def test_pgd_stays_in_ball_and_pixel_range(plain, digits):
    _, _, xte, yte = digits
    x, y = xte[:64], yte[:64]
    before = [p.detach().clone() for p in plain.parameters()]
    plain.zero_grad(set_to_none=True)
    plain.train()
    adv = pgd_attack(plain, x, y, **STRONG)
    assert plain.training  # mode restored
    assert all(p.grad is None for p in plain.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, plain.parameters()))
    pixels, adv_pixels = x * STD + MEAN, adv * STD + MEAN
    assert (adv_pixels - pixels).abs().max() <= 0.1 + 1e-5
    assert adv_pixels.min() >= -1e-6 and adv_pixels.max() <= 1 + 1e-6
    assert not torch.equal(adv, x) and not adv.requires_grad


def test_per_channel_normalisation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    pixels = torch.rand(6, 3, 6, 6)
    x = (pixels - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    adv = pgd_attack(model, x, torch.arange(6) % 5, mean=mean, std=std, generator=torch.Generator().manual_seed(0))
    adv_pixels = adv * torch.tensor(std).view(1, 3, 1, 1) + torch.tensor(mean).view(1, 3, 1, 1)
    assert (adv_pixels - pixels).abs().max() <= 8 / 255 + 1e-6
    assert adv_pixels.min() >= -1e-6 and adv_pixels.max() <= 1 + 1e-6
    with pytest.raises(AdversarialError, match="per-channel"):
        pgd_attack(model, x, torch.zeros(6, dtype=torch.long), mean=(0.5, 0.5), std=(0.2, 0.2))


def test_zero_steps_without_start_is_identity(plain, digits):
    _, _, xte, yte = digits
    assert torch.equal(pgd_attack(plain, xte[:8], yte[:8], steps=0, random_start=False), xte[:8])


def test_adversarial_batch_ratio(plain, digits):
    _, _, xte, yte = digits
    x, y = xte[:40], yte[:40]
    g = torch.Generator().manual_seed(3)
    assert torch.equal(adversarial_batch(plain, x, y, ratio=0.0), x)
    mixed = adversarial_batch(plain, x, y, ratio=0.5, generator=g, **STRONG)
    changed = (mixed != x).flatten(1).any(1)
    assert int(changed.sum()) == 20
    full = adversarial_batch(plain, x, y, ratio=1.0, generator=g, **STRONG)
    assert bool((full != x).flatten(1).any(1).all())


def test_robust_accuracy_accepts_batches(plain, digits):
    _, _, xte, yte = digits
    kw = dict(steps=3, random_start=False, mean=MEAN, std=STD, eps=0.1, step=0.04)
    whole = robust_accuracy(plain, (xte, yte), batch_size=1000, **kw)
    batched = robust_accuracy(plain, [(xte[i:i + 100], yte[i:i + 100]) for i in range(0, len(xte), 100)], **kw)
    assert whole == batched
    with pytest.raises(AdversarialError, match="no samples"):
        robust_accuracy(plain, [])


@pytest.mark.parametrize("kw", [dict(eps=-0.1), dict(steps=-1), dict(steps=1.5), dict(clamp=(1.0, 0.0)),
                                dict(std=0.0), dict(step=float("nan"))])
def test_bad_parameters(plain, digits, kw):
    _, _, xte, yte = digits
    with pytest.raises(AdversarialError):
        pgd_attack(plain, xte[:2], yte[:2], **kw)


def test_config():
    cfg = PGDConfig()
    assert (cfg.eps, cfg.step, cfg.steps, cfg.ratio) == (8 / 255, 2 / 255, 7, 0.5)
    assert "ratio" not in cfg.attack_kwargs()
    with pytest.raises(AdversarialError):
        PGDConfig(ratio=1.5)
    with pytest.raises(AdversarialError):
        PGDConfig(eps=-1)
    with pytest.raises(AdversarialError):
        adversarial_batch(nn.Identity(), torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), ratio=-0.1)
    with pytest.raises(AdversarialError, match="y"):
        pgd_attack(nn.Identity(), torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
