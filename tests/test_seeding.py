"""Seeded construction is deterministic while other threads build seeded modules too (two split
clients fine-tuning in one process did not reproduce their own results before the lock)."""
from __future__ import annotations

import threading

import torch

from protocols.seeding import seeded
from protocols.split_parts import TaskSpec, TaskTail
from protocols.vit_config import ModelConfig

CFG = ModelConfig(name="vit_tiny_patch16_224", img_size=28, patch_size=4, embed_dim=192, depth=1, num_heads=3, in_chans=1)
SPEC = TaskSpec(name="digit", kind="classification", num_outputs=10)


def test_same_seed_same_module_while_other_threads_seed_and_draw() -> None:
    ref = TaskTail(CFG, SPEC, pool="avg", seed=1).head.weight.clone()
    stop = threading.Event()
    wrong: list[int] = []

    def noisy() -> None:  # another client: its own seeded blocks, drawing all the time
        k = 0
        while not stop.is_set():
            with seeded(1000 + k):
                torch.randn(4096)
            k += 1

    def builder() -> None:
        for i in range(60):
            if not torch.equal(TaskTail(CFG, SPEC, pool="avg", seed=1).head.weight, ref):
                wrong.append(i)

    threads = [threading.Thread(target=noisy) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        builder()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert wrong == [], f"{len(wrong)} of 60 builds differed from the same seed's module"


def test_seeded_restores_the_callers_generator() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with seeded(123):
        torch.rand(10)
    assert torch.equal(torch.rand(3), expected)
