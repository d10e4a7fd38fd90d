"""How `Libp2pTransport` configures its py-libp2p 0.8.1 host, and where it works around
py-libp2p's defaults.

py-libp2p's pubsub silently drops messages in three places; each is configured so bursts
are not lost (see `GossipConfig`, `SizedQueues`): the per-topic spam limit (10 msg/s by
default: disabled by the transport), the per-peer outbound RPC queue (32: raised) and the
subscription channel (32: raised). Which peers to dial, at which addresses, is the daemon's
decision alone: `forget_dial_state` and `no_auto_connector` take it back from py-libp2p.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.peer.id import ID

from atdnode.transport.base import TransportError
from atdnode.transport._libp2p.tcp_exclusive import listen_failure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GossipConfig:
    """GossipSub parameters; defaults suit consortia of a few to a few dozen nodes."""

    degree: int = 6
    degree_low: int = 4
    degree_high: int = 12
    heartbeat_interval: int = 1  # seconds: mesh repair and IHAVE gossip
    peer_queue_size: int = 8192  # outbound RPCs queued per peer (libp2p default 32)
    subscription_queue: int = 100_000  # received messages waiting for our handler (default 32)
    pending_per_peer: int = 10_000  # messages held for a peer whose identify is pending (100)
    seen_ttl: int = 600  # seconds a message id stays in the seen cache



class SizedQueues(dict):
    """`Pubsub.peer_queues` replacement that raises each new peer queue's bound."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __setitem__(self, peer: Any, queue: Any) -> None:
        inner = getattr(queue, "_queue", None)  # RpcQueue -> PriorityQueue (libp2p 0.8.1 internals)
        if inner is not None and hasattr(inner, "max_size"):
            inner.max_size = self.size
        else:
            log.warning("cannot raise the pubsub peer queue bound (libp2p internals changed); bursts may drop")
        super().__setitem__(peer, queue)



def forget_dial_state(host: Any, peer: ID) -> None:
    """Before `connect(addr)` dials a peer we hold no connection to: forget the addresses
    the peerstore holds for it and lift py-libp2p's negative dial cache, so the dial goes to
    `addr` and nothing else. py-libp2p dials at most one TCP address per peer, the first the
    peerstore lists, and after a failure refuses every dial to that peer for 60 s ("recently
    failed all addresses (negative cache)"): a member that restarted on a new port was
    never reached once its stale address had been tried. Which addresses to try, in
    which order and how often is the daemon's decision (`atdnode.peers.dialpolicy`)."""
    try:
        host.get_peerstore().clear_addrs(peer)
    except Exception as e:  # a peer the store never saw
        log.debug("clear_addrs %s: %s", peer, e)
    unblock = getattr(host.get_network(), "unblock_peer", None)
    if unblock is None:
        log.warning("cannot lift libp2p's negative dial cache (libp2p internals changed); a stale address may "
                    "block a peer's new one for 60 s")
        return
    unblock(peer)



def check_listening(host: Any, maddrs: list[Any]) -> None:
    """py-libp2p logs a listen failure and runs on; refuse to run without every listen address."""
    listeners = getattr(host.get_network(), "listeners", None)
    failed = [m for m in maddrs if listeners is not None and str(m) not in listeners]
    if failed or not host.get_addrs():
        m = failed[0] if failed else maddrs[0]
        raise TransportError(f"cannot listen on {m}: {listen_failure(m) or 'no transport accepted it'}")



def no_auto_connector(host: Any) -> None:
    """Turn off py-libp2p's AutoConnector. It aims at 200 connections (between its 100 and
    300 watermarks) and, every 10 s and on each disconnect, dials peers the peerstore
    knows, so it undid the daemon's bounded peer set (atdnode.peers.peerset): a peer that
    pruned us was dialled again, pruned again, and so on, and that churn (dials, Noise
    handshakes, GossipSub hellos, an on-connect sync each) kept idle daemons busy. Which
    peers to dial is the daemon's decision alone."""
    connector = getattr(host.get_network(), "auto_connector", None)
    if connector is None or not hasattr(connector, "maybe_connect"):
        log.warning("cannot turn off libp2p's auto-connector (libp2p internals changed); peer sets may churn")
        return

    async def never() -> None:
        await trio.lowlevel.checkpoint()

    connector.maybe_connect = never

