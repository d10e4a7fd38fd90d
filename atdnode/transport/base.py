"""The transport interface the daemon talks to: gossip topics plus framed request streams.

Two implementations pass the same tests: `Libp2pTransport` (py-libp2p, Noise + yamux,
GossipSub) and `MemoryTransport` (one process, for tests and netsim's in-memory back-end).
Everything is trio-based. A transport never verifies ledger entries itself: the daemon
passes a `validator` to `subscribe`, and only messages it accepts are delivered or relayed.

Frames on streams are length-prefixed (4-byte big-endian length, then payload) because a
libp2p stream's `read()` returns whatever happens to be buffered. A frame above
`max_size` is a protocol violation: the reader raises `FrameError` and the stream is reset.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractAsyncContextManager
from typing import Awaitable, Callable

MAX_FRAME = 8 << 20  # 8 MiB: one blob chunk plus headers fits with room to spare


class TransportError(Exception):
    """A peer is unreachable, a stream broke, or the transport is not running."""


class FrameError(TransportError):
    """A frame was oversized, truncated or malformed; the stream it came on is closed."""


class Stream(ABC):
    """A bidirectional stream to one peer, carrying length-prefixed frames."""

    remote_peer: str

    @abstractmethod
    async def read_frame(self, max_size: int = MAX_FRAME) -> bytes:
        """Return the next whole frame; raise FrameError (oversize/truncated) or TransportError (closed)."""

    @abstractmethod
    async def write_frame(self, data: bytes) -> None:
        """Send one frame."""

    @abstractmethod
    async def close(self) -> None:
        """Close our side; the peer's next read sees end of stream."""

    @abstractmethod
    async def reset(self) -> None:
        """Abort the stream in both directions (used on protocol violations)."""


# (stream) -> None; runs in the transport's nursery, one task per inbound stream.
StreamHandler = Callable[[Stream], Awaitable[None]]
# (data, from_peer) -> accept? Called before delivery and before relaying; must be cheap.
Validator = Callable[[bytes, str], bool]
# (data, from_peer) -> None
MessageHandler = Callable[[bytes, str], Awaitable[None]]
# (peer_id) -> None, called when a connection to a new peer is up.
PeerListener = Callable[[str], Awaitable[None]]


class Transport(ABC):
    """One node's network endpoint. Use as: `async with transport.run(listen): ...`."""

    @property
    @abstractmethod
    def peer_id(self) -> str:
        """This node's peer id (`12D3KooW...` for libp2p)."""

    @abstractmethod
    def run(self, listen: list[str]) -> AbstractAsyncContextManager[None]:
        """Start listening; the context body runs once the node is ready; exit shuts down cleanly."""

    @abstractmethod
    def addrs(self) -> list[str]:
        """Full listen multiaddrs including `/p2p/<peer id>` (valid inside `run`)."""

    @abstractmethod
    async def connect(self, addr: str) -> str:
        """Dial a full multiaddr (`.../p2p/<id>`); return the remote peer id. TransportError on failure."""

    @abstractmethod
    def peers(self) -> list[str]:
        """Peer ids currently connected."""

    @abstractmethod
    def on_peer_connected(self, listener: PeerListener) -> None:
        """Register a coroutine called for every newly connected peer (either direction)."""

    @abstractmethod
    async def subscribe(self, topic: str, handler: MessageHandler, validator: Validator) -> None:
        """Receive gossip on `topic`; `validator` rejects messages before delivery and relay."""

    @abstractmethod
    async def publish(self, topic: str, data: bytes) -> None:
        """Gossip `data` (<= 1 MiB) to every subscriber of `topic`."""

    @abstractmethod
    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve inbound streams of `protocol` (e.g. `/atd/blob/1.0.0`)."""

    @abstractmethod
    async def open_stream(self, peer_id: str, protocol: str) -> Stream:
        """Open a stream of `protocol` to a connected (or dialable) peer."""

    def bytes_counters(self) -> dict[str, int]:
        """Bytes sent / received so far through this transport (`{"sent": n, "received": m}`)."""
        return {"sent": 0, "received": 0}
