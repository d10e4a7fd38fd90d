"""Privacy check: reconstruction attacks on p-FESTA uploads, with and without permutation.

Two attackers: the p-FESTA paper's (§III-B), who does not know the clients' embedder and
learns F̂, G, D from public digits plus MSD's jigsaw solver (Eq. 5–7), and one who knows the
embedder — the reason the embedder is the clients' secret."""
from __future__ import annotations

import pytest
import torch

from protocols.inversion_attack import AttackConfig, paper_attack
from protocols.reconstruction import known_embedder_attack, mse, observed_features, ssim
from protocols.split_parts import build_plain_embedder, digits_images, new_embedder_state, split_config

CFG = split_config(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=2, num_heads=2)


@pytest.fixture(scope="module")
def images():
    x, _ = digits_images(16)
    return x[torch.randperm(len(x), generator=torch.Generator().manual_seed(0))]


def test_ssim_and_mse_sanity(images):
    a = images[:8]
    noisy = (a + 0.1 * torch.randn(a.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    assert ssim(a, a) == pytest.approx(1.0) and mse(a, a) == 0
    assert 0 < ssim(a, noisy) < 0.98 and ssim(a, torch.zeros_like(a)) < ssim(a, noisy)


def test_paper_attacker_needs_the_order(images):
    """The paper's attacker (no embedder; 900 public digits, disjoint from 300 private ones)
    reconstructs from in-order uploads better than the mean digit, and clearly worse once the
    uploads are permuted, jigsaw solver and all. Same budget both ways."""
    torch.set_num_threads(1)
    emb = build_plain_embedder(CFG, seed=100)  # stands for the clients' secret (seeded: a repeatable test)
    public, private = images[:900], images[900:1200]
    gen = torch.Generator().manual_seed(5)
    ac = AttackConfig(steps=400, hidden=128)  # small budget: the margin is wide
    plain = paper_attack(observed_features(emb, private, permute=False, gen=gen), private, public, CFG,
                         permuted=False, ac=ac)
    perm = paper_attack(observed_features(emb, private, permute=True, gen=gen), private, public, CFG,
                        permuted=True, ac=ac)
    print("without permutation", plain, "with permutation", perm)
    assert plain["mse"] < 0.5 * plain["baseline_mse"] and plain["ssim"] > plain["baseline_ssim"] + 0.25
    assert perm["mse"] > 3 * plain["mse"] and perm["ssim"] < plain["ssim"] - 0.3
    assert perm["ssim"] < perm["baseline_ssim"] + 0.05  # no better than knowing the mean digit


def test_known_embedder_undoes_permutation_when_tokens_are_wider_than_patches(images):
    """Why the embedder is a secret: whoever knows it (D=32 > 16 pixels per patch) recovers
    the positions and the pixels of permuted uploads exactly; with D == pixels per patch
    this particular attack cannot."""
    gen = torch.Generator().manual_seed(3)
    private = images[1000:1050]
    wide = build_plain_embedder(CFG, state=new_embedder_state(CFG))
    rec = known_embedder_attack(wide, observed_features(wide, private, permute=True, gen=gen))
    assert mse(rec, private) < 1e-8
    square_cfg = split_config(img_size=16, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2)
    square = build_plain_embedder(square_cfg, seed=0)
    rec = known_embedder_attack(square, observed_features(square, private, permute=True, gen=gen))
    assert mse(rec, private) > 0.02
