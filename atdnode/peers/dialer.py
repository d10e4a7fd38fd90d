"""Connections of a daemon: the membership gate on every connection, dialling members, back-offs.

`PeerDialer` holds what `NodeDaemon` delegates about connections:

* `admit(peer)` is the transport's peer gate (`Transport.set_peer_gate`): every connection,
  re-connections included, and every gossip RPC in or out is checked against the
  daemon's current member set; a refused peer is disconnected at once, never reaches a
  pubsub mesh or fanout and receives no gossip;
* `drop_non_members()` after a membership change: disconnects peers no longer members and
  closes their open bulk connections (a revoked member loses every stream and connection
  at once);
* `discovery_loop()` keeps the bounded peer set (`atdnode.peers.peerset`), dialling members at
  every address their `hello` entries name, newest first, with back-off
  (`atdnode.peers.dialpolicy`), and reports members unreachable longer than
  `[peers] unreachable_after_s` (one WARNING line per episode, `status()["unreachable"]`);
* `dial_bootstrap(addr)` dials a bootstrap address until it answers;
* `refused_by(peer)` / `membership_seen(...)`: the refusal back-off and "revoked: stop
  dialling, say so once" (`DialPolicy`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import trio

from atdnode.peers.dial_addrs import HelloAddresses
from atdnode.peers.dialpolicy import DialPolicy
from atdnode.peers.peerset import (gossip_degrees, plan_dials, plan_prunes, plan_rotation, rotation_interval,
                             SAMPLE_ALL, sample_candidates, small_consortium)
from atdnode.node import loop_rng
from atdnode.retry import Backoff
from atdnode.transport import TransportError, fit_mesh

log = logging.getLogger("atd.daemon")

DIAL_TIMEOUT = 10.0  # seconds one address may take to answer
IDLE_TICK_S = 5.0  # the peer-set round of a settled daemon runs at least this often (see _tick)
MIN_ROUND_GAP_S = 0.2  # and at most this often: a flood of hellos or connections wakes it no faster


class PeerDialer:
    """The connection side of one `NodeDaemon` (module doc)."""

    def __init__(self, daemon: Any) -> None:
        """`daemon`: the `atdnode.node.daemon.NodeDaemon` it serves (not imported: no import circle).
        Reads its gate, transport, peer set, ledger, members and blob server."""
        self.d = daemon
        self.policy = DialPolicy(unreachable_after_s=daemon.peerset.cfg.unreachable_after_s)
        self.bootstrap: dict[str, list[str]] = {}  # peer -> [address] given on the command line
        self.hellos_seen = 0  # bumped when hello entries may have changed (re-read them)
        self.changed = trio.Event()  # wakes discovery_loop (a connection came or went)
        self.pulling: set[str] = set()  # peers a sync pull is in flight with (no second one on connect)

    # -- the gate ------------------------------------------------------------------------

    def admit(self, peer: str) -> bool:
        """The transport's peer gate: members (anyone while we are not a member ourselves:
        bootstrap, see atdnode.replication.access); a refusal is recorded and logged once per peer."""
        gate = self.d.gate
        if gate.may_pull_from(peer):
            return True
        gate.refuse(peer, "connection")
        return False

    async def drop_non_members(self) -> None:
        """Disconnect peers that are no longer (or never were) members, e.g. just revoked,
        and close their bulk connections: nothing more reaches them."""
        try:
            connected = self.d.transport.peers()
        except TransportError:  # not running yet
            return
        for peer in connected:
            if not self.d.gate.may_pull_from(peer):
                self.d.gate.refuse(peer, "connection")
                await self.d.transport.disconnect(peer)
        for peer in self.d.blobs.server.bulk_peers():
            if not self.d.gate.allows(peer):
                self.d.blobs.server.drop_peer(peer)

    def membership_seen(self, changed: bool, revoked: bool) -> None:
        """After the daemon re-read membership: a change lifts refusal back-offs; learning
        that this node was revoked stops its dialling (logged once)."""
        if changed:
            self.policy.membership_changed()
            self.hellos_changed()
            self.fit_mesh()
        if revoked and self.policy.learned_revoked():
            log.warning("this node was revoked from the consortium: it stops dialling and pulling from members "
                        "(until a member that re-admitted it connects)")
        elif not revoked and self.policy.revoked and self.policy.readmitted():
            log.warning("this node was admitted to the consortium again: dialling members")

    def hellos_changed(self) -> None:
        """Members' hello entries (their addresses) may have changed: the peer-set loop re-reads
        them and runs a round now (at most one round per MIN_ROUND_GAP_S, however many hellos
        merge), so a member whose first hello just arrived is dialled at once, not at the next
        idle tick (IDLE_TICK_S)."""
        self.hellos_seen += 1
        self.changed.set()

    def fit_mesh(self) -> None:
        """The gossip mesh follows the consortium's size (`peerset.gossip_degrees`; a small
        consortium: fewer duplicate copies, `gossip_mesh.SmallConsortiumMixin`)."""
        cfg, members = self.d.peerset.cfg, len(self.d.members)
        fit_mesh(self.d.transport, gossip_degrees(cfg, members), small_consortium(cfg, members))

    def refused_by(self, peer: str) -> float:
        """`peer` refused our request (we are not a member in its ledger): back off."""
        delay = self.policy.refused_by(peer, trio.current_time(), joining=not self.d.gate.self_is_member)
        log.info("peer %s refused us (not a member in its ledger); leaving it alone for %.0f s", peer, delay)
        return delay

    def may_contact(self, peer: str) -> bool:
        """Pull from `peer` now? Not in its refusal back-off; once revoked, only if it connected to us."""
        connected = self.policy.revoked and peer in self.d.transport.peers()
        return self.policy.may_contact(peer, trio.current_time(), connected=connected)

    def status(self) -> dict:
        now = trio.current_time()
        return {"unreachable": self.policy.unreachable(now), "revoked": self.policy.revoked,
                "refusals_received": self.policy.refused_count}

    # -- dialling ------------------------------------------------------------------------

    async def dial(self, peer: str, addrs: list[str]) -> bool:
        """Try `addrs` in order (newest hello first) until one answers."""
        for addr in addrs:
            t0 = trio.current_time()
            try:
                with trio.move_on_after(DIAL_TIMEOUT):
                    await self.d.transport.connect(addr)
                    self.d.peerset.observe_rtt(peer, trio.current_time() - t0)
                    self.d.peerset.dialled += 1
                    self.policy.dial_ok(peer)
                    return True
            except TransportError as exc:
                log.debug("could not dial %s: %s", addr, exc)
        delay = self.policy.dial_failed(peer, trio.current_time())
        log.debug("no address of %s answered (%d tried); next try in %.0f s", peer, len(addrs), delay)
        return False

    async def dial_bootstrap(self, addr: str, deadline: float = 60.0, notice_after: float = 5.0) -> None:
        """Dial a bootstrap peer until it answers (backoff; a member gives up after `deadline`).

        While this node is not a member yet it keeps the connection up, re-dialling every few
        seconds (longer while the peer's refusal back-off runs): members disconnect
        non-members, and let us in once our admission reached them. A member never re-dials
        a bootstrap peer that turned out not to be a member; a revoked node stops.
        An unreachable peer is logged at the first failed dial, or after `notice_after` s of
        a dial that hangs, not after the last retry."""
        d = self.d
        waits = Backoff(0.2, 5.0)  # between failed dials of this bootstrap peer
        end = trio.current_time() + deadline
        peer = addr.rsplit("/p2p/", 1)[-1]
        warned = False
        async with trio.open_nursery() as nursery:

            async def notice() -> None:
                await trio.sleep(notice_after)
                if not warned and peer not in d.transport.peers():
                    log.warning("could not reach bootstrap %s within %.0f s; still trying", addr, notice_after)

            nursery.start_soon(notice)
            try:
                while not self.policy.revoked:
                    if peer not in d.transport.peers() and self.may_contact(peer):
                        if d.gate.self_is_member and peer in d.gate.refused:
                            return
                        try:
                            await d.transport.connect(addr)
                            log.info("connected to bootstrap peer %s", peer)
                        except TransportError as exc:
                            delay = waits.fail(peer, trio.current_time())
                            late = trio.current_time() + delay > end
                            if not warned:
                                log.warning("could not reach bootstrap %s: %s; retrying", addr, exc)
                                warned = True
                            if late and d.gate.self_is_member:
                                log.warning("could not reach bootstrap %s: %s; giving up", addr, exc)
                                return
                            await trio.sleep(delay)
                            continue
                    if d.gate.self_is_member:
                        return
                    await trio.sleep(2.0)
            finally:
                nursery.cancel_scope.cancel()

    async def discovery_loop(self) -> None:
        """Keep a bounded peer set (`atdnode.peers.peerset`): below `target`, dial members whose
        signed `hello` entries announce addresses (low-latency and random ones; every
        address, newest hello first); above `max`, disconnect the least useful peers.
        Wakes on every connection, and each second (every IDLE_TICK_S once settled, `_tick`)."""
        d = self.d
        cfg = d.peerset.cfg
        rng = loop_rng(d.rng_seed, "dial")
        # peer -> (last answered dial, prune or loss; its addresses then): not dialled again for
        # cfg.redial_after_s unless it announced new addresses (a restarted member).
        # Failed dials back off in `self.policy` instead (1 s doubling, reset by a new hello).
        tried: dict[str, tuple[float, tuple[str, ...]]] = {}
        addrs = HelloAddresses(d.ledger, self.bootstrap, lambda: d.members)  # read per member looked at
        order: list[str] = []  # the members (and bootstrap peers) to dial from, sorted
        members_read: object = None  # d.gate.members when `order` was built
        hellos_read = -1  # self.hellos_seen when `addrs` was last cleared

        pruned_here: set[str] = set()  # peers this loop disconnected (their loss is no news)

        async def mark_tried(peers: list[str], now: float) -> None:
            for peer, a in (await addrs.get(peers)).items():
                tried[peer] = (now, a)  # not re-dialled soon unless its addresses change

        async def prune(peer: str, now: float) -> None:
            await mark_tried([peer], now)
            pruned_here.add(peer)
            d.peerset.pruned += 1
            await d.transport.disconnect(peer)

        pace = RotationPace(self, trio.current_time())  # when the next rotation is due (peerset.rotation_interval)
        self.fit_mesh()  # the router exists now (membership was read before the transport ran)
        while True:
            self.changed = trio.Event()
            now = trio.current_time()
            started = now
            connected = set(d.transport.peers())
            gone = set(d.peerset.since) - connected
            await mark_tried(sorted(gone), now)  # it dropped (or dropped us): replace it
            if gone - pruned_here and len(connected) < cfg.target:
                pace.lost_peer()  # a link cut under us (a partition?): rotate at rotate_s for now
            pruned_here -= gone
            d.peerset.observe_connected(connected, now)
            self._report_reachability(connected, now)
            for peer in plan_prunes(connected, d.peerset.rtt, d.peerset.since, cfg, now=now):
                log.debug("peer set above %d: disconnecting %s", cfg.max, peer)
                await prune(peer, now)
                connected.discard(peer)
            rotate = len(connected) >= cfg.target and now >= pace.due()
            if (len(connected) < cfg.target or rotate) and not self.policy.revoked:
                if members_read is not d.gate.members:  # a consortium of hundreds: not rebuilt every round
                    members_read = d.gate.members
                    order = sorted((set(members_read) | set(self.bootstrap)) - {d.gate.self_peer})
                    self.policy.forget(order)
                if hellos_read != self.hellos_seen:  # a hello may have changed: read addresses again
                    hellos_read = self.hellos_seen
                    addrs.clear()
                    for peer, a in (await addrs.get(self.policy.addressed())).items():
                        self.policy.set_addresses(peer, a)  # a new hello lifts a dial back-off at once
                await addrs.get(tried)  # (cached: read again only after a hello changed)

                def dialable(p: str) -> bool:
                    return (p not in connected and p not in d.gate.refused and addrs.cache.get(p) != ()
                            and self.policy.may_dial(p, now)
                            and (p not in tried or now - tried[p][0] >= cfg.redial_after_s
                                 or tried[p][1] != addrs.cache[p]))

                in_order = set(order) if len(order) <= SAMPLE_ALL else None
                extra = [p for p in (*d.peerset.rtt, *self.policy.failing())
                         if (p in in_order if in_order is not None else p in d.gate.members or p in self.bootstrap)]
                fresh = sample_candidates(order, dialable, 1 if rotate else cfg.target - len(connected), rng, extra)
                picks = plan_dials(fresh, connected, d.peerset.rtt, cfg, rng)
                if rotate:  # swap one peer for a random member (re-mixing; see atdnode.peers.peerset)
                    pace.rotated(now)
                    pick = plan_rotation(fresh, connected, rng, self.policy.failing())
                    picks = [pick] if pick is not None else []
                known = await addrs.get(picks)
                picks = [p for p in picks if known[p]]  # a member with no hello: nothing to dial
                for p in picks:
                    self.policy.set_addresses(p, known[p])

                async def dial_pick(peer: str) -> None:
                    tried[peer] = (now, tuple(known[peer]))  # answered: not again soon, even if it drops us
                    if not await self.dial(peer, known[peer]):
                        tried.pop(peer, None)  # nothing answered: the dial back-off decides when to retry

                async with trio.open_nursery() as nursery:
                    for peer in picks:
                        nursery.start_soon(dial_pick, peer)
                now_peers = set(d.transport.peers())
                if rotate and picks and picks[0] in now_peers and len(now_peers) > cfg.target:
                    for peer in plan_prunes(now_peers, d.peerset.rtt, d.peerset.since,
                                            dataclasses.replace(cfg, max=len(now_peers) - 1), now=now, keep=picks):
                        await prune(peer, now)
            with trio.move_on_after(self._tick(order, addrs.cache, pace.due())):
                await self.changed.wait()
            await trio.sleep_until(started + MIN_ROUND_GAP_S)  # each wake-up is free; a round is not

    def _tick(self, order: list[str], addrs: dict[str, tuple[str, ...]], next_rotation: float) -> float:
        """Seconds until the next peer-set round unless a connection wakes it first: one
        second while it has members to dial (or knows of none yet); IDLE_TICK_S (or until the
        next rotation) once it holds `target` peers or every member it knows of (an idle daemon's
        peer set is not re-planned every second). A lost peer is replaced within that; a new
        hello wakes the loop at once (`hellos_changed`)."""
        d = self.d
        tick = max(d.poll_interval * 4, 1.0)
        now_peers = set(d.transport.peers())
        settled = len(now_peers) >= d.peerset.cfg.target or (
            bool(order) and all(p in now_peers or p in d.gate.refused or addrs.get(p) == () for p in order))
        if settled and not self.policy.revoked:
            if len(now_peers) >= d.peerset.cfg.target:  # a rotation may be due before IDLE_TICK_S
                tick = max(tick, min(IDLE_TICK_S, next_rotation - trio.current_time()))
            else:
                tick = max(tick, IDLE_TICK_S)
        return tick

    def _report_reachability(self, connected: set[str], now: float) -> None:
        newly, back = self.policy.observe(connected, now)
        for peer, seconds in newly:
            log.warning("member %s unreachable for %.0f s (no address of its hellos answers); still trying",
                        peer, seconds)
        for peer in back:
            log.info("member %s reachable again", peer)


class RotationPace:
    """When a dialler's next peer-set rotation is due: `peerset.rotation_interval` after the
    last one, from what happened since (dials failing, a peer lost under `target`, entries
    that only sync brought, a membership change; `atdnode.peers.peerset` module doc). Re-evaluated on every peer-set round,
    so a failure or a sync that learned something pulls a distant rotation forward.

    "Entries only sync brought" counts the periodic pulls' (`stats["anti_entropy_added"]`,
    `atdnode.replication.antientropy`), not a new connection's pull: at start-up, and on every new
    connection of a node that was away, that pull brings what the node missed while it was
    not connected, which says nothing about the graph. "A membership change" is the member
    set itself, not a new `hello` (while a consortium of 100 started, every hello
    of a starting member kept every other member rotating every `rotate_s`, a connection set-up
    on both sides each time, and the idle daemons were still doing so minutes later)."""

    def __init__(self, dialer: PeerDialer, now: float) -> None:
        self.dialer = dialer
        self.rotated(now)

    def _learned(self) -> int:
        return getattr(self.dialer.d, "stats", {}).get("anti_entropy_added", 0)

    def _members(self) -> frozenset[str]:
        return self.dialer.d.gate.members

    def rotated(self, now: float) -> None:
        """A rotation happened at `now` (also called once at start). Counted in the daemon's
        stats by what made it due (`rotations_<signal>`, `rotations_quiet`: none)."""
        stats = getattr(self.dialer.d, "stats", None)
        if hasattr(self, "last") and stats is not None:
            for why in [k for k, on in self.signals().items() if on] or ["quiet"]:
                stats[f"rotations_{why}"] = stats.get(f"rotations_{why}", 0) + 1
        self.interval = self._interval()
        self.last, self.learned_at, self.members_at = now, self._learned(), self._members()
        self.lost = False

    def signals(self) -> dict[str, bool]:
        """What suggests a rotation helps, since the last one (`peerset.rotation_interval`)."""
        members = self._members()
        return {"failing": bool(self.dialer.policy.failing()), "lost": self.lost,
                "learned": self._learned() != self.learned_at,
                "members_changed": members is not self.members_at and members != self.members_at}

    def lost_peer(self) -> None:
        """A peer we did not prune went away and left the set under `target`."""
        self.lost = True

    def _interval(self) -> float:
        dialer = self.dialer
        if not hasattr(self, "last"):  # the first rotation: rotate_s after start
            return dialer.d.peerset.cfg.rotate_s
        why = self.signals()
        return rotation_interval(dialer.d.peerset.cfg, self.interval, failing=why["failing"] or why["lost"],
                                 learned=why["learned"], members_changed=why["members_changed"])

    def due(self) -> float:
        return self.last + self._interval()
