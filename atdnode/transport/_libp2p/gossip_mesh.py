"""Gossip mesh health for py-libp2p 0.8.1 GossipSub: an empty mesh cannot persist.

How a node's mesh stayed empty (read from libp2p/pubsub/gossipsub.py, 0.8.1):

1. A peer P whose mesh is over D_high prunes some members in its heartbeat
   (`mesh_heartbeat` -> `_emit_control_msgs`) *without* recording a backoff for them
   (go-libp2p does: `addBackoff` on every prune it sends).
2. The pruned node X records a backoff for P (60 s, `handle_prune`) and the prune time
   (`graft_flood_tracking`). X's heartbeat never grafts a peer in backoff. Once every
   topic peer of X has pruned it, X's mesh is empty and no heartbeat can refill it.
3. P, its own mesh now under D_low, re-grafts X at its next heartbeat (nothing stops it:
   step 1). X treats that GRAFT as a "GRAFT flood" (it came within 10 s of P's PRUNE, or
   inside X's backoff for P), prunes P back, penalises it and *extends* its backoff for
   P by another 60 s (`handle_graft`). Every re-graft restarts the clock: the empty mesh
   persists, and X relays nothing (only lazy IHAVE gossip still reaches it).

What `MeshHealthMixin` changes (a mixin in front of `GossipSub`):

* a peer we prune in our heartbeat gets a backoff on our side too (as in go-libp2p), so
  we never re-graft it inside the backoff it was told, the GRAFT its side counts as a flood;
* a GRAFT from a peer is accepted while our mesh for the topic is under D_low, even if
  *that peer* once pruned us (our backoff for it only kept *us* from grafting it; it now
  asks to be in our mesh), unless we pruned it ourselves within its backoff -- then the
  GRAFT really breaks the backoff we gave it and the flood rule applies as before;
* flood relay: when the mesh of a topic is still empty after two consecutive heartbeats
  (every topic peer in backoff: no GRAFT is allowed), messages we relay go to every
  topic peer, as our own messages already do (flood publish). This needs no GRAFT, so it
  trips no penalty; it ends as soon as the mesh has a member again (a GRAFT accepted, or
  a backoff expired and the heartbeat grafted).

`starved_topics()` names the topics in flood-relay mode (tests, status).

Heartbeat cadence (`MeshHealthMixin.heartbeat_interval`). py-libp2p 0.8.1's "adaptive
gossip" (on by default) re-scores network health every 30 s and, below 0.7 -- where an idle
consortium sits, mostly from "delivery health" with nothing delivered -- sets the heartbeat
to `max(30, min(60, base // 2))` or `max(60, ...)` s: with our 1 s base, a heartbeat every
30-60 s, so an emptied mesh was re-grafted a minute later and flood relay began two minutes
later; it also raises D_low / D_high by up to 2 / 4 over what `peerset.gossip_degrees`
chose. Adaptive gossip is off here (`NO_ADAPTIVE`);
instead the heartbeat runs every `heartbeat_interval` (1 s) while there is work for it --
a topic's mesh under D_low (empty included) or over D_high, or messages in the message
cache (IHAVE gossip windows) -- and every IDLE_HEARTBEAT_S (5 s) otherwise. A mesh that
empties is therefore seen within IDLE_HEARTBEAT_S and repaired (or flood relay begins)
at 1 s beats from then on; an idle daemon wakes for the heartbeat 0.2 times a second.

Small consortia (`SmallConsortiumMixin`, `fit_mesh`). In a small consortium most copies of
each entry were duplicates, whatever D said: py-libp2p 0.8.1's opportunistic grafting
("GossipSub 2.0") grafts up to two more peers at every heartbeat whenever candidates score
at least the mesh median -- with no score parameters every peer scores 0 -- so every mesh
filled up to all topic peers and each node relayed each entry to all of them. When every other member fits in the peer set (`peerset.small_consortium`) each
node's own messages already reach every member in one hop (flood publish), so the mesh
only has to cover a member whose link to the author is down. Then: D = D_high = 2,
D_low = 1, no opportunistic grafting, no IHAVE gossip (each IHAVE to a peer whose copy is
still queued came back as an IWANT, a duplicate more). An entry whose author's link to X is
down still reaches X through the mesh; sync covers the rest. Duplicates per entry:
`tests/test_gossip_mesh.py`, `bench/daemon_bench.py`.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

log = logging.getLogger("atd.gossip")

STARVED_AFTER_BEATS = 2  # heartbeats that end with an empty mesh before relays are flooded
IDLE_HEARTBEAT_S = 5  # heartbeat period while the mesh is within bounds and nothing is cached (module doc)
NO_ADAPTIVE = {"adaptive_gossip_enabled": False}  # GossipSub kwargs: fixed degrees and heartbeat (module doc)


class MeshHealthMixin:
    """Mix in before `GossipSub` (see the module doc)."""

    def _mesh_state(self) -> tuple[dict[str, int], dict[tuple[Any, str], float]]:
        st = self.__dict__.get("_atd_mesh_state")
        if st is None:
            st = self.__dict__["_atd_mesh_state"] = ({}, {})
        return st

    @property
    def heartbeat_interval(self) -> float:
        """Seconds to the next heartbeat: the configured period while the mesh needs work or
        the message cache holds messages, IDLE_HEARTBEAT_S (if longer) otherwise (module doc)."""
        base = self.__dict__.get("_atd_heartbeat", 1)
        return base if self.heartbeat_busy() else max(base, IDLE_HEARTBEAT_S)

    @heartbeat_interval.setter
    def heartbeat_interval(self, value: float) -> None:
        self.__dict__["_atd_heartbeat"] = value

    def heartbeat_busy(self) -> bool:
        """Work for the next heartbeat: a topic mesh outside [D_low, D_high], or cached messages."""
        mcache = getattr(self, "mcache", None)
        if mcache is not None and mcache.msgs:
            return True
        low, high = self.degree_low, self.degree_high  # type: ignore[attr-defined]
        return any(not low <= len(m) <= high for m in getattr(self, "mesh", {}).values())

    def mesh_heartbeat(self) -> tuple[Any, Any]:
        to_graft, to_prune = super().mesh_heartbeat()  # type: ignore[misc]
        empty_beats, we_pruned = self._mesh_state()
        until = time.time() + float(self.prune_back_off)  # type: ignore[attr-defined]
        for peer, topics in to_prune.items():
            for topic in topics:
                self._add_back_off(peer, topic, False)  # type: ignore[attr-defined]
                we_pruned[(peer, topic)] = until
        for topic, members in self.mesh.items():  # type: ignore[attr-defined]
            beats = empty_beats.get(topic, 0)
            empty_beats[topic] = 0 if members else beats + 1
            peers = getattr(self.pubsub, "peer_topics", {}).get(topic)  # type: ignore[attr-defined]
            if empty_beats[topic] == STARVED_AFTER_BEATS and peers:  # once per episode, with topic peers to graft
                log.info("gossip mesh of %s empty for %d heartbeats: flood-relaying", topic, STARVED_AFTER_BEATS)
            elif members and beats >= STARVED_AFTER_BEATS:
                log.info("gossip mesh of %s refilled after %d empty heartbeats (%d members)", topic, beats, len(members))
        now = time.time()
        for key in [k for k, t in we_pruned.items() if t <= now]:
            del we_pruned[key]
        return to_graft, to_prune

    async def emit_prune(self, topic: str, to_peer: Any, do_px: bool, is_unsubscribe: bool) -> None:
        _, we_pruned = self._mesh_state()
        back_off = self.unsubscribe_back_off if is_unsubscribe else self.prune_back_off  # type: ignore[attr-defined]
        we_pruned[(to_peer, topic)] = time.time() + float(back_off)
        await super().emit_prune(topic, to_peer, do_px, is_unsubscribe)  # type: ignore[misc]

    async def handle_graft(self, graft_msg: Any, sender_peer_id: Any) -> None:
        topic = graft_msg.topicID
        members = self.mesh.get(topic)  # type: ignore[attr-defined]
        _, we_pruned = self._mesh_state()
        if (members is not None and len(members) < self.degree_low  # type: ignore[attr-defined]
                and we_pruned.get((sender_peer_id, topic), 0.0) <= time.time()):
            # its PRUNE of us is what left these marks: it wants back in, and we need members
            self.back_off.get(topic, {}).pop(sender_peer_id, None)  # type: ignore[attr-defined]
            tracked = self.graft_flood_tracking.get(sender_peer_id)  # type: ignore[attr-defined]
            if tracked is not None:
                tracked.pop(topic, None)
        await super().handle_graft(graft_msg, sender_peer_id)  # type: ignore[misc]

    def starved_topics(self) -> set[str]:
        """Topics whose mesh ended STARVED_AFTER_BEATS heartbeats in a row empty and still is."""
        empty_beats, _ = self._mesh_state()
        return {t for t, n in empty_beats.items()
                if n >= STARVED_AFTER_BEATS and not self.mesh.get(t)}  # type: ignore[attr-defined]

    def flood_relay_peers(self, topic_ids: list[str]) -> set:
        """Every topic peer, for the topics among `topic_ids` in flood-relay mode."""
        starved = self.starved_topics()
        peers: set = set()
        if self.pubsub is None:  # type: ignore[attr-defined]
            return peers
        for topic in topic_ids:
            if topic in starved:
                peers.update(p for p in self.pubsub.peer_topics.get(topic, ())  # type: ignore[attr-defined]
                             if p in self.peer_protocol)  # type: ignore[attr-defined]
        return peers


class SmallConsortiumMixin:
    """Mix in before `MeshHealthMixin`: the small-consortium mode (module doc) while
    `small_consortium` is set (by `fit_mesh`)."""

    small_consortium = False

    def _perform_opportunistic_grafting(self, topic: str, peers_to_graft: Any) -> int:
        if self.small_consortium:
            return 0
        return super()._perform_opportunistic_grafting(topic, peers_to_graft)  # type: ignore[misc]

    def gossip_heartbeat(self) -> Any:
        if self.small_consortium:
            return {}
        return super().gossip_heartbeat()  # type: ignore[misc]


def fit_mesh(transport: Any, degrees: tuple[int, int, int], small: bool) -> bool:
    """Give a libp2p transport's GossipSub the mesh degrees (D, D_low, D_high) and the
    small-consortium mode: its config (for its next run) and its running router. False for
    a transport without a GossipSub mesh (the in-memory one keeps its own degrees)."""
    d, low, high = degrees
    if not 1 <= low <= d <= high:
        raise ValueError(f"mesh degrees must satisfy 1 <= D_low <= D <= D_high, got {degrees}")
    cfg = getattr(transport, "cfg", None)
    if cfg is None or not hasattr(cfg, "degree_high"):
        return False
    transport.cfg = dataclasses.replace(cfg, degree=d, degree_low=low, degree_high=high)
    router = getattr(getattr(transport, "_pubsub", None), "router", None)
    if router is not None and hasattr(router, "small_consortium"):
        router.degree, router.degree_low, router.degree_high = d, low, high
        router.adaptive_degree_low, router.adaptive_degree_high = low, high
        router.adaptive_gossip_enabled = False  # fixed degrees and heartbeat (module doc)
        router.small_consortium = small
    return True
