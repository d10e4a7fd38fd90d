"""Faults, applied the same way to either back-end, each with a deadline and a recorded outcome.

    kill       the node dies at once (no clean shutdown); its disk survives
    restart    a killed or stopped node starts again from its persisted state
    partition  links between the named groups go down (gossip is lost, streams stall)
    heal       every link comes back up
    slow_link  one link (both ways) gets other latency / bandwidth / loss
    late_join  a node that was not started at the beginning starts now
    leave      the node shuts down cleanly and never returns (it is no longer expected
               to hold anything; what it published before leaving still counts)

A back-end that cannot do a fault (e.g. `partition` with real processes on a machine
without network namespaces) raises `FaultUnsupported`; the outcome says so and the run
goes on. Nothing waits without a deadline: a fault that does not finish in its
`deadline_s` is recorded as "timeout".
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Protocol

import trio

from netsim.scenario import FaultSpec


class FaultUnsupported(Exception):
    """This back-end cannot inject this fault here (the message says why)."""


class Cluster(Protocol):
    """What faults and workloads need from a back-end (memnet.MemCluster, procnet.ProcCluster)."""

    names: list[str]
    status: dict[str, str]

    def alive(self, name: str) -> bool: ...
    async def start(self, name: str, bootstrap: list[str] = ()) -> None: ...
    async def kill(self, name: str) -> None: ...
    async def stop(self, name: str, *, status: str = "stopped") -> None: ...
    async def restart(self, name: str, bootstrap: list[str] = ()) -> None: ...
    def partition(self, groups: list[list[str]]) -> None: ...
    def heal(self) -> None: ...
    def set_link(self, a: str, b: str, *, latency_ms: float | None = None, bandwidth_mbps: float | None = None,
                 loss: float | None = None) -> None: ...


@dataclass
class FaultOutcome:
    kind: str
    target: str
    at_s: float  # when it was applied (seconds since the workload started; simulated on memnet)
    status: str = "done"  # done | timeout | unsupported | error
    detail: str = ""
    took_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["at_s"] = round(self.at_s, 3)
        d["took_s"] = round(self.took_s, 3)
        return d


def describe_target(f: FaultSpec) -> str:
    if f.kind == "partition":
        return " | ".join(",".join(g) for g in f.groups)
    if f.kind == "slow_link":
        return f"{f.a}<->{f.b}"
    return f.node or "all"


def pick_bootstrap(cluster: Cluster, name: str, k: int, seed: int) -> list[str]:
    """Up to k live peers for `name` to dial (seeded choice, never itself)."""
    live = [n for n in cluster.names if n != name and cluster.alive(n)]
    rng = random.Random(f"{seed}|boot|{name}|{len(live)}")
    return sorted(rng.sample(live, min(k, len(live))), key=cluster.names.index)


async def apply_fault(cluster: Cluster, f: FaultSpec, *, t0: float, seed: int, degree: int = 3) -> FaultOutcome:
    """Inject one fault now; never raises for a fault that fails — the outcome records it."""
    start = trio.current_time()
    out = FaultOutcome(kind=f.kind, target=describe_target(f), at_s=start - t0)
    try:
        with trio.move_on_after(f.deadline_s) as scope:
            if f.kind == "kill":
                await cluster.kill(f.node)
            elif f.kind == "restart":
                await cluster.restart(f.node, pick_bootstrap(cluster, f.node, degree, seed))
            elif f.kind == "late_join":
                await cluster.start(f.node, pick_bootstrap(cluster, f.node, degree, seed))
            elif f.kind == "leave":
                await cluster.stop(f.node, status="left")
            elif f.kind == "partition":
                cluster.partition([list(g) for g in f.groups])
            elif f.kind == "heal":
                cluster.heal()
            elif f.kind == "slow_link":
                cluster.set_link(f.a, f.b, latency_ms=f.latency_ms, bandwidth_mbps=f.bandwidth_mbps, loss=f.loss)
            else:  # validated earlier; kept for safety
                raise FaultUnsupported(f"unknown fault {f.kind!r}")
        if scope.cancelled_caught:
            out.status, out.detail = "timeout", f"not done within {f.deadline_s:g} s"
    except FaultUnsupported as exc:
        out.status, out.detail = "unsupported", str(exc)
    except Exception as exc:  # a harness-level failure of one fault must not hide the others
        out.status, out.detail = "error", f"{type(exc).__name__}: {exc}"
    out.took_s = trio.current_time() - start
    return out


async def run_schedule(cluster: Cluster, faults: list[FaultSpec], *, t0: float, seed: int, degree: int,
                       outcomes: list[FaultOutcome]) -> None:
    """Apply time-triggered faults (`at_s`) in time order, each at its moment after t0."""
    for f in sorted((f for f in faults if f.at_s is not None), key=lambda f: f.at_s):
        await trio.sleep_until(t0 + f.at_s)
        outcomes.append(await apply_fault(cluster, f, t0=t0, seed=seed, degree=degree))
