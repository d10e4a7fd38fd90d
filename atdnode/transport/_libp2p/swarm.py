"""Inbound connection slots that end with their connection (py-libp2p 0.8.1 `Swarm`).

py-libp2p admits at most `max_connections - min_connections` inbound connections at a time
(`Swarm._inbound_limiter`, 250 by default). The task that accepted a connection holds its
slot, and after the security and muxer upgrade it waits for the swarm to *stop*, not for
the connection to close: the listener closes the socket when that task returns, so the wait
keeps the connection open, and the slot with it. A connection the node closes at once (the
membership gate refusing an outsider) or a member that disconnects therefore kept its slot
for the node's lifetime, and a few hundred refused dials locked every peer out.

`install()` makes the accepting task return once its connection's muxer has closed (so the
slot is released then), and still waits for the swarm's end while the connection is open.
Connections that fail their upgrade release their slot as before. Pre-multiplexed transports
(QUIC, unused here) keep py-libp2p's behaviour.

`Swarm.close_peer` (what `host.disconnect` and so the gate's refusal call) closed the peer's
connections one by one, each close taking a few hundred ms, and then dropped the peer's
whole entry from the swarm's table: a connection the same peer opened meanwhile (an
outsider dialling in parallel) left the table still open, so nothing ever closed it and its
slot was held for good. `install()` makes it close the connections the peer has and leave
the table to each connection's own cleanup (which unlists it when it closes).

`Swarm.close` (the transport's stop) closed the connections one after another, and each
close waits a fixed 0.2 s (a `trio.sleep(0.1)` in `Yamux.close` and another in
`SwarmConn._cleanup`): a node with a dozen peers took seconds to stop. `install()` makes it
close them all side by side first (each still says GO_AWAY and closes its socket), then do
the rest of py-libp2p's close (listeners, transports, background tasks).
"""
from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

import trio

log = logging.getLogger(__name__)

# (accepting task, its nursery) while that task upgrades a connection. Tasks it spawns
# inherit the variable, so the task is checked too.
_accepting: ContextVar[tuple[Any, trio.Nursery] | None] = ContextVar("atd_accepting", default=None)


async def _end_with(muxed: Any, nursery: trio.Nursery) -> None:
    """Cancel the accepting task's wait (py-libp2p's swarm-lifetime barrier) once `muxed`
    has closed."""
    await muxed.event_closed.wait()
    nursery.cancel_scope.cancel()


def inbound_slots_held(host: Any) -> int:
    """How many of the host's inbound connection slots are taken now (0 when unknown)."""
    limiter = getattr(host.get_network(), "_inbound_limiter", None)
    return int(limiter.borrowed_tokens) if limiter is not None else 0


def install() -> None:
    """Release an inbound connection's slot when the connection closes (module doc).
    Idempotent; `libp2p_transport` calls it at import."""
    from libp2p.network.swarm import Swarm

    handle = Swarm._do_handle_inbound_connection
    if getattr(handle, "atd_slot_per_connection", False):
        return
    upgrade = Swarm.upgrade_inbound_raw_conn

    async def upgrade_inbound_raw_conn(self: Any, raw_conn: Any, maddr: Any) -> Any:
        muxed = await upgrade(self, raw_conn, maddr)
        accepting = _accepting.get()
        if (accepting is not None and accepting[0] is trio.lowlevel.current_task()
                and isinstance(getattr(muxed, "event_closed", None), trio.Event)):
            accepting[1].start_soon(_end_with, muxed, accepting[1])
        return muxed

    async def do_handle_inbound_connection(self: Any, read_write_closer: Any, maddr: Any,
                                           failure_event: Any) -> None:
        """Swarm._do_handle_inbound_connection that returns when its connection closes."""
        async with trio.open_nursery() as nursery:
            token = _accepting.set((trio.lowlevel.current_task(), nursery))
            try:
                await handle(self, read_write_closer, maddr, failure_event)
            finally:
                _accepting.reset(token)
            nursery.cancel_scope.cancel()  # refused or failed before the barrier: no watcher needed

    do_handle_inbound_connection.atd_slot_per_connection = True
    Swarm.upgrade_inbound_raw_conn = upgrade_inbound_raw_conn
    Swarm._do_handle_inbound_connection = do_handle_inbound_connection
    Swarm.close_peer = close_peer
    swarm_close = Swarm.close

    async def close(self: Any) -> None:
        """Swarm.close that closes the open connections side by side first (module doc)."""
        if not getattr(self, "_closing", False):  # a second close stays a no-op
            await close_all(self)
        await swarm_close(self)

    Swarm.close = close


async def close_all(swarm: Any) -> None:
    """Close every connection `swarm` lists, all at once; returns when each has closed."""
    conns = [(peer_id, c) for peer_id, cs in list(swarm.connections.items()) for c in list(cs)]
    async with trio.open_nursery() as nursery:
        for peer_id, conn in conns:
            nursery.start_soon(_close_conn, peer_id, conn)


async def _close_conn(peer_id: Any, conn: Any) -> None:
    try:
        await conn.close()
    except Exception as e:  # already closing: the swarm's own close goes on
        log.warning("closing a connection to %s: %s", peer_id, e)


async def close_peer(self: Any, peer_id: Any) -> None:
    """Swarm.close_peer that closes the connections `peer_id` has now and never unlists a
    connection it did not close (module doc): one the peer opens meanwhile stays listed, and
    is closed by the call its own arrival makes (the gate sees every connection)."""
    for conn in self.get_connections(peer_id):
        try:
            self.cleanup_connection_health(peer_id, conn)
            await conn.close()
        except Exception as e:  # already closing
            log.debug("closing a connection to %s: %s", peer_id, e)
