"""Privacy check: reconstruction attacks on p-FESTA uploads, with and without permutation."""
from __future__ import annotations

import pytest
import torch

from protocols.reconstruction import (AttackConfig, decoder_attack, known_embedder_attack, mse,
                                      observed_features, ssim)
from protocols.split_parts import ViTSplitConfig, build_plain_embedder, digits_images

CFG = ViTSplitConfig(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=2, num_heads=2)


@pytest.fixture(scope="module")
def images():
    x, _ = digits_images(16)
    return x[torch.randperm(len(x), generator=torch.Generator().manual_seed(0))]


def test_ssim_and_mse_sanity(images):
    a = images[:8]
    noisy = (a + 0.1 * torch.randn(a.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    assert ssim(a, a) == pytest.approx(1.0) and mse(a, a) == 0
    assert 0 < ssim(a, noisy) < 0.98 and ssim(a, torch.zeros_like(a)) < ssim(a, noisy)


def test_permutation_defeats_the_decoder_attack(images):
    """Attacker with 1000 public digits vs 300 private ones; same decoder and budget."""
    torch.set_num_threads(1)
    emb = build_plain_embedder(CFG, seed=0)
    cfg = AttackConfig(steps=300)
    plain = decoder_attack(emb, images[:1000], images[1000:1300], permute=False, cfg=cfg)
    perm = decoder_attack(emb, images[:1000], images[1000:1300], permute=True, cfg=cfg)
    print("without permutation", plain, "with permutation", perm)
    assert plain["mse"] < 0.25 * plain["baseline_mse"] and plain["ssim"] > 0.8  # the attack works...
    assert perm["mse"] > 5 * plain["mse"] and perm["ssim"] < plain["ssim"] - 0.3  # ...until permuted
    assert perm["mse"] > 0.8 * perm["baseline_mse"]  # close to knowing nothing but the mean digit


def test_known_embedder_undoes_permutation_when_tokens_are_wider_than_patches(images):
    """A documented limit: whoever knows the frozen embedder (D=32 > 16 pixels per patch)
    recovers the positions and the pixels exactly; with D == pixels per patch it cannot."""
    gen = torch.Generator().manual_seed(3)
    private = images[1000:1050]
    wide = build_plain_embedder(CFG, seed=0)
    rec = known_embedder_attack(wide, observed_features(wide, private, permute=True, gen=gen))
    assert mse(rec, private) < 1e-8
    square_cfg = ViTSplitConfig(img_size=16, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2)
    square = build_plain_embedder(square_cfg, seed=0)
    rec = known_embedder_attack(square, observed_features(square, private, permute=True, gen=gen))
    assert mse(rec, private) > 0.02
