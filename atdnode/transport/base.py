"""The transport interface the daemon talks to: gossip topics plus framed request streams.

Two implementations pass the same tests (tests/test_transport_contract.py):
`Libp2pTransport` (py-libp2p, Noise + yamux, GossipSub) and `MemoryTransport` (one
process, for tests and netsim's in-memory back-end). Everything is trio-based.

Gossip. A transport never verifies ledger entries itself: the daemon passes a
`validator` to `subscribe`, and only messages it accepts are delivered to the handler or
relayed to other peers. A node's own publications are neither validated nor delivered to
its own handler. `from_peer` (validator and handler) is the neighbour that forwarded the
message to us, not necessarily its originator. Messages are at most `MAX_GOSSIP` bytes.

Streams. Frames are length-prefixed (4-byte big-endian length, then payload) because a
libp2p stream's `read()` returns whatever happens to be buffered (see framing.py). A frame
above the reader's `max_size` is a protocol violation: the reader resets the stream and
raises `FrameError`. A clean end of stream at a frame boundary raises `StreamClosed`;
an end in the middle of a frame is a `FrameError`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractAsyncContextManager
from typing import Awaitable, Callable

from trio.lowlevel import checkpoint as trio_checkpoint

MAX_FRAME = 8 << 20  # 8 MiB: one blob chunk plus headers fits with room to spare
MAX_GOSSIP = (1 << 20) - (8 << 10)  # gossipsub drops RPCs > 1 MiB; keep room for the envelope


class TransportError(Exception):
    """A peer is unreachable, a stream broke, or the transport is not running."""


class Libp2pVersionError(TransportError):
    """The installed py-libp2p is not the version atd's py-libp2p patches were written for."""


class FrameError(TransportError):
    """A frame was oversized, truncated or malformed; the stream it came on is closed."""


class StreamClosed(TransportError):
    """The peer closed its side cleanly (end of stream at a frame boundary)."""


class Stream(ABC):
    """A bidirectional stream to one peer, carrying length-prefixed frames.

    `remote_peer` is the peer id; `remote_host` is the peer's IP address when the stream
    runs over IP (libp2p), else None (in-memory). `protocol` is the negotiated protocol id.
    """

    remote_peer: str
    remote_host: str | None = None
    protocol: str = ""

    @abstractmethod
    async def read_frame(self, max_size: int = MAX_FRAME) -> bytes:
        """Return the next whole frame.

        Raises FrameError (oversize: the stream is reset; truncated), StreamClosed (clean
        end of stream) or TransportError (reset / broken).
        """

    @abstractmethod
    async def write_frame(self, data: bytes) -> None:
        """Send one frame (TransportError if the stream is closed or broken)."""

    async def write_frames(self, frames: list[bytes]) -> None:
        """Send several frames in order; a transport may send them in fewer writes."""
        for data in frames:
            await self.write_frame(data)

    @abstractmethod
    async def close(self) -> None:
        """Close our side; the peer's next read sees end of stream. Never raises."""

    @abstractmethod
    async def reset(self) -> None:
        """Abort the stream in both directions (used on protocol violations). Never raises."""


# (stream) -> None; runs in the transport's nursery, one task per inbound stream. The
# transport closes the stream when the handler returns and logs (never propagates) errors.
StreamHandler = Callable[[Stream], Awaitable[None]]
# (data, from_peer) -> accept? Called before delivery and before relaying; must be cheap
# and must not block (it runs on the event loop). An exception counts as "reject".
Validator = Callable[[bytes, str], bool]
# (data, from_peer) -> None; called for accepted messages, one at a time per topic.
MessageHandler = Callable[[bytes, str], Awaitable[None]]
# (peer_id) -> None, called when a connection to a new peer is up.
PeerListener = Callable[[str], Awaitable[None]]
# (peer_id) -> bool: may this peer hold a connection and exchange gossip with us right now?
PeerGate = Callable[[str], bool]


class Transport(ABC):
    """One node's network endpoint. Use as: `async with transport.run(listen): ...`.

    Subscriptions, handlers and listeners may be registered before or inside `run`.
    Leaving `run` closes every connection and stream and cancels every task it started.
    """

    @property
    @abstractmethod
    def peer_id(self) -> str:
        """This node's peer id (`12D3KooW...`, derived from its Ed25519 key)."""

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
        """Register a coroutine called once for every newly connected peer (either direction)."""

    def dialled(self, peer_id: str) -> bool | None:
        """Which end opened our connection to `peer_id`: True when we dialled it, False when
        it dialled us, None when unknown (not connected, connections both ways, or a
        transport that cannot tell). The daemon's connection pull uses it
        (`atdnode.replication.sync_connect`: the dialling end pulls at once, the other waits)."""
        return None

    @abstractmethod
    async def subscribe(self, topic: str, handler: MessageHandler, validator: Validator) -> None:
        """Receive gossip on `topic`; `validator` rejects messages before delivery and relay."""

    @abstractmethod
    def topic_peers(self, topic: str) -> list[str]:
        """Connected peers known to be subscribed to `topic` (publish reaches them)."""

    @abstractmethod
    async def publish(self, topic: str, data: bytes) -> None:
        """Gossip `data` (<= MAX_GOSSIP bytes, else TransportError) to every subscriber of `topic`."""

    @abstractmethod
    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve inbound streams of `protocol` (e.g. `/atd/blob/1.0.0`)."""

    @abstractmethod
    async def open_stream(self, peer_id: str, protocol: str) -> Stream:
        """Open a stream of `protocol` to a connected (or dialable) peer; TransportError if not possible."""

    async def disconnect(self, peer_id: str) -> None:
        """Close our connections to `peer_id` (e.g. a non-member); never raises."""
        await trio_checkpoint()

    def set_peer_gate(self, gate: PeerGate | None) -> None:
        """Install the membership gate the transport applies by itself, at every moment:

        * every new connection, re-connections included, runs `gate(peer)`; a refused peer
          is disconnected at once and no `on_peer_connected` listener hears of it;
        * gossip: nothing is sent to, relayed to or accepted from a peer the gate refuses
          (no mesh, no fanout, no IWANT answers); checked per message, so a peer revoked
          mid-session gets nothing more even before its connection closes.

        The gate must be cheap and synchronous (a set lookup). None: everyone passes."""
        self._peer_gate = gate

    def peer_allowed(self, peer_id: str) -> bool:
        """The installed gate's verdict for `peer_id` (True without a gate)."""
        gate = getattr(self, "_peer_gate", None)
        return gate is None or bool(gate(peer_id))

    def bytes_counters(self) -> dict[str, int]:
        """Application bytes sent / received so far (`{"sent": n, "received": m}`): stream
        frames and gossip payloads, without muxer/encryption overhead."""
        return {"sent": 0, "received": 0}

    def bytes_by_protocol(self) -> dict[str, tuple[int, int]]:
        """The same bytes split by protocol: `{protocol: (sent, received)}` ("gossip" for pubsub)."""
        counter = getattr(self, "_counter", None)
        rows = getattr(counter, "by_protocol", {})
        return {p: (r[0], r[1]) for p, r in list(rows.items())}

    def bytes_by_peer(self) -> dict[str, tuple[int, int]]:
        """Stream bytes per remote peer: `{peer id: (sent, received)}` (gossip not included)."""
        counter = getattr(self, "_counter", None)
        rows = getattr(counter, "by_peer", {})
        return {p: (r[0], r[1]) for p, r in list(rows.items())}
