"""CPU-saving adjustments to py-libp2p 0.8.1 pubsub for `Libp2pTransport`.

Why: every gossip message crosses a full mesh as one RPC per mesh link (the origin's and
the relays' that GossipSub sends by design), and py-libp2p spends milliseconds of CPU on
each RPC (trio lock checkpoints in yamux/noise, a yamux WINDOW_UPDATE frame per read, a
signed peer record attached to, and verified on, every RPC, `host.get_addrs()` rebuilt per
publish). A node therefore saturates a CPU core at a few dozen messages a second, and once
saturated every queue grows and delivery latency climbs into seconds. Costs per gossiped
entry: `bench/daemon_bench.py`; latency: `tests/test_gossip_latency.py`.

What is changed (none alters what is delivered):

* `CoalescingPubsub`: the per-peer sending loop writes every publish-only RPC that is
  already queued for that peer as ONE RPC (up to the 1 MiB RPC limit). At low rates the
  queue holds one RPC and nothing changes; under load the per-RPC costs (frames,
  encryption, syscalls, the receiver's read path) are paid once per batch, so the cost
  per message falls as the load rises. RPCs with control or subscription parts are never
  merged (their order matters: PRUNE then GRAFT). Coalesced publish RPCs do not carry the
  sender's signed peer record: peers receive it in the hello and subscription RPCs, and
  verifying it on every message costs an Ed25519 check plus multiaddr parsing per RPC.
* `cache_addrs`: `host.get_addrs()` (called by GossipSub for every publish and relay to
  attach that record) is cached for a second, and so is the marshalled record itself
  (`cache_sender_record`: GossipSub rebuilt it, comparing address sets, per message).
* yamux credit: receive-window credit goes back in batches, as go-yamux does (once half
  the window was consumed), instead of one WINDOW_UPDATE frame per read. py-libp2p's own
  switch (`PY_YAMUX_RELEASE_ON_READ=0`, still set) leaves a "partial slack" branch that
  sent one anyway, nearly one WINDOW_UPDATE per DATA frame, each one encrypted, written,
  read and decrypted. `batch_yamux_credit`.
* the read loop (`CoalescingPubsub.continuously_read_stream`) reads the stream through a
  buffer (py-libp2p reads each RPC's varint length one byte at a time: three muxer reads
  per RPC), drops an already-seen message before any other work (most messages a mesh
  member receives are copies from other mesh peers; py-libp2p spawned a managed task per
  message, duplicates included), and handles new messages in line;
* no pubsub-level signature checks (`strict_signing=False`, see `PUBSUB_OPTIONS`): every gossiped atd
  entry is itself signed and the daemon's validator checks that signature and the
  author's membership before delivery or relay, and the forwarder is authenticated by
  Noise. The pubsub signature only vouched for the `from` field, which nothing trusts:
  message ids are the SHA-256 of the data (`content_id`), so a forged `from`/`seqno`
  cannot shadow another message, and a re-published entry is a duplicate by content.
  Own messages are still signed (`CoalescingPubsub.publish`, one Ed25519 signature per
  published entry) because daemons of earlier versions verify pubsub signatures and
  would drop unsigned messages: a consortium can upgrade one daemon at a time. Only the
  verification, on every node for every message, is saved. py-libp2p's validation cache
  is kept small (in `PUBSUB_OPTIONS`): only messages not seen yet reach validation, and its LRU
  list costs a linear scan per message;
* flood publish (`FloodPublishGossipSub`, go-libp2p's default): a node's OWN messages go
  to every peer subscribed to the topic, not only to its mesh; relays still follow the
  mesh. A publisher whose mesh is empty or not formed yet (just started, pruned under a
  bounded peer set) lost its messages until the next sync; now its direct peers get them
  in one hop. In a small consortium every peer is in the mesh anyway (no extra sends);
* members only: `CoalescingPubsub.peer_gate` (the daemon's membership gate,
  installed by `Libp2pTransport.set_peer_gate`) sits in front of the router on both sides.
  A refused peer is never added as a pubsub peer (so never in a mesh, the fanout or
  `peer_topics`), every RPC it sends is dropped unread (no subscription, GRAFT, IHAVE or
  IWANT of its takes effect) and every RPC to it is dropped at `write_msg`, the one
  path all publishes, relays, IWANT answers and pending flushes take. Checked per RPC,
  so a member revoked mid-session receives nothing more even before its connection is
  closed. (py-libp2p's own `blacklist` is not used: it is not consulted on writes.)
* connection reads are buffered (`buffer_raw_reads`): Noise reads each transport message
  as a 2-byte length and a body, two socket reads; one read of up to READ_CHUNK bytes
  now serves both, and often the frames after them.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
import weakref
from typing import Any, Callable

import trio
from google.protobuf.message import DecodeError
from libp2p.io.exceptions import IOException, MessageTooLarge
from libp2p.network.connection.exceptions import RawConnError
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.network.stream.exceptions import StreamEOF, StreamError
import libp2p.pubsub.gossipsub as _gossipsub_mod
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.utils import maybe_consume_signed_record
from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX
import libp2p.stream_muxer.yamux.yamux as _yamux_mod
from libp2p.stream_muxer.yamux.yamux import YamuxStream
from libp2p.utils.varint import read_varint_prefixed_bytes_limited

from atdnode.transport._libp2p.gossip_mesh import NO_ADAPTIVE, MeshHealthMixin, SmallConsortiumMixin

log = logging.getLogger(__name__)

# Read by py-libp2p's yamux at call time; set before any stream exists. setdefault keeps
# an operator's explicit choice.
os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")

ADDRS_TTL = 1.0  # seconds host.get_addrs() is reused
READ_CHUNK = 1 << 16  # bytes asked of the muxer per read by the pubsub read loop
RTT_PING_S = 300.0  # yamux RTT pings per connection at most this often (slow_yamux_rtt_pings)
# Pubsub kwargs: pubsub signatures not checked, a small validation cache (module doc)
PUBSUB_OPTIONS = {"strict_signing": False, "validation_cache_size": 64}

_last_id: list = [None, b""]  # (message object, its id): py-libp2p asks ~8 times per message


def content_id(msg: Any) -> bytes:
    """Pubsub message id: SHA-256 of the message data (the same bytes have the same id)."""
    if msg is _last_id[0]:
        return _last_id[1]
    digest = hashlib.sha256(msg.data).digest()
    _last_id[0], _last_id[1] = msg, digest
    return digest


class BufferedReader:
    """`read(n)` over a libp2p stream that asks the stream for up to READ_CHUNK bytes at a
    time and serves small reads (a varint's single bytes) from what it already holds.
    Returns b"" only at end of stream, like the stream itself."""

    def __init__(self, stream: Any, chunk: int = READ_CHUNK) -> None:
        self.stream = stream
        self.chunk = chunk
        self.buf = bytearray()

    async def read(self, n: int | None = None) -> bytes:
        if not self.buf:
            data = await self.stream.read(self.chunk)
            if not data:
                return b""
            self.buf += data
        if n is None or n < 0 or n >= len(self.buf):
            out = bytes(self.buf)
            self.buf.clear()
        else:
            out = bytes(self.buf[:n])
            del self.buf[:n]
        return out


_write_locks: "weakref.WeakKeyDictionary[Any, trio.Lock]" = weakref.WeakKeyDictionary()


def _write_lock(stream: Any) -> trio.Lock:
    """The lock that keeps one stream's RPC writes whole (CoalescingPubsub.write_msg)."""
    lock = _write_locks.get(stream)
    if lock is None:
        lock = _write_locks[stream] = trio.Lock()
    return lock


def _publish_only(rpc: Any) -> bool:
    return bool(rpc.publish) and not rpc.subscriptions and not rpc.HasField("control")


class CoalescingPubsub(Pubsub):
    """`Pubsub` whose per-peer sender merges queued publish-only RPCs into one write."""

    coalesced_rpcs = 0  # RPCs saved by merging (all instances; for benchmarks and tests)
    duplicates_dropped = 0  # already-seen messages dropped by the read loop (all instances)
    peer_gate: Callable[[Any], bool] | None = None  # (libp2p ID) -> may it gossip with us now?
    gated_rpcs = 0  # RPCs dropped in or out because the gate refused the peer (this instance)

    def _refused(self, peer_id: Any) -> bool:
        gate = self.peer_gate
        if gate is None or gate(peer_id):
            return False
        self.gated_rpcs += 1
        return True

    async def _handle_new_peer(self, peer_id: Any) -> None:
        """Pubsub._handle_new_peer for allowed peers only (no pubsub stream, queue or router
        entry for a refused one)."""
        if self._refused(peer_id):
            return
        await super()._handle_new_peer(peer_id)

    async def write_msg(self, stream: Any, rpc_msg: Any) -> bool:
        """Pubsub.write_msg, dropping (True: the sending loop goes on) RPCs to refused peers,
        one whole RPC at a time per stream (`_write_lock`), so no RPC is ever garbled.

        py-libp2p 0.8.1 writes to a peer's pubsub stream from three tasks -- the per-peer
        sending loop, `GossipSub.flush_pending_messages` and `send_recent_messages` -- and
        `YamuxStream.write` holds its write lock per frame only: when the send window runs
        out mid-RPC (a loaded receiver), it releases the lock and polls, and another task's
        frames go out between the two halves. The receiver then parses a garbled RPC. A
        write that fails or is cancelled part-way (yamux gives up after 5 s without window)
        left half an RPC on the stream, and the flush paths wrote on after it; now the
        stream is reset instead, so nothing follows a partial RPC."""
        if self._refused(stream.muxed_conn.peer_id):
            return True
        async with _write_lock(stream):
            try:
                return await super().write_msg(stream, rpc_msg)
            except BaseException:
                with trio.CancelScope(shield=True):
                    try:
                        await stream.reset()
                    except Exception:  # already gone
                        pass
                raise

    async def publish(self, topic_id: str | list[str], data: bytes) -> None:
        """Pubsub.publish (libp2p 0.8.1), signed whatever `strict_signing` says (module doc)."""
        msg = rpc_pb2.Message(data=data, topicIDs=[topic_id] if isinstance(topic_id, str) else list(topic_id),
                              from_id=self.my_id.to_bytes(), seqno=self._next_seqno())
        msg.signature = self.host.get_private_key().sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
        msg.key = self.host.get_public_key().serialize()
        await self.push_msg(self.my_id, msg)

    async def continuously_read_stream(self, stream: Any) -> None:
        """Pubsub.continuously_read_stream (libp2p 0.8.1) with a buffered reader, seen
        messages dropped first and new ones pushed in line (see the module doc). Streams
        with a metrics channel keep py-libp2p's own loop."""
        if getattr(stream, "metric_send_channel", None) is not None:
            await super().continuously_read_stream(stream)
            return
        peer_id = stream.muxed_conn.peer_id
        reader = BufferedReader(stream)
        try:
            while self.manager.is_running:
                rpc = rpc_pb2.RPC()
                rpc.ParseFromString(await read_varint_prefixed_bytes_limited(reader, self.max_inbound_rpc_size))
                if self._refused(peer_id):  # not a member (any more): nothing of it takes effect
                    continue
                if not maybe_consume_signed_record(rpc, self.host, peer_id):
                    log.error("Received an invalid-signed-record, ignoring the incoming msg")
                    continue
                for msg in rpc.publish:
                    if not self._is_subscribed_to_msg(msg):
                        continue
                    if self._is_msg_seen(msg):  # a copy from another mesh peer: nothing to do
                        CoalescingPubsub.duplicates_dropped += 1
                        continue
                    try:
                        await self.push_msg(peer_id, msg)  # validators are synchronous: no task per message
                    except Exception:  # as when it ran in its own task: this peer's other messages go on
                        log.exception("pubsub message from %s could not be processed", peer_id)
                if rpc.subscriptions:
                    if len(rpc.subscriptions) > self.max_subscriptions_per_rpc:
                        log.warning("Peer %s sent %d subscriptions exceeding limit %d, rejecting subscriptions",
                                    peer_id, len(rpc.subscriptions), self.max_subscriptions_per_rpc)
                    else:
                        for sub in rpc.subscriptions:
                            self.handle_subscription(peer_id, sub)
                if rpc.HasField("control"):
                    await self.router.handle_rpc(rpc, peer_id)
        except (MessageTooLarge, DecodeError) as error:  # too large or garbled: this peer's stream ends, never the daemon
            log.warning("bad inbound pubsub RPC from peer %s (%s): stream reset", peer_id, error)
            try:
                await stream.reset()
            except Exception:
                pass
            self._handle_dead_peer(peer_id)
        except (StreamEOF, StreamError, IOException, RawConnError) as error:  # peer gone / shutting down
            log.debug("pubsub stream of %s ended: %s", peer_id, error)

    async def handle_sending_messages(self, peer_id: Any, stream: Any, queue: Any) -> None:
        # Same contract as Pubsub.handle_sending_messages (libp2p 0.8.1): pop until the
        # queue closes (None) or a write fails; an error marks the peer dead.
        inner = getattr(queue, "_queue", None)  # RpcQueue -> PriorityQueue (sync pop)
        if inner is None or not hasattr(inner, "pop"):
            log.warning("pubsub queue internals changed; sending without coalescing")
            await super().handle_sending_messages(peer_id, stream, queue)
            return
        limit = getattr(queue, "max_message_size", 1 << 20) - 1024  # room for framing
        carry = None
        try:
            while True:
                rpc = carry if carry is not None else await queue.pop()
                carry = None
                if rpc is None:
                    return
                if _publish_only(rpc):
                    rpc, carry, merged = coalesce_publish(rpc, inner.pop, limit)
                    CoalescingPubsub.coalesced_rpcs += merged
                if not await self.write_msg(stream, rpc):
                    return
        except Exception:
            log.debug("sending loop for %s terminated with error", peer_id, exc_info=True)
            self._handle_dead_peer(peer_id)


class FloodPublishGossipSub(SmallConsortiumMixin, MeshHealthMixin, GossipSub):
    """GossipSub that sends the node's own messages to every topic peer (module doc), whose
    mesh cannot stay empty (`atdnode.transport._libp2p.gossip_mesh`: relays flood while it is), and
    that keeps a thin, stable mesh in a small consortium (`gossip_mesh.SmallConsortiumMixin`).
    py-libp2p's adaptive gossip is off: it slowed the heartbeat to 30-60 s and grew the mesh
    past the degrees asked for (`gossip_mesh` module doc, "Heartbeat cadence")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, **NO_ADAPTIVE})

    def _get_peers_to_send(self, topic_ids: Any, msg_forwarder: Any, origin: Any, msg_id: Any = None) -> set:
        topic_ids = list(topic_ids)
        peers = set(super()._get_peers_to_send(topic_ids, msg_forwarder, origin, msg_id))
        if self.pubsub is not None and msg_forwarder == self.pubsub.my_id:
            for topic in topic_ids:
                peers.update(p for p in self.pubsub.peer_topics.get(topic, ()) if p in self.peer_protocol)
            peers.discard(origin)
        elif self.pubsub is not None:  # a relay: to every topic peer while our mesh is empty
            flood = self.flood_relay_peers(topic_ids)
            if flood:
                peers.update(flood)
                peers.discard(origin)
                peers.discard(msg_forwarder)
        gate = getattr(self.pubsub, "peer_gate", None)
        return peers if gate is None else {p for p in peers if gate(p)}


def coalesce_publish(first: Any, pop: Callable[[], Any], limit: int) -> tuple[Any, Any, int]:
    """Merge publish-only RPCs: `first` (publish-only) and those `pop()` returns next.

    Stops at the first RPC that is not publish-only or would take the merged RPC past
    `limit` bytes, and returns it as `carry` (to be sent next, order kept), or None when
    `pop()` ran dry (returned None). Returns (merged RPC without senderRecord, carry, how
    many RPCs were merged into `first`).
    """
    out = rpc_pb2.RPC()
    out.publish.extend(first.publish)
    size = out.ByteSize()
    merged = 0
    while True:
        nxt = pop()
        if nxt is None:
            return out, None, merged
        extra = nxt.ByteSize()
        if not _publish_only(nxt) or size + extra > limit:
            return out, nxt, merged
        out.publish.extend(nxt.publish)
        size += extra
        merged += 1


def batch_yamux_credit() -> None:
    """Make py-libp2p's YamuxStream return receive-window credit as go-yamux does: one
    WINDOW_UPDATE once the unreturned credit reaches half the target window (auto-tuning
    kept), never one per read (module doc). Flow control is unchanged: a sender still
    stops at a full window and a reader that consumes data always releases it."""
    original = getattr(YamuxStream, "_auto_tune_and_send_window_update", None)
    needed = ("window_lock", "target_recv_window", "recv_window", "_grow_threshold", "_grow_to_delta",
              "_apply_autotune_epoch", "send_window_update")
    if original is None or getattr(original, "atd_batched", False):
        return
    probe = YamuxStream.__init__.__code__.co_names + tuple(vars(YamuxStream))
    if not all(name in probe for name in needed):
        log.warning("yamux internals changed; window credit is returned per read")
        return

    async def credit(self: Any, *, bytes_read: int = 0) -> None:
        total = 0
        async with self.window_lock:
            buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
            delta = self.target_recv_window - (self.recv_window + buffered)
            if delta > 0 and delta >= self._grow_threshold():
                total = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
                self._pending_recv_release = 0
        if total > 0:
            await self.send_window_update(total, skip_lock=True)

    credit.atd_batched = True
    YamuxStream._auto_tune_and_send_window_update = credit


batch_yamux_credit()


def slow_yamux_rtt_pings(interval: float = RTT_PING_S) -> None:
    """py-libp2p's yamux pings every connection every 30 s from both ends, only to measure
    an RTT that sizes stream windows (`_effective_rtt`); the ping neither keeps a connection
    alive nor closes a dead one, and on an idle daemon those pings were a large share of the
    yamux frames it sent. The RTT is taken every `interval` s instead (the first sample, 0.5 s after
    connecting, is kept)."""
    if getattr(_yamux_mod, "RTT_MEASURE_INTERVAL", None) is None:
        log.warning("yamux internals changed; RTT pings keep their own period")
        return
    _yamux_mod.RTT_MEASURE_INTERVAL = max(_yamux_mod.RTT_MEASURE_INTERVAL, interval)


slow_yamux_rtt_pings()


def buffer_raw_reads() -> None:
    """Make py-libp2p's RawConnection.read(n) ask the socket for up to READ_CHUNK bytes and
    keep what exceeds n for the next read (module doc). Every reader of a connection goes
    through RawConnection.read (multistream negotiation, Noise), so no byte is skipped."""
    original = RawConnection.read
    if getattr(original, "atd_buffered", False):
        return

    async def read(self: Any, n: int | None = None) -> bytes:
        buf = self.__dict__.get("_atd_buf")
        if buf:
            if n is None or n < 0 or n >= len(buf):
                out = bytes(buf)
                buf.clear()
            else:
                out = bytes(buf[:n])
                del buf[:n]
            return out
        if n is None or n <= 0 or n >= READ_CHUNK:
            return await original(self, n)
        data = await original(self, READ_CHUNK)
        if len(data) > n:
            self.__dict__.setdefault("_atd_buf", bytearray()).extend(memoryview(data)[n:])
            data = data[:n]
        return data

    read.atd_buffered = True
    RawConnection.read = read


buffer_raw_reads()


def cache_addrs(host: Any, ttl: float = ADDRS_TTL) -> None:
    """Make `host.get_addrs()` reuse its result for `ttl` seconds (this host only)."""
    fetch: Callable[[], list] = host.get_addrs
    cached: list = []
    stamp = [float("-inf")]

    def get_addrs() -> list:
        now = time.monotonic()
        if now - stamp[0] >= ttl:
            cached[:] = fetch()
            stamp[0] = now
        return list(cached)

    host.get_addrs = get_addrs


def cache_sender_record(ttl: float = ADDRS_TTL) -> None:
    """Make GossipSub reuse each host's marshalled signed peer record for `ttl` seconds
    (py-libp2p rebuilds it, comparing address sets, for every message it publishes)."""
    build = _gossipsub_mod.env_to_send_in_RPC
    if getattr(build, "atd_cached", False):
        return
    cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def env_to_send_in_RPC(host: Any) -> tuple[bytes, bool]:
        now = time.monotonic()
        hit = cache.get(host)
        if hit is not None and now - hit[0] < ttl:
            return hit[1], False
        env, fresh = build(host)
        cache[host] = (now, env)
        return env, fresh

    env_to_send_in_RPC.atd_cached = True
    _gossipsub_mod.env_to_send_in_RPC = env_to_send_in_RPC


cache_sender_record()
