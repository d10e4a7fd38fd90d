"""atd on one GPU against the card's own limit and against plain torch/timm loops.

In one run, on one CUDA device:

* the card's measured bf16 matmul rate (8192^3, TFLOP/s) — the ceiling the others are read against;
* per model (ViT-S/16 and ViT-B/16 at 224 px, batch 128): images/s and TFLOP/s (FLOPs from
  `torch.utils.flop_counter`) of atd's `Trainer` as `atd train` runs it by default (small-class
  augmentation on), of atd without augmentation, and of a plain timm bf16 loop (host float32
  batches copied from pinned memory, AdamW); feature extraction (`extract_features`) and
  classification (`predict_classes`, what `atd classify` runs) against plain loops; the
  p-FESTA server body's steps/s (`PFestaServer`: tensors in and out on the CPU, as from the
  wire) against a plain loop of the same split body; peak GPU memory of each model's section.

Data: synthetic 8-bit images (N images, two classes 3:1, so the small class is augmented as
`atd train` would). `--compile` adds atd with torch.compile.

    python bench/gpu_bench.py                 # needs CUDA; prints one JSON object
    python bench/gpu_bench.py --dry-run       # the same code path on the CPU with a tiny model (tests)

Without CUDA (and without --dry-run) it exits with one line on stderr and status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from protocols.vit_config import STEMS

MODELS = ("vit_small_patch16_224", "vit_base_patch16_224")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device) -> float:
    sync(dev)
    t = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t


def matmul_tflops(dev: torch.device, n: int, reps: int) -> float:
    """Measured bf16 (n x n) @ (n x n) rate, TFLOP/s."""
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
    for _ in range(2):
        a @ b
    s = timed(lambda: [a @ b for _ in range(reps)], dev)
    return 2 * n ** 3 * reps / s / 1e12


def synthetic(n: int, cfg, seed: int = 0):
    """8-bit images normalised as the loader does, labels 3:1 (class 1 is 'small')."""
    from atdnode.data import MEAN, STD, LabeledImages

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, cfg.in_chans, cfg.img_size, cfg.img_size), generator=g, dtype=torch.uint8)
    labels = (torch.arange(n) % 4 == 3).long()
    return LabeledImages(images=(q.float() / 255.0 - MEAN) / STD, labels=labels, classes=["big", "small"], spec="bench")


def flops_per_image(model, cfg, dev: torch.device, *, train: bool, b: int = 4) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(b, cfg.in_chans, cfg.img_size, cfg.img_size, device=dev)
    y = torch.zeros(b, dtype=torch.long, device=dev)
    with FlopCounterMode(display=False) as fc:
        if train:
            F.cross_entropy(model(x).float(), y).backward()
        else:
            with torch.no_grad():
                model(x)
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops() / b


def plain_train(model, opt, images, labels, batch: int, dev: torch.device, seed: int) -> None:
    model.train()
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    for s in range(0, len(labels), batch):
        i = perm[s:s + batch]
        x = images[i].pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else images[i]
        y = labels[i].to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@torch.no_grad()
def plain_infer(model, images, batch: int, dev: torch.device, features: bool) -> None:
    model.eval()
    for s in range(0, len(images), batch):
        x = images[s:s + batch].to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = model.forward_head(model.forward_features(x), pre_logits=True) if features else model(x).argmax(1)
        out.float().cpu().numpy()


def train_rates(cfg, data, a, dev) -> dict:
    """images/s of atd (default, no augmentation[, compiled]) and of the plain loop."""
    from atdnode.learning.ddp import DistContext
    from atdnode.learning import TrainOptions, Trainer, build_model

    def trainer(**kw) -> Trainer:
        torch.manual_seed(0)
        return Trainer(build_model(cfg).to(dev), data, TrainOptions(epochs=a.epochs + 1, batch_size=a.batch_size, **kw),
                       DistContext(device=dev))

    variants = {"atd_default": dict(), "atd_no_augment": dict(augment=False)}
    if a.compile:
        variants["atd_compiled"] = dict(compile=True)
    out = {}
    for name, kw in variants.items():
        t = trainer(**kw)
        t.train_epoch(0)  # warm-up (and compilation)
        secs = timed(lambda: [t.train_epoch(e + 1) for e in range(a.epochs)], dev)
        out[name] = {"samples_per_epoch": len(t.sources), "images_per_s": len(t.sources) * a.epochs / secs}
        del t
    torch.manual_seed(0)
    plain = build_model(cfg).to(dev)  # the same timm model (a conv stem too) as `ours`
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.05)
    plain_train(plain, opt, data.images, data.labels, a.batch_size, dev, 0)
    secs = timed(lambda: [plain_train(plain, opt, data.images, data.labels, a.batch_size, dev, e + 1)
                          for e in range(a.epochs)], dev)
    out["plain"] = {"samples_per_epoch": len(data), "images_per_s": len(data) * a.epochs / secs}
    return out


def infer_rates(cfg, data, a, dev) -> dict:
    from atdnode.learning import build_model, extract_features, predict_classes

    torch.manual_seed(0)
    ours = build_model(cfg).to(dev)
    plain = build_model(cfg).to(dev)  # the same timm model (a conv stem too) as `ours`
    fb, n = 256, len(data)
    runs = {"features_atd": lambda: extract_features(ours, data, fb, device=dev),
            "features_plain": lambda: plain_infer(plain, data.images, fb, dev, True),
            "classify_atd": lambda: predict_classes(ours, data.images, fb, device=dev),
            "classify_plain": lambda: plain_infer(plain, data.images, fb, dev, False)}
    out = {}
    for name, fn in runs.items():
        fn()
        out[name] = n * a.reps / timed(lambda: [fn() for _ in range(a.reps)], dev)
    return out


def pfesta_rates(cfg, a, dev) -> dict:
    """p-FESTA server body steps/s (CPU tensors in and out) vs a plain loop of the same body."""
    from protocols import pfesta
    from protocols.split_parts import SplitBody, TaskSpec, split_config

    scfg = split_config({k: getattr(cfg, k) for k in ("img_size", "patch_size", "in_chans", "embed_dim", "depth",
                                                       "num_heads", "mlp_ratio")})
    b, n = a.batch_size, a.pfesta_samples
    srv = pfesta.PFestaServer(scfg, [TaskSpec("t", "classification", 2)], batch_size=b, max_batch=max(1024, b), device=dev)
    srv.join("c", "t", n)
    feats = torch.randn(n, *srv.token_shape) * 0.02  # (M, N, D) permuted embeddings, as uploaded
    for s in range(0, n, 256):
        srv.receive_features("c", s, feats[s:s + 256])
    g = torch.randn(b, *srv.token_shape) * 1e-3

    def server_steps(k: int) -> None:
        for _ in range(k):
            idx = srv.next_indices("c")
            srv.forward("c", idx)
            srv.backward("c", g[:len(idx)])

    body = SplitBody(scfg, seed=0).to(dev)
    opt = torch.optim.AdamW(body.parameters(), lr=1e-3, weight_decay=0.05, **({"fused": True} if dev.type == "cuda" else {}))
    fd, gd = feats.to(dev), g.to(dev)

    def plain_steps(k: int) -> None:
        for i in range(k):
            idx = torch.randint(0, n, (b,), generator=torch.Generator().manual_seed(i)).to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                out = body(fd[idx]).float()
            out.backward(gd)
            opt.step()
            opt.zero_grad(set_to_none=True)

    server_steps(2)
    plain_steps(2)
    k = a.pfesta_steps
    s_srv = k / timed(lambda: server_steps(k), dev)
    s_plain = k / timed(lambda: plain_steps(k), dev)
    return {"server_steps_per_s": s_srv, "plain_steps_per_s": s_plain, "ratio": s_srv / s_plain, "batch": b}


def bench_model(name: str, a, dev: torch.device) -> dict:
    from atdnode.learning import build_model, resolve_config

    if a.dry_run:
        cfg = resolve_config("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                             stem=a.stem)
    else:
        cfg = resolve_config(name, stem=a.stem)
    cfg = cfg.with_classes(2)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    data = synthetic(a.images, cfg)
    probe = build_model(cfg).to(dev)
    f_train, f_fwd = flops_per_image(probe, cfg, dev, train=True), flops_per_image(probe, cfg, dev, train=False)
    del probe
    train = train_rates(cfg, data, a, dev)
    infer = infer_rates(cfg, data, a, dev)
    out = {"model": cfg.to_dict(), "batch_size": a.batch_size, "images": len(data),
           "train_gflop_per_image": round(f_train / 1e9, 3), "forward_gflop_per_image": round(f_fwd / 1e9, 3)}
    for k, v in train.items():
        out[k] = {"images_per_s": round(v["images_per_s"], 1), "samples_per_epoch": v["samples_per_epoch"],
                  "tflops": round(v["images_per_s"] * f_train / 1e12, 4)}
        if a.matmul_tflops:
            out[k]["share_of_matmul"] = round(v["images_per_s"] * f_train / 1e12 / a.matmul_tflops, 3)
    out["atd_no_augment_vs_plain"] = round(train["atd_no_augment"]["images_per_s"] / train["plain"]["images_per_s"], 3)
    out["atd_default_vs_plain"] = round(train["atd_default"]["images_per_s"] / train["plain"]["images_per_s"], 3)
    out["inference_images_per_s"] = {k: round(v, 1) for k, v in infer.items()}
    out["features_atd_vs_plain"] = round(infer["features_atd"] / infer["features_plain"], 3)
    out["classify_atd_vs_plain"] = round(infer["classify_atd"] / infer["classify_plain"], 3)
    out["pfesta"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in pfesta_rates(cfg, a, dev).items()}
    if dev.type == "cuda":
        out["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2 ** 30, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same code on the CPU with a tiny model and tiny data")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--images", type=int, default=2560, help="synthetic training images (3:1 classes)")
    ap.add_argument("--epochs", type=int, default=1, help="timed epochs per training variant (after one warm-up)")
    ap.add_argument("--reps", type=int, default=3, help="timed passes of each inference loop")
    ap.add_argument("--pfesta-steps", type=int, default=30)
    ap.add_argument("--pfesta-samples", type=int, default=1024)
    ap.add_argument("--compile", action="store_true", help="also time atd with torch.compile")
    ap.add_argument("--stem", choices=STEMS, default="patch", help="the models' stem (protocols.vit_config)")
    a = ap.parse_args(argv)
    if a.dry_run:
        dev = torch.device("cpu")
        torch.set_num_threads(1)  # tiny tensors: one thread beats a contended pool
        a.images, a.batch_size, a.reps, a.pfesta_steps, a.pfesta_samples = 32, 16, 1, 2, 32
        a.models = a.models.split(",")[0]
    elif not torch.cuda.is_available():
        print("gpu_bench: no CUDA device on this machine (use --dry-run to run its code on the CPU)", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = True
    a.matmul_tflops = matmul_tflops(dev, 256 if a.dry_run else 8192, 2 if a.dry_run else 20)
    t0 = time.perf_counter()
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)",
           "torch": torch.__version__, "dry_run": a.dry_run,
           "matmul_tflops": {"dtype": "bfloat16" if dev.type == "cuda" else "float32",
                             "n": 256 if a.dry_run else 8192, "tflops": round(a.matmul_tflops, 4)},
           "models": {m: bench_model(m, a, dev) for m in a.models.split(",")}}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
