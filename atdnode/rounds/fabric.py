"""How a round runner (`atdnode.rounds.runner.RoundRunner`) reaches its daemon and tells time.

Split from `atdnode.rounds.runner` (the loop) so the loop knows one interface: `Fabric`. Two
implementations: `ControlFabric` here (the CLI: the node's daemon through its control
socket, the wall clock) and netsim's in-memory one (`netsim.fat.MemFabric`: the daemon
object in the same trio run, a simulated clock). Tests script their own (a fabric that
lets gossip arrive late, connected peers that come and go).

Blob readiness goes through the daemon's `fetch` control op (it returns when the blob is
stored); there is no push channel from daemon to CLI, so the runner notices new entries
by re-reading the local ledger (the daemon merges gossip into it).
"""
from __future__ import annotations

import time

import trio

from atdnode.node import control
from atdnode.errors import AtdError
from atdnode.node import NodeHome
from atdnode.rounds.rules import RoundsError


class Fabric:
    """How a round runner reaches its daemon and tells time (see the module doc).

    `fetch` returns once the blob is stored or raises an AtdError; `peers` lists the
    daemon's connected peers, or None when there is no daemon to ask. `wall_clock` says
    whether `now()` is the wall clock (the CLI) or a simulated one (netsim: compute takes
    no simulated time, so exchange time is the simulated network time)."""

    wall_clock = True

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)

    async def trained(self, seconds: float) -> None:
        """Called after local training took `seconds` of compute (wall clock: already
        passed; a simulated fabric may let simulated time pass, e.g. a slow member)."""

    async def fetch(self, blob: str, timeout: float) -> None:
        raise RoundsError("no daemon to fetch from")

    async def peers(self) -> list[str] | None:
        return None

    def peer_target(self) -> int | None:
        """The daemon's peer-set target (config.toml `[peers] target`), None when unknown."""
        return None


class ControlFabric(Fabric):
    """The CLI's fabric: the node's daemon through its control socket."""

    def __init__(self, home: NodeHome) -> None:
        from atdnode.node import NodeConfig
        from atdnode.peers import PeerSetConfig

        self.sock = home.control_socket
        try:  # read once, as the daemon does at start (not on every liveness poll)
            self._peer_target: int | None = PeerSetConfig.from_table(NodeConfig.load(home).extra.get("peers")).target
        except AtdError:
            self._peer_target = None

    def peer_target(self) -> int | None:
        return self._peer_target

    def _running(self) -> bool:
        return control.daemon_running(self.sock)

    async def fetch(self, blob: str, timeout: float) -> None:
        if not await trio.to_thread.run_sync(self._running):
            raise RoundsError("no daemon running")
        await trio.to_thread.run_sync(lambda: control.call(self.sock, "fetch", blob=blob, timeout_s=timeout,
                                                           timeout=timeout + 5))

    async def peers(self) -> list[str] | None:
        def ask() -> list[str] | None:
            if not self._running():
                return None
            try:
                return list(control.call(self.sock, "peers")["peers"])
            except AtdError:
                return None
        return await trio.to_thread.run_sync(ask)
