"""Privacy check: reconstruction attacks on p-FESTA uploads, with and without permutation.

Attackers who do not know the clients' embedder (p-FESTA §III-B): F̂, G, D learned from public
digits (MSD Eq. 5-6), then MSD Eq. 7's transformer jigsaw, an order-free per-token decoder and
a position MLP (`protocols.inversion_attack`); and one who knows the embedder -- the reason
the embedder is the clients' secret."""
from __future__ import annotations

import pytest
import torch

from protocols.inversion_attack import ATTACKERS, AttackConfig, attack_all
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


@pytest.mark.slow  # trains four attackers (~16 s)
def test_every_attacker_needs_the_order(images):
    """The attackers who do not know the embedder (900 public digits, disjoint from 300
    private ones; one F̂ / G training shared): MSD Eq. 7's transformer jigsaw J, the order-free
    per-token decoder and the position MLP. In order (the positive control) the strongest
    rebuilds the private digits far better than the mean public digit; permuted, every one
    of them -- the strongest included -- stays above the mean digit's MSE and below its SSIM.
    Same budget both ways. bench/inversion_bench.py reports the same at a larger position
    table scale."""
    torch.set_num_threads(1)
    emb = build_plain_embedder(CFG, seed=100)  # stands for the clients' secret (seeded: a repeatable test)
    public, private = images[:900], images[900:1200]
    gen = torch.Generator().manual_seed(5)
    ac = AttackConfig(steps=400, hidden=128, jigsaw_steps=200)  # small budget: the margins are wide
    plain = attack_all(observed_features(emb, private, permute=False, gen=gen), private, public, CFG,
                       permuted=False, ac=ac)
    perm = attack_all(observed_features(emb, private, permute=True, gen=gen), private, public, CFG,
                      permuted=True, ac=ac)
    print("without permutation", plain, "with permutation", perm)
    base = plain["baseline"]
    best_plain = min(ATTACKERS, key=lambda n: plain[n]["mse"])
    assert plain[best_plain]["mse"] < 0.5 * base["mse"] and plain[best_plain]["ssim"] > base["ssim"] + 0.25
    assert plain["per_token"]["mse"] < base["mse"]  # the order-free decoder works when it has the order
    for name in ATTACKERS:  # MSD Eq. 7 and the per-token decoder among them
        assert perm[name]["mse"] > base["mse"], (name, perm[name], base)
        assert perm[name]["ssim"] < base["ssim"] + 0.05, (name, perm[name], base)
    assert min(perm[n]["mse"] for n in ATTACKERS) > 3 * plain[best_plain]["mse"]


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
