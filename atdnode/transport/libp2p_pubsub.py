"""CPU-saving adjustments to py-libp2p 0.8.1 pubsub for `Libp2pTransport`.

Why: every gossip message crosses a 5-node full mesh as 16 RPCs (4 from the origin, 12
relays that GossipSub sends by design), and py-libp2p spends ~2 ms of CPU on each RPC
(trio lock checkpoints in yamux/noise, a yamux WINDOW_UPDATE frame per read, a signed
peer record attached to, and verified on, every RPC, `host.get_addrs()` rebuilt per
publish). A node therefore saturates a CPU core at a few dozen messages a second, and
once saturated every queue grows and delivery latency climbs into seconds (measured:
p50 1-4 s at 10-50 entries/s with 5 daemons in one process on a loaded 2-core machine,
with no IWANT traffic, full meshes and an idle-looking event loop).

What is changed (none alters what is delivered). Measured on a loaded 2-core box, 5 nodes in
one process, CPU per gossiped 1 KB entry: bare transports ~33 -> ~20 ms, daemons (with
the daemon's verify-once) 42-50 -> 24-34 ms; the yamux switch is the largest share:

* `CoalescingPubsub`: the per-peer sending loop writes every publish-only RPC that is
  already queued for that peer as ONE RPC (up to the 1 MiB RPC limit). At low rates the
  queue holds one RPC and nothing changes; under load the per-RPC costs (frames,
  encryption, syscalls, the receiver's read path) are paid once per batch, so the cost
  per message falls as the load rises (measured batches: 1.2-3 RPCs). RPCs with control
  or subscription parts are never merged (their order matters: PRUNE then GRAFT).
  Coalesced publish RPCs do not carry the sender's signed peer record: peers receive it
  in the hello and subscription RPCs, and verifying it on every message costs an
  Ed25519 check plus multiaddr parsing per RPC.
* `cache_addrs`: `host.get_addrs()` (called by GossipSub for every publish and relay to
  attach that record) is cached for a second.
* yamux credit: `PY_YAMUX_RELEASE_ON_READ=0` (py-libp2p's own tuning switch) returns
  receive-window credit in batches as go-yamux does, instead of one WINDOW_UPDATE frame
  per read (pubsub reads each message as 2-3 reads).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub

log = logging.getLogger(__name__)

# Read by py-libp2p's yamux at call time; set before any stream exists. setdefault keeps
# an operator's explicit choice.
os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")

ADDRS_TTL = 1.0  # seconds host.get_addrs() is reused


def _publish_only(rpc: Any) -> bool:
    return bool(rpc.publish) and not rpc.subscriptions and not rpc.HasField("control")


class CoalescingPubsub(Pubsub):
    """`Pubsub` whose per-peer sender merges queued publish-only RPCs into one write."""

    coalesced_rpcs = 0  # RPCs saved by merging (all instances; for benchmarks and tests)

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
