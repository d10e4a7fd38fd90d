"""Random number generators of a daemon's loops, seedable for reproducible simulations.

A real daemon draws its choices (which peers to dial, the order of periodic sync pulls)
from OS randomness. A simulation (`netsim.memnet`) passes `NodeDaemon(rng_seed=...)` so
that every choice of every node is a function of the scenario seed (with an
unseeded dialer and sync order the time to converge varied 30-150 simulated s between
runs of one scenario).
"""
from __future__ import annotations

import hashlib
import random


def loop_rng(seed: str | None, purpose: str) -> random.Random:
    """A `random.Random` for one loop: from OS randomness when `seed` is None, else a fixed
    function of (`seed`, `purpose`) (each loop its own stream, so one loop drawing more
    does not shift another's choices)."""
    if seed is None:
        return random.Random()
    return random.Random(hashlib.sha256(f"{seed}|{purpose}".encode()).digest())
