"""Which new connections start a sync pull (issue 29: start-up pulls once, not from everyone).

A daemon pulls from a peer when it connects (`NodeDaemon._on_peer`): that is how a node
that was away catches up at once instead of at its next periodic sync. But a daemon
starting in an established consortium connects to several peers within moments (its
bootstrap peers, then its peer set filling up), and every one of them answered the same
question: with 1,000 in-memory daemons that was ~16 pulls per node at start-up (both ends
of every connection pull), where the first one already brought the ledger up to date.

`ConnectPulls` coalesces them: a connection starts a pull unless a connection-started pull
is running (that one brings what a peer has), or one succeeded less than `gap_s` ago. A
pull that failed (peer away, refused us: a joiner not admitted yet) does not count, so the
next connection tries again. Nothing else changes: the periodic sync still pulls from each
peer in turn (`Replicator.periodic_sync`), `confirm_head_loop` still pulls from members
until one confirmed our own chain head, and what a skipped peer holds that the pulled one
did not arrives by gossip or by the next periodic pull. A connection after a quiet spell
(a partition healed on libp2p, a member restarting) still pulls at once.
"""
from __future__ import annotations

import math
from typing import Awaitable, Callable

import trio

CONNECT_PULL_GAP_S = 5.0  # after a connection-started pull succeeded, further connections do not pull for this long


class ConnectPulls:
    """Coalesces the pulls that new connections start (module doc). `pull(peer)` is the
    daemon's one pull (`Replicator.pull_from`): its result, None when it failed."""

    def __init__(self, pull: Callable[[str], Awaitable[object | None]], gap_s: float = CONNECT_PULL_GAP_S) -> None:
        self._pull = pull
        self.gap_s = gap_s
        self._running = False
        self._quiet_until = -math.inf
        self.pulls = 0  # connection-started pulls run (status, tests)
        self.skipped = 0  # connections that started none

    def wants(self) -> bool:
        """Would a connection now start a pull?"""
        return not self._running and trio.current_time() >= self._quiet_until

    async def on_connect(self, peer_id: str) -> None:
        """Pull from the newly connected `peer_id` unless `wants()` says no."""
        if not self.wants():
            self.skipped += 1
            await trio.lowlevel.checkpoint()
            return
        self._running = True
        self.pulls += 1
        try:
            result = await self._pull(peer_id)
        finally:
            self._running = False
        if result is not None:
            self._quiet_until = trio.current_time() + self.gap_s
