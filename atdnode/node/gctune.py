"""Keep Python's cyclic garbage collector off the gossip path of a daemon process.

A daemon allocates many short-lived container objects per gossiped message (py-libp2p
creates a task, protobuf messages and trio outcomes per RPC), so with CPython's default
thresholds (700, 10, 10) the collector runs hundreds of times a second and, every 100th
time, walks every tracked object of the process -- the ~100k objects of the imported
modules (trio, libp2p, typer, ...) included. Those collections pause the event loop and
are the tail of the gossip latency (measured in bench/daemon_bench.py: `gc` pauses).

`tune_gc()` is called once the daemon's start-up is done: `gc.freeze()` moves every object
alive then (modules, classes, the transport) to the permanent generation that
collections do not walk, and the first threshold is raised so young objects, which
reference counting frees anyway, are scanned less often. Cycles are still collected.
"""
from __future__ import annotations

import gc

GEN0_THRESHOLD = 10_000

_done = False


def tune_gc() -> None:
    """Freeze start-up objects and raise the gen-0 threshold (once per process)."""
    global _done
    if _done:
        return
    _done = True
    gc.collect()  # do not freeze garbage
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(GEN0_THRESHOLD, gc.get_threshold()[0]), g1, g2)
