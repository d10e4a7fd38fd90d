"""Seeded model construction that stays deterministic when several threads build at once.

torch has one global CPU generator per process. Two threads that each seed it and draw from it
(two split clients fine-tuning in one process, as the in-memory tests and netsim run them)
interleave their draws, so "the same seed" builds different modules from run to run. Every
seeded block in the project goes through :func:`seeded`, which holds one process-wide lock for
the block. Draws from the global generator outside any seeded block are not serialised.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_LOCK = threading.RLock()  # re-entrant: a seeded block may build parts that seed themselves


@contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Within the block torch's global CPU generator is this thread's alone and seeded with
    ``seed`` (None: left as it is); after it, the caller's generator state is restored."""
    with _LOCK, torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        yield
