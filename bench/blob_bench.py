"""Blob store throughput vs. a plain file write / read + SHA-256 of the same bytes.

Prints one JSON object. A weight set of --size-mb MB of random float32 tensors is
serialised as safetensors, then (each --reps times, interleaved, median taken):

  put   store.put_bytes(data)        vs  sha256(data) + write a plain file + fsync
  put_file  store.put_file(path)     vs  the same baseline (one-pass copy + hash)
  get   store.get_bytes(h)           vs  read the plain file + sha256
  save_weights / load_weights        (full weight-set path incl. safetensors and checks)

ratio = baseline seconds / store seconds (1.0 = as fast as the baseline; target >= 0.8).
The baseline fsyncs because the store does (a blob must be durable before it is named);
`put_ratio_vs_nofsync` compares with a write that only reaches the page cache.

    python bench/blob_bench.py [--size-mb 350] [--reps 3] [--dir DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from atdnode.blobs import BlobStore
from atdnode.blobs.store import IO_BUF
from atdnode.models import load_weights, save_weights


def make_tensors(size_mb: int) -> dict[str, torch.Tensor]:
    """Random float32 tensors of about `size_mb` MB in ViT-like 768x768 and 768x3072 blocks."""
    g = torch.Generator().manual_seed(0)
    n_floats, out, i = size_mb * 1_000_000 // 4, {}, 0
    while n_floats > 0:
        cols = 3072 if i % 2 else 768
        rows = max(1, min(768, n_floats // cols))
        out[f"blocks.{i // 2}.{'mlp' if i % 2 else 'attn'}.weight"] = torch.rand(rows, cols, generator=g)
        n_floats -= rows * cols
        i += 1
    return out


def plain_write(data: bytes, path: Path, fsync: bool) -> str:
    h = hashlib.sha256(data).hexdigest()
    mv = memoryview(data)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for o in range(0, len(mv), IO_BUF):
            os.write(fd, mv[o:o + IO_BUF])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return h


def plain_read(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=350)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir); same disk for both")
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="atd-blob-bench-", dir=a.dir))
    try:
        tensors = make_tensors(a.size_mb)
        data = st_save(tensors)
        store = BlobStore(work / "blobs")
        plain = work / "plain.safetensors"
        h = hashlib.sha256(data).hexdigest()
        t: dict[str, list[float]] = {k: [] for k in (
            "base_put", "base_put_nofsync", "put", "put_file", "base_get", "get", "save_weights", "load_weights")}
        for _ in range(a.reps):
            t["base_put"].append(timed(lambda: plain_write(data, plain, True)))
            t["put"].append(timed(lambda: store.put_bytes(data)))
            t["base_put_nofsync"].append(timed(lambda: plain_write(data, plain, False)))
            t["put_file"].append(timed(lambda: store.put_file(plain)))
            t["base_get"].append(timed(lambda: plain_read(plain)))
            t["get"].append(timed(lambda: store.get_bytes(h)))
            t["save_weights"].append(timed(lambda: save_weights(store, tensors, {"bench": True})))
        hw = save_weights(store, tensors, {"bench": True})
        for _ in range(a.reps):
            t["load_weights"].append(timed(lambda: load_weights(store, hw)))
        med = {k: statistics.median(v) for k, v in t.items()}
        mb = len(data) / 1e6
        print(json.dumps({
            "bench": "blob_store", "size_mb": round(mb, 1), "reps": a.reps, "cpus": os.cpu_count(),
            "put_ratio": round(med["base_put"] / med["put"], 3),
            "put_file_ratio": round(med["base_put"] / med["put_file"], 3),
            "get_ratio": round(med["base_get"] / med["get"], 3),
            "put_ratio_vs_nofsync": round(med["base_put_nofsync"] / med["put"], 3),
            "mb_per_s": {k: round(mb / v, 1) for k, v in med.items()},
            "seconds_median": {k: round(v, 4) for k, v in med.items()},
            "target": "put_ratio and get_ratio >= 0.8",
        }, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
