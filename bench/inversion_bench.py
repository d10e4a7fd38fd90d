"""Reconstruction attacks on p-FESTA / MSD uploads, per attacker and position-table scale.

    PYTHONPATH=$PWD python bench/inversion_bench.py [--pos-std 0.1 0.5] [--steps 400]

The setting of tests/test_reconstruction.py (digits 16 px, patch 4, width 32; 900 public
digits the attacker trains on, 300 private ones it must rebuild; the clients' embedder from
`protocols.split_parts.build_plain_embedder`) with the secret position table's std set to
each ``--pos-std`` (`split_parts.SECRET_POS_STD`, the default scale, is swapped for the
run). For in-order uploads (the positive control) and permuted ones, every attacker of
`protocols.inversion_attack.ATTACKERS` (MSD Eq. 7's transformer jigsaw, the order-free
per-token decoder, the position MLP): MSE and SSIM against the private images, next to the
mean-public-image baseline measured in the same run (ratio = attack MSE / baseline MSE;
below 1 the attacker learned something about the images).
"""
from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

import torch

from protocols import split_parts
from protocols.inversion_attack import ATTACKERS, AttackConfig, attack_all
from protocols.reconstruction import observed_features
from protocols.split_parts import build_plain_embedder, digits_images, split_config

CFG = split_config(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=2, num_heads=2)


@contextmanager
def pos_std(value: float):
    old = split_parts.SECRET_POS_STD
    split_parts.SECRET_POS_STD = value
    try:
        yield
    finally:
        split_parts.SECRET_POS_STD = old


def run(scale: float, ac: AttackConfig, images: torch.Tensor) -> dict:
    with pos_std(scale):
        emb = build_plain_embedder(CFG, seed=100)
    public, private = images[:900], images[900:1200]
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        content = (emb(private) - emb.vit.pos_embed).norm(dim=-1).mean().item()
    out = {"pos_std": scale, "pos_norm": float(emb.vit.pos_embed[0].norm(dim=-1).mean()),
           "content_norm": content}
    for order in ("in_order", "permuted"):
        up = observed_features(emb, private, permute=order == "permuted", gen=gen)
        res = attack_all(up, private, public, CFG, permuted=order == "permuted", ac=ac)
        base = res["baseline"]["mse"]
        out[order] = {n: {**{k: round(v, 4) for k, v in res[n].items()}, "mse_over_baseline": round(res[n]["mse"] / base, 3)}
                      for n in (*ATTACKERS, "baseline")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pos-std", type=float, nargs="+", default=[split_parts.SECRET_POS_STD, 0.5])
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args()
    torch.set_num_threads(1)
    x, _ = digits_images(16)
    images = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(0))]
    ac = AttackConfig(steps=a.steps, hidden=128)
    t0 = time.perf_counter()
    rows = [run(s, ac, images) for s in a.pos_std]
    for r in rows:
        print(json.dumps(r), flush=True)
    print(json.dumps({"inversion": rows, "attack_steps": a.steps, "wall_s": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
