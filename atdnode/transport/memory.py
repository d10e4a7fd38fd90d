"""In-process transport: `MemoryNetwork` (the hub) and `MemoryTransport` (one node on it).

Same semantics as the libp2p transport (the contract tests run against both): gossip with
a seen-cache of content ids (SHA-256 of the data, like `libp2p_pubsub.content_id`: the
same bytes published again are a duplicate), a validator called before delivery and
relay, relaying only to subscribed neighbours; streams carry bytes through `framing.FramedStream`, so frame rules are shared.

Links are simulated per direction (`LinkConditions`, in `atdnode.transport.memory_link`): latency, bandwidth (bytes/s), gossip
loss probability, and up/down (partitions). Stream bytes are reliable (like TCP): they are
delayed by serialization + latency and stall while a link is down; gossip messages on a
down or lossy link are dropped. Every decision that uses randomness draws from a per-link
RNG seeded from (network seed, src, dst), so a run is reproducible with trio's MockClock.
`MemoryNetwork.link_stats()` / `node_stats()` expose byte and message counters, and
`add_observer` hooks see every transmission (netsim builds its reports on these).

Gossip fan-out. By default a node relays to every connected subscriber (flooding: right
for a handful of nodes and the contract tests). With `mesh=(D, D_low, D_high)` it keeps a
GossipSub-style mesh per topic instead (GossipSub v1.0 spec, "mesh maintenance"; the
degrees the daemon derives from its peer set, `atdnode.peers.peerset.gossip_degrees`): it
publishes and relays to its mesh peers only. A mesh below D_low is topped up to D from the
connected subscribers (GRAFT; the other side refuses once its mesh holds D_high, like a
PRUNE), a disconnected peer leaves both meshes, and a mesh peer whose link is found down
when sending is dropped from the mesh (what a dead connection does to a real one).
Deviations, all simulation shortcuts: GRAFT/PRUNE take effect at once without control
messages, the mesh is repaired when used (on the next publish or relay after a connection
change) rather than on a 1 s heartbeat, and there is no IHAVE/IWANT lazy gossip -- what
the mesh misses, the daemon's ledger sync repairs.
"""
from __future__ import annotations

import hashlib
import heapq
import logging
import math
import random
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.keys import peer_id_from_public_key

from atdnode.transport.base import (
    MAX_GOSSIP,
    MessageHandler,
    PeerListener,
    Stream,
    StreamHandler,
    Transport,
    TransportError,
    Validator,
)
from atdnode.transport.memory_link import Link, LinkConditions, MemoryNetwork, Observer  # noqa: F401 (re-exported)
from atdnode.transport.memory_pipe import LinkPipe, pipe_pair
from atdnode.transport.framing import Counter, FramedStream

log = logging.getLogger(__name__)

SEEN_CACHE = 200_000  # message ids remembered per node (like gossipsub's seen cache)
DISPATCH_BATCH = 64  # gossip messages due at once handled between two checkpoints


def peer_id_from_seed(seed: bytes) -> str:
    """The libp2p peer id (`12D3KooW...`) of the Ed25519 key with this 32-byte seed."""
    return peer_id_from_public_key(Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw())


@dataclass
class _Sub:
    handler: MessageHandler
    validator: Validator
    send: trio.MemorySendChannel
    recv: trio.MemoryReceiveChannel
    started: bool = False


