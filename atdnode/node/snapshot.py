"""A read-only picture of a running daemon, for views beside it (the dashboard).

`NodeDaemon.snapshot()` returns a `NodeSnapshot`: plain values copied at the call (no
live object of the daemon), cheap enough to take on every page load, on the trio loop.
A view reads the ledger and the blob store itself (its own connections); the snapshot
holds what only the running daemon knows: connections, counters, running fetches, wanted
blobs and the split-learning campaigns its role services run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class FetchProgress:
    """One fetch the daemon started (its report so far)."""

    blob: str
    bytes: int
    holders: tuple[str, ...]
    modes: dict[str, str]  # peer -> "bulk" | "stream"


@dataclass(frozen=True)
class CampaignState:
    """A split-learning campaign one of the node's role services serves."""

    algorithm: str
    round: int
    total: int
    completed: int
    clients: int
    state: str  # "waiting for clients" | "running" | "done" | "failed"
    detail: str


@dataclass(frozen=True)
class NodeSnapshot:
    peer_id: str
    public_key: bytes
    name: str | None
    role: str | None
    addrs: tuple[str, ...]
    peers: tuple[str, ...]  # connected peer ids
    wanted: frozenset[str]  # announced blobs this node still has to fetch
    stats: dict[str, int]  # daemon event counters (gossip, sync, overflow, disk errors)
    fetches: tuple[FetchProgress, ...]
    bytes_by_peer: dict[str, Any]
    bytes_by_protocol: dict[str, Any]
    campaigns: tuple[CampaignState, ...]


def fetch_progress(reports: dict[str, Any]) -> tuple[FetchProgress, ...]:
    """`BlobFetcher.reports` (blob -> FetchReport) as snapshot values."""
    return tuple(FetchProgress(blob=blob, bytes=rep.bytes, holders=tuple(rep.holders), modes=dict(rep.modes))
                 for blob, rep in list(reports.items()))


def campaign_states(services: Iterable[Any]) -> tuple[CampaignState, ...]:
    """The campaigns of the role services that keep a round board (`svc.board`)."""
    out = []
    for svc in services:
        board = getattr(svc, "board", None)
        if board is None:
            continue
        state = ("failed" if getattr(svc, "failed", None) else "done" if board.done
                 else "running" if board.started else "waiting for clients")
        out.append(CampaignState(algorithm=getattr(svc, "algorithm", "?"), round=board.round, total=board.total,
                                 completed=board.completed, clients=len(board.members), state=state,
                                 detail=getattr(svc, "failed", None) or ""))
    return tuple(out)
