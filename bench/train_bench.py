"""Throughput of atd's training loop and feature extraction vs plain timm + torch loops.

Same model config, batch, data and process; the two sides alternate (median of `--reps`
timed passes each) so machine noise hits both alike. atd's loop runs without
augmentation here, so both sides do the same arithmetic; the ratio measures the
overhead of atd's loop (schedule, batch slicing, DDP-ready loss scaling, bookkeeping).
`train.atd_default_images_per_s` is atd's default loop (small-class augmentation on), in
images of the original set per second (the enlarged epoch has more samples).

    python bench/train_bench.py [--embed-dim 96 --depth 4 --img-size 32 --patch-size 8 --batch-size 64 --reps 3]

Prints one JSON object: images/s of each side and the ratios (target >= 0.9).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from atdnode.data import load_dataset
from atdnode.learning.ddp import DistContext, pick_device
from atdnode.learning import TrainOptions, Trainer, build_model, extract_features, resolve_config
from protocols.vit_config import STEMS


def plain_epoch(model, opt, images, labels, batch_size, seed, device) -> None:
    model.train()
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    for s in range(0, len(labels), batch_size):
        i = perm[s:s + batch_size]
        x, y = images[i].to(device), labels[i].to(device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


@torch.no_grad()
def plain_features(model, images, batch_size, device) -> None:
    model.eval()
    for s in range(0, len(images), batch_size):
        model.forward_features(images[s:s + batch_size].to(device))[:, 0].float().cpu().numpy()


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vit_tiny_patch16_224")
    ap.add_argument("--img-size", type=int, default=32)
    ap.add_argument("--patch-size", type=int, default=8)
    ap.add_argument("--embed-dim", type=int, default=96)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--data", default="digits")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stem", choices=STEMS, default="patch", help="patch or conv (protocols.vit_config)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = pick_device()
    cfg = resolve_config(a.model, img_size=a.img_size, patch_size=a.patch_size, embed_dim=a.embed_dim,
                          depth=a.depth, num_heads=a.heads, stem=a.stem)
    data = load_dataset(a.data, cfg.img_size, cfg.in_chans, "train")
    cfg = cfg.with_classes(len(data.classes))
    n = len(data)

    torch.manual_seed(0)
    ours = build_model(cfg).to(device)
    trainer = Trainer(ours, data, TrainOptions(epochs=a.reps + 1, batch_size=a.batch_size, augment=False),
                      DistContext(device=device))
    torch.manual_seed(0)
    aug = Trainer(build_model(cfg).to(device), data, TrainOptions(epochs=a.reps + 1, batch_size=a.batch_size),
                  DistContext(device=device))
    torch.manual_seed(0)
    plain = build_model(cfg).to(device)  # the same timm model (a conv stem too) as `ours`
    popt = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.05)

    # warm-up pass each, then alternate
    trainer.train_epoch(0)
    aug.train_epoch(0)
    plain_epoch(plain, popt, data.images, data.labels, a.batch_size, 0, device)
    t_ours, t_plain, t_aug = [], [], []
    for r in range(a.reps):
        t_ours.append(timed(lambda: trainer.train_epoch(r + 1)))
        t_aug.append(timed(lambda: aug.train_epoch(r + 1)))
        t_plain.append(timed(lambda: plain_epoch(plain, popt, data.images, data.labels, a.batch_size, r + 1, device)))

    fb = 256
    extract_features(ours, data, fb)
    plain_features(plain, data.images, fb, device)
    f_ours, f_plain = [], []
    for _ in range(a.reps):
        f_ours.append(timed(lambda: extract_features(ours, data, fb)))
        f_plain.append(timed(lambda: plain_features(plain, data.images, fb, device)))

    def ips(ts):
        return n / statistics.median(ts)

    out = {
        "device": str(device), "threads": torch.get_num_threads(), "model": cfg.to_dict(),
        "images": n, "batch_size": a.batch_size, "reps": a.reps,
        "train": {"atd_images_per_s": round(ips(t_ours), 1), "plain_images_per_s": round(ips(t_plain), 1),
                  "ratio": round(ips(t_ours) / ips(t_plain), 3), "target": 0.9,
                  "atd_default_images_per_s": round(ips(t_aug), 1), "atd_default_samples_per_epoch": len(aug.sources)},
        "features": {"atd_images_per_s": round(ips(f_ours), 1), "plain_images_per_s": round(ips(f_plain), 1),
                     "ratio": round(ips(f_ours) / ips(f_plain), 3), "target": 0.9},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