class MemoryTransport(Transport):
    """One node on a `MemoryNetwork`; address `/memory/<name>/p2p/<peer id>`."""

    def __init__(self, network: MemoryNetwork, seed: bytes, *, name: str | None = None,
                 mesh: tuple[int, int, int] | None = None) -> None:
        """`mesh`: GossipSub degrees (D, D_low, D_high) to relay over a mesh; None floods
        every connected subscriber (see the module doc)."""
        if mesh is not None and not 1 <= mesh[1] <= mesh[0] <= mesh[2]:
            raise ValueError(f"mesh degrees must satisfy 1 <= D_low <= D <= D_high, got {mesh}")
        self.net = network
        self._peer_id = peer_id_from_seed(seed)
        self.name = name or self._peer_id[-8:]
        self._conns: set[str] = set()
        self._dialled: set[str] = set()  # connected peers we dialled (`dialled`)
        self._listeners: list[PeerListener] = []
        self._subs: dict[str, _Sub] = {}
        self._handlers: dict[str, StreamHandler] = {}
        self._streams: set[LinkPipe] = set()
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # content ids (SHA-256 of the data)
        self._seqno = 0  # messages published
        self._inbox: list[tuple[float, int, tuple]] = []
        self._inbox_lot = trio.lowlevel.ParkingLot()
        self._nursery: trio.Nursery | None = None
        self._counter = Counter()
        self.rejected = 0  # gossip messages refused by the validator
        self.mesh_degrees = mesh
        self._mesh: dict[str, set[str]] = {}  # topic -> mesh peers (with `mesh` degrees)
        self._mesh_checked: set[str] = set()  # topics topped up since connections last changed
        self._mesh_rng = random.Random(hashlib.sha256(f"{network.seed}|mesh|{self._peer_id}".encode()).digest())

    @property
    def peer_id(self) -> str:
        return self._peer_id

    # -- lifecycle ---------------------------------------------------------------------

    @asynccontextmanager
    async def _run(self) -> AsyncIterator[None]:
        if self._peer_id in self.net.nodes:
            raise TransportError(f"peer {self._peer_id} is already on this network")
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.net.nodes[self._peer_id] = self
            nursery.start_soon(self._dispatch_gossip)
            for topic in self._subs:
                self._start_sub(topic)
            try:
                yield
            finally:
                self.net.nodes.pop(self._peer_id, None)
                self._nursery = None
                for peer in list(self._conns):
                    self._drop_conn(peer)
                for s in list(self._streams):
                    s.abort_now()
                self._streams.clear()
                self._inbox.clear()
                self._mesh.clear()
                nursery.cancel_scope.cancel()

    def run(self, listen: list[str] | None = None):  # listen addresses mean nothing here
        return self._run()

    def addrs(self) -> list[str]:
        return [f"/memory/{self.name}/p2p/{self._peer_id}"]

    def _require_running(self) -> trio.Nursery:
        if self._nursery is None:
            raise TransportError("transport is not running")
        return self._nursery

    # -- connections -------------------------------------------------------------------

    async def connect(self, addr: str) -> str:
        self._require_running()
        parts = addr.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "memory" or parts[2] != "p2p":
            raise TransportError(f"not a memory multiaddr: {addr!r}")
        peer = parts[3]
        other = self.net.nodes.get(peer)
        if other is None or other.name != parts[1]:
            raise TransportError(f"no node at {addr}")
        await self._connect_to(other)
        return peer

    async def _connect_to(self, other: "MemoryTransport") -> None:
        await trio.lowlevel.checkpoint()
        if other is self:
            raise TransportError("cannot connect to self")
        if other.peer_id in self._conns:
            return
        if not (self.net.link(self.peer_id, other.peer_id).is_up() and self.net.link(other.peer_id, self.peer_id).is_up()):
            raise TransportError(f"{other.peer_id} unreachable (link down)")
        self._conns.add(other.peer_id)
        other._conns.add(self.peer_id)
        self._dialled.add(other.peer_id)  # (a stream opened to a peer not connected dials it too)
        other._dialled.discard(self.peer_id)
        self._mesh_checked.clear()
        other._mesh_checked.clear()
        for topic in self._subs:  # a new subscriber to graft (GossipSub does this on its heartbeat)
            self._top_up(topic)
        for topic in other._subs:
            other._top_up(topic)
        self._notify_connected(other.peer_id)
        other._notify_connected(self.peer_id)

    def _notify_connected(self, peer: str) -> None:
        if not self.peer_allowed(peer):  # the membership gate runs on every connection
            self._drop_conn(peer)
            return
        if self._nursery is not None:
            for fn in self._listeners:
                self._nursery.start_soon(fn, peer)

    def _drop_conn(self, peer: str) -> None:
        self._conns.discard(peer)
        self._dialled.discard(peer)
        self._mesh_checked.clear()
        for mesh in self._mesh.values():
            mesh.discard(peer)
        other = self.net.nodes.get(peer)
        if other is not None:
            other._conns.discard(self.peer_id)
            other._dialled.discard(self.peer_id)
            other._mesh_checked.clear()
            for mesh in other._mesh.values():
                mesh.discard(self.peer_id)

    async def disconnect(self, peer_id: str) -> None:
        self._drop_conn(peer_id)
        await trio.lowlevel.checkpoint()

    def peers(self) -> list[str]:
        return sorted(self._conns)

    def dialled(self, peer_id: str) -> bool | None:
        return (peer_id in self._dialled) if peer_id in self._conns else None

    def on_peer_connected(self, listener: PeerListener) -> None:
        self._listeners.append(listener)

    # -- gossip ------------------------------------------------------------------------

    async def subscribe(self, topic: str, handler: MessageHandler, validator: Validator) -> None:
        await trio.lowlevel.checkpoint()
        if topic in self._subs:
            raise TransportError(f"already subscribed to {topic!r}")
        send, recv = trio.open_memory_channel(math.inf)
        self._subs[topic] = _Sub(handler, validator, send, recv)
        if self._nursery is not None:
            self._start_sub(topic)

    def _start_sub(self, topic: str) -> None:
        sub = self._subs[topic]
        if not sub.started:
            sub.started = True
            self._require_running().start_soon(self._deliver_loop, topic, sub)

    async def _deliver_loop(self, topic: str, sub: _Sub) -> None:
        async for data, frm in sub.recv:
            try:
                await sub.handler(data, frm)
            except Exception:  # a handler bug must not kill the transport
                log.exception("gossip handler for %s failed", topic)

    def topic_peers(self, topic: str) -> list[str]:
        return sorted(p for p in self._conns
                      if p in self.net.nodes and topic in self.net.nodes[p]._subs and self.peer_allowed(p))

    async def publish(self, topic: str, data: bytes) -> None:
        self._require_running()
        if len(data) > MAX_GOSSIP:
            raise TransportError(f"gossip message of {len(data)} bytes exceeds {MAX_GOSSIP}")
        await trio.lowlevel.checkpoint()
        self._seqno += 1
        data = bytes(data)
        mid = hashlib.sha256(data).digest()  # content id, as the libp2p transport (libp2p_pubsub.content_id)
        if not self._remember(mid):
            return  # the same bytes already went out through here: a duplicate by content
        msg = (self.peer_id, mid, topic, data)
        self._counter.count("gossip", sent=len(data))
        self._relay(msg, exclude=())

    def _remember(self, mid: bytes) -> bool:
        """Add to the seen cache; False if it was already there."""
        if mid in self._seen:
            return False
        self._seen[mid] = None
        if len(self._seen) > SEEN_CACHE:
            self._seen.popitem(last=False)
        return True

    def mesh_peers(self, topic: str) -> list[str]:
        """The topic's mesh (empty when flooding)."""
        return sorted(self._mesh.get(topic, ()))

    def _targets(self, topic: str) -> list[str]:
        """Where to publish / relay: the topic's mesh (topped up first), or every subscriber."""
        if self.mesh_degrees is None:
            return self.topic_peers(topic)
        if topic not in self._mesh_checked:  # connections changed since the last top-up
            self._mesh_checked.add(topic)
            self._top_up(topic)
        return sorted(self._mesh.get(topic, ()))

    def _top_up(self, topic: str) -> None:
        """Below D_low, graft connected subscribers (seeded random order) up to D."""
        if self.mesh_degrees is None or topic not in self._subs:
            return
        d, d_low, _ = self.mesh_degrees
        mesh = self._mesh.setdefault(topic, set())
        if len(mesh) >= d_low:
            return
        candidates = [p for p in self.topic_peers(topic) if p not in mesh and self.net.link(self.peer_id, p).is_up()]
        self._mesh_rng.shuffle(candidates)
        for peer in candidates:
            if len(mesh) >= d:
                break
            if self.net.nodes[peer]._graft(topic, self.peer_id):
                mesh.add(peer)

    def _graft(self, topic: str, peer: str) -> bool:
        """`peer` asks to join our mesh for `topic`: yes unless it is full (D_high)."""
        if topic not in self._subs or peer not in self._conns or not self.peer_allowed(peer):
            return False
        if self.mesh_degrees is None:
            return True  # flooding: it gets everything anyway
        mesh = self._mesh.setdefault(topic, set())
        if len(mesh) >= self.mesh_degrees[2]:
            return False
        mesh.add(peer)
        return True

    def _leave_mesh(self, topic: str, peer: str) -> None:
        """A mesh link found dead: both sides drop it (and top up on next use)."""
        self._mesh.get(topic, set()).discard(peer)
        self._mesh_checked.clear()
        other = self.net.nodes.get(peer)
        if other is not None:
            other._mesh.get(topic, set()).discard(self.peer_id)
            other._mesh_checked.clear()

    def _relay(self, msg: tuple, exclude: tuple[str, ...]) -> None:
        topic, data = msg[2], msg[3]
        for peer in self._targets(topic):
            if peer in exclude or not self.peer_allowed(peer):  # a mesh peer revoked since it was grafted
                continue
            link = self.net.link(self.peer_id, peer)
            at = link.gossip(len(data))
            if at is None and self.mesh_degrees is not None and not link.is_up():
                self._leave_mesh(topic, peer)
                continue
            node = self.net.nodes[peer]
            if at is not None and msg[1] not in node._seen:  # else it would drop it on arrival
                node._enqueue(at, msg, self.peer_id)

    def _enqueue(self, at: float, msg: tuple, forwarder: str) -> None:
        heapq.heappush(self._inbox, (at, self.net.next_seq(), (msg, forwarder)))
        self._inbox_lot.unpark_all()

    async def _dispatch_gossip(self) -> None:
        """Process arriving gossip in delivery-time order."""
        while True:
            if not self._inbox:
                await self._inbox_lot.park()
                continue
            at = self._inbox[0][0]
            if at > trio.current_time():
                with trio.move_on_at(at):  # an earlier message may arrive meanwhile
                    await self._inbox_lot.park()
                continue
            now, inbox = trio.current_time(), self._inbox
            for _ in range(DISPATCH_BATCH):  # every message due now, then one checkpoint (not one each)
                _, _, (msg, forwarder) = heapq.heappop(inbox)
                self._receive(msg, forwarder)
                if not inbox or inbox[0][0] > now:
                    break
            await trio.lowlevel.checkpoint()

    def _receive(self, msg: tuple, forwarder: str) -> None:
        origin, mid, topic, data = msg
        sub = self._subs.get(topic)
        if sub is None or forwarder not in self._conns or not self.peer_allowed(forwarder) or not self._remember(mid):
            return
        self._counter.count("gossip", received=len(data))
        try:
            ok = bool(sub.validator(data, forwarder))
        except Exception:
            log.exception("validator for %s raised; message rejected", topic)
            ok = False
        if not ok:
            self.rejected += 1
            log.debug("rejected gossip %s from %s on %s via %s", mid.hex()[:12], origin, topic, forwarder)
            return
        sub.send.send_nowait((data, forwarder))
        self._relay(msg, exclude=(forwarder, origin))

    # -- streams -----------------------------------------------------------------------

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        self._handlers[protocol] = handler

    async def open_stream(self, peer_id: str, protocol: str) -> Stream:
        self._require_running()
        other = self.net.nodes.get(peer_id)
        if other is None or other._nursery is None:
            raise TransportError(f"peer {peer_id} is not reachable")
        if peer_id not in self._conns:
            await self._connect_to(other)
        else:
            await trio.lowlevel.checkpoint()
        if other._nursery is None:  # it stopped while we connected (a checkpoint ran)
            raise TransportError(f"peer {peer_id} is not reachable")
        handler = other._handlers.get(protocol)
        if handler is None:
            raise TransportError(f"peer {peer_id} does not support {protocol}")
        mine, theirs = pipe_pair(self.net.link(self.peer_id, peer_id), self.net.link(peer_id, self.peer_id))
        self._streams.add(mine)
        other._streams.add(theirs)
        mine.on_done = self._streams.discard
        theirs.on_done = other._streams.discard
        remote = FramedStream(theirs, self.peer_id, protocol=protocol, counter=other._counter)
        other._nursery.start_soon(other._serve_stream, handler, remote)
        return FramedStream(mine, peer_id, protocol=protocol, counter=self._counter)

    async def _serve_stream(self, handler: StreamHandler, stream: Stream) -> None:
        try:
            await handler(stream)
        except TransportError as e:
            log.debug("stream %s from %s ended: %s", stream.protocol, stream.remote_peer, e)
        except Exception:
            log.exception("stream handler for %s failed", stream.protocol)
            await stream.reset()
        finally:
            await stream.close()

    def bytes_counters(self) -> dict[str, int]:
        return self._counter.as_dict()
