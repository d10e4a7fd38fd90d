"""`Libp2pTransport`: the real network transport on py-libp2p 0.8.1.

Host: Ed25519 identity from a 32-byte seed (the ledger key), TCP, Noise security and the
yamux muxer ONLY (no mplex, secio, TLS or plaintext offered), GossipSub for the ledger
topics and stream protocols with `framing.FramedStream` frames. The muxer is
`_libp2p.yamux.TunedYamux` (same /yamux/1.0.0 wire: 1 MiB DATA frames within the peer's
window, a 4 MiB window per stream, one copy per byte through Noise; stock py-libp2p peers
interoperate), so a blob over plain streams (the fallback when the bulk channel is not
offered) moves several times faster than on py-libp2p's own yamux (`bench/transfer_bench.py`).

py-libp2p's pubsub silently drops messages in three places; each is configured so bursts
are not lost (`_libp2p.host.GossipConfig`): the per-topic spam limit (10 msg/s by default:
disabled), the per-peer outbound RPC queue (32: raised) and the subscription channel (32:
raised). `_libp2p` holds every adjustment of py-libp2p (its `__init__` lists them),
`libp2p_stream` the byte-stream adapter under `FramedStream`. The daemon's validator is
registered as a pubsub topic validator, so libp2p runs it before delivering or relaying; a
rejected message is never forwarded.

Hostile peers cost the node nothing lasting: a refused or closed inbound connection gives
its py-libp2p slot back (`_libp2p.swarm`), and a peer sending past a stream's receive window
is disconnected with its bytes dropped (`_libp2p.window`).

Gossip latency here is bounded by CPU, not by the protocol: `_libp2p.pubsub` cuts
py-libp2p's cost per message (coalesced sends, cached addresses, batched yamux credit,
buffered reads, duplicates dropped first, content-addressed ids, no pubsub signature
checks) and publishes the node's own messages to every topic peer (flood publish).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import multiaddr
import trio

import libp2p.pubsub.pubsub as _pubsub_mod
from libp2p import new_host
from libp2p.abc import INotifee
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.tools.anyio_service import background_trio_service

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
from atdnode.transport.framing import Counter, FramedStream
from atdnode.transport._libp2p.host import (
    GossipConfig,
    SizedQueues,
    check_listening,
    forget_dial_state,
    no_auto_connector,
)
from atdnode.transport._libp2p.pubsub import (
    PUBSUB_OPTIONS,
    CoalescingPubsub,
    FloodPublishGossipSub,
    cache_addrs,
    content_id,
)
from atdnode.transport.libp2p_stream import Libp2pBytes
from atdnode.transport._libp2p.swarm import inbound_slots_held
from atdnode.transport._libp2p.swarm import install as _inbound_slot_per_connection
from atdnode.transport._libp2p.tcp_exclusive import install as _exclusive_tcp_listeners
from atdnode.transport._libp2p.window import install as _enforce_receive_windows
from atdnode.transport._libp2p.yamux import TunedYamux

log = logging.getLogger(__name__)

_exclusive_tcp_listeners()  # no SO_REUSEPORT: nobody can bind the daemon's port beside it
_inbound_slot_per_connection()  # a closed inbound connection gives its slot back
_enforce_receive_windows()  # a peer sending past a stream's window is disconnected

DIAL_TIMEOUT = 15.0


class _Notifee(INotifee):
    def __init__(self, owner: "Libp2pTransport") -> None:
        self.owner = owner

    async def opened_stream(self, network: Any, stream: Any) -> None:
        await trio.lowlevel.checkpoint()

    async def closed_stream(self, network: Any, stream: Any) -> None:
        await trio.lowlevel.checkpoint()

    async def connected(self, network: Any, conn: Any) -> None:
        self.owner._on_connection(str(conn.muxed_conn.peer_id))  # every connection, re-connections included
        await trio.lowlevel.checkpoint()

    async def disconnected(self, network: Any, conn: Any) -> None:
        peer = conn.muxed_conn.peer_id
        if not [c for c in network.get_connections(peer) if c is not conn]:  # last one: announce again on return
            self.owner._announced.discard(str(peer))
        await trio.lowlevel.checkpoint()

    async def listen(self, network: Any, maddr: Any) -> None:
        await trio.lowlevel.checkpoint()

    async def listen_close(self, network: Any, maddr: Any) -> None:
        await trio.lowlevel.checkpoint()


class Libp2pTransport(Transport):
    """A py-libp2p host (Noise + yamux over TCP) with GossipSub. Run it once."""

    muxer: type = TunedYamux  # yamux_tuning's wire-compatible muxer; tests set stock Yamux

    def __init__(self, key: bytes | KeyPair, *, gossip: GossipConfig | None = None) -> None:
        """`key`: the node's 32-byte Ed25519 seed, or a libp2p Ed25519 KeyPair made from it."""
        if isinstance(key, KeyPair):
            self._key_pair = key
        elif isinstance(key, (bytes, bytearray)) and len(key) == 32:
            self._key_pair = create_new_key_pair(bytes(key))
        else:
            raise ValueError("Libp2pTransport needs a 32-byte Ed25519 seed or a libp2p KeyPair")
        self._id = ID.from_pubkey(self._key_pair.public_key)
        self._peer_id = self._id.to_base58()
        self.cfg = gossip or GossipConfig()
        self._handlers: dict[str, StreamHandler] = {}
        self._subs: dict[str, tuple[MessageHandler, Validator]] = {}
        self._listeners: list[PeerListener] = []
        self._announced: set[str] = set()  # peers whose "connected" was announced
        self._forwarders: OrderedDict[bytes, str] = OrderedDict()  # msg id -> forwarder
        self._counter = Counter()
        self._host: Any = None
        self._pubsub: Any = None
        self._nursery: trio.Nursery | None = None
        self.rejected = 0
        self.gated_connections = 0  # connections closed at once because the peer gate refused them

    @property
    def peer_id(self) -> str:
        return self._peer_id

    # -- lifecycle ---------------------------------------------------------------------

    def run(self, listen: list[str]):
        return self._run(listen)

    @asynccontextmanager
    async def _run(self, listen: list[str]) -> AsyncIterator[None]:
        if self._host is not None:
            raise TransportError("transport is already running")
        try:
            maddrs = [multiaddr.Multiaddr(a) for a in listen]
        except Exception as e:
            raise TransportError(f"bad listen address in {listen}: {e}") from e
        kp = self._key_pair
        host = new_host(
            key_pair=kp,
            sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(kp, noise_privkey=create_x25519_key_pair().private_key)},
            muxer_opt={YAMUX_PROTOCOL_ID: self.muxer},
            listen_addrs=maddrs,
        )
        c = self.cfg
        gossipsub = FloodPublishGossipSub(
            protocols=[PROTOCOL_ID_V11],
            degree=c.degree,
            degree_low=c.degree_low,
            degree_high=c.degree_high,
            heartbeat_initial_delay=0.1,
            heartbeat_interval=c.heartbeat_interval,
            spam_protection_enabled=False,
            eclipse_protection_enabled=False,  # all peers share 127.0.0.1 in tests and netsim
            max_pending_messages_per_peer=c.pending_per_peer,
        )
        cache_addrs(host)
        no_auto_connector(host)
        pubsub = CoalescingPubsub(host, gossipsub, seen_ttl=c.seen_ttl, cache_size=4096,
                                  msg_id_constructor=content_id, **PUBSUB_OPTIONS)
        pubsub.peer_queues = SizedQueues(c.peer_queue_size)
        pubsub.peer_gate = self._gate_id
        host.get_network().register_notifee(_Notifee(self))
        for proto, handler in self._handlers.items():
            host.set_stream_handler(TProtocol(proto), self._inbound(handler))
        # Pubsub must be running before the host starts dialling or accepting.
        async with background_trio_service(pubsub), background_trio_service(gossipsub):
            async with host.run(maddrs):
                check_listening(host, maddrs)
                await pubsub.wait_until_ready()
                async with trio.open_nursery() as nursery:
                    self._host, self._pubsub, self._nursery = host, pubsub, nursery
                    try:
                        for topic in self._subs:
                            await self._start_sub(topic)
                        yield
                    finally:
                        self._host = self._pubsub = self._nursery = None
                        self._announced.clear()
                        nursery.cancel_scope.cancel()
                        # Close connections explicitly: libp2p's own shutdown cancels their
                        # tasks and leaves sockets to the garbage collector.
                        with trio.CancelScope(shield=True), trio.move_on_after(5):
                            await host.get_network().close()

    def _require(self) -> tuple[Any, Any, trio.Nursery]:
        if self._host is None or self._nursery is None:
            raise TransportError("transport is not running")
        return self._host, self._pubsub, self._nursery

    def addrs(self) -> list[str]:
        host, _, _ = self._require()
        out = []
        for a in host.get_addrs():
            s = str(a)
            out.append(s if "/p2p/" in s else f"{s}/p2p/{self._peer_id}")
        return out

    # -- connections -------------------------------------------------------------------

    async def connect(self, addr: str) -> str:
        host, _, _ = self._require()
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as e:
            raise TransportError(f"not a dialable multiaddr with /p2p/<id>: {addr!r} ({e})") from e
        if info.peer_id == self._id:
            raise TransportError("cannot connect to self")
        if not host.get_network().get_connections(info.peer_id):
            forget_dial_state(host, info.peer_id)
        try:
            with trio.fail_after(DIAL_TIMEOUT):
                await host.connect(info)
        except trio.TooSlowError as e:
            raise TransportError(f"dialing {addr} timed out") from e
        except Exception as e:
            raise TransportError(f"dialing {addr} failed: {type(e).__name__}: {e}") from e
        peer = info.peer_id.to_base58()
        self._on_connection(peer)
        return peer

    def _gate_id(self, peer: ID) -> bool:
        """The peer gate for py-libp2p's pubsub (it holds `ID`s)."""
        return self.peer_allowed(peer.to_base58())

    def _on_connection(self, peer: str) -> None:
        """Every new connection (either direction): the peer gate first; a refused peer is
        disconnected at once and never announced."""
        if self.peer_allowed(peer):
            self._on_connected(peer)
            return
        self.gated_connections += 1
        if self._nursery is not None:
            self._nursery.start_soon(self.disconnect, peer)

    def _on_connected(self, peer: str) -> None:
        if self._nursery is None or peer in self._announced:
            return
        self._announced.add(peer)
        for fn in self._listeners:
            self._nursery.start_soon(fn, peer)

    async def disconnect(self, peer_id: str) -> None:
        """Close the connections to `peer_id` and forget its addresses (so that libp2p's
        auto-connector does not dial it again)."""
        host, _, _ = self._require()
        try:
            pid = ID.from_base58(peer_id)
            host.get_peerstore().clear_addrs(pid)
            await host.disconnect(pid)
        except Exception as e:  # already gone, or a malformed id: nothing to close
            log.debug("disconnect %s: %s", peer_id, e)

    def inbound_slots(self) -> int:
        """Inbound connection slots taken now: py-libp2p admits a bounded number of inbound
        connections at a time (250 by default); each open one holds a slot until it closes."""
        host, _, _ = self._require()
        return inbound_slots_held(host)

    def peers(self) -> list[str]:
        host, _, _ = self._require()
        return sorted(p.to_base58() for p in host.get_connected_peers())

    def dialled(self, peer_id: str) -> bool | None:
        """From the muxer's initiator flag of our connections to `peer_id` (None when there
        are none, or one each way after a simultaneous dial)."""
        host, _, _ = self._require()
        try:
            ends = {bool(c.muxed_conn.is_initiator) for c in host.get_network().get_connections(ID.from_base58(peer_id))}
        except Exception:  # a malformed id, a connection without a muxer: unknown
            return None
        return ends.pop() if len(ends) == 1 else None

    def on_peer_connected(self, listener: PeerListener) -> None:
        self._listeners.append(listener)

    # -- gossip ------------------------------------------------------------------------

    async def subscribe(self, topic: str, handler: MessageHandler, validator: Validator) -> None:
        if topic in self._subs:
            raise TransportError(f"already subscribed to {topic!r}")
        self._subs[topic] = (handler, validator)
        if self._host is not None:
            await self._start_sub(topic)
        else:
            await trio.lowlevel.checkpoint()

    async def _start_sub(self, topic: str) -> None:
        _, pubsub, nursery = self._require()
        handler, validator = self._subs[topic]

        def check(forwarder: ID, msg: Any) -> bool:
            if forwarder == self._id:  # our own publication
                return True
            frm = forwarder.to_base58()
            try:
                ok = bool(validator(msg.data, frm))
            except Exception:
                log.exception("validator for %s raised; message rejected", topic)
                ok = False
            if ok:
                self._forwarders[pubsub.get_message_id(msg)] = frm
                if len(self._forwarders) > 100_000:
                    self._forwarders.popitem(last=False)
            else:
                self.rejected += 1
                log.debug("rejected gossip on %s from %s", topic, frm)
            return ok

        pubsub.set_topic_validator(topic, check, False)
        old = _pubsub_mod.SUBSCRIPTION_CHANNEL_SIZE
        _pubsub_mod.SUBSCRIPTION_CHANNEL_SIZE = self.cfg.subscription_queue  # read by subscribe()
        try:
            sub = await pubsub.subscribe(topic)
        finally:
            _pubsub_mod.SUBSCRIPTION_CHANNEL_SIZE = old
        nursery.start_soon(self._deliver_loop, topic, sub, handler)

    async def _deliver_loop(self, topic: str, sub: Any, handler: MessageHandler) -> None:
        _, pubsub, _ = self._require()
        mine = self._id.to_bytes()
        while True:
            msg = await sub.get()
            if msg.from_id == mine:
                continue
            frm = self._forwarders.pop(pubsub.get_message_id(msg), None) or ID(msg.from_id).to_base58()
            self._counter.count("gossip", received=len(msg.data))
            try:
                await handler(msg.data, frm)
            except Exception:  # a handler bug must not kill the transport
                log.exception("gossip handler for %s failed", topic)

    def topic_peers(self, topic: str) -> list[str]:
        host, pubsub, _ = self._require()
        connected = set(host.get_connected_peers())
        return sorted(b58 for p in pubsub.peer_topics.get(topic, ())
                      if p in connected and self.peer_allowed(b58 := p.to_base58()))

    async def publish(self, topic: str, data: bytes) -> None:
        _, pubsub, _ = self._require()
        if len(data) > MAX_GOSSIP:
            raise TransportError(f"gossip message of {len(data)} bytes exceeds {MAX_GOSSIP}")
        try:
            await pubsub.publish(topic, bytes(data))
        except Exception as e:
            raise TransportError(f"publish on {topic} failed: {e}") from e
        self._counter.count("gossip", sent=len(data))

    # -- streams -----------------------------------------------------------------------

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        self._handlers[protocol] = handler
        if self._host is not None:
            self._host.set_stream_handler(TProtocol(protocol), self._inbound(handler))

    def _wrap(self, net_stream: Any, protocol: str) -> FramedStream:
        try:
            remote_host = net_stream.get_remote_address()[0]
        except Exception:
            remote_host = None
        return FramedStream(
            Libp2pBytes(net_stream),
            str(net_stream.muxed_conn.peer_id),
            protocol=protocol,
            remote_host=remote_host,
            counter=self._counter,
        )

    def _inbound(self, handler: StreamHandler):
        async def serve(net_stream: Any) -> None:
            stream = self._wrap(net_stream, str(net_stream.get_protocol() or ""))
            try:
                await handler(stream)
            except TransportError as e:
                log.debug("stream %s from %s ended: %s", stream.protocol, stream.remote_peer, e)
            except Exception:
                log.exception("stream handler for %s failed", stream.protocol)
                await stream.reset()
            finally:
                await stream.close()

        return serve

    async def open_stream(self, peer_id: str, protocol: str) -> Stream:
        host, _, _ = self._require()
        try:
            pid = ID.from_base58(peer_id)
        except Exception as e:
            raise TransportError(f"bad peer id {peer_id!r}") from e
        try:
            with trio.fail_after(DIAL_TIMEOUT):
                s = await host.new_stream(pid, [TProtocol(protocol)])
        except trio.TooSlowError as e:
            raise TransportError(f"opening {protocol} to {peer_id} timed out") from e
        except Exception as e:
            raise TransportError(f"opening {protocol} to {peer_id} failed: {type(e).__name__}: {e}") from e
        return self._wrap(s, protocol)

    def bytes_counters(self) -> dict[str, int]:
        return self._counter.as_dict()
