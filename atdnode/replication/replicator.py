"""Ledger replication of a daemon: gossip in, merges, sync pulls, the own-head check.

`Replicator` holds what `NodeDaemon` delegates about getting other members' entries:

* `validate(data, from_peer)` is the transport's synchronous gossip gate (before delivery
  and relay): size, sender a member, signature, author a member, size quota, body spec. The parsed
  entry is kept for `on_gossip`, which queues it; `merge_loop()` merges queued entries in
  batches (one transaction each) and calls `merge_observers` with the ids added;
* `pull_from(peer)` / `sync_with(peer)` pull what a peer has and we lack (`atdnode.replication.sync`);
  `on_connected(peer, start_soon)` starts the pull of a new connection: the dialling end
  pulls at once, the dialled end only when the dialler's request showed that it lacks
  something, or when none came (`atdnode.replication.sync_connect`);
  `periodic_sync()` pulls from `sync_fanout` members per `sync_interval` in turn;
  `verify_peers()` pulls from every connected peer and lists what they held that we lacked;
* safe restart: `head_confirmed` is set once a member's copy shows that our own
  chain head is complete (`atdnode.replication.own_chain`); `confirm_head_loop()` keeps pulling from
  connected members until then;
* `refresh_members()` keeps `members`, the membership gate and the dialer current;
  `after_merge(kinds)` refreshes what depends on the kinds of entries just added;
* `expire_loop()` drops held entries (unknown authors, chain gaps) after `HELD_TTL`.

Disk errors (SQLite, OSError) are reported through `disk_trouble` and never stop a loop.
"""
from __future__ import annotations

import logging
import math
import sqlite3
from collections import OrderedDict
from typing import Awaitable, Callable

import trio

from atdnode.bodies import refusal
from atdnode.replication import own_chain
from atdnode.replication.access import AccessRefused, MembershipGate
from atdnode.replication.antientropy import AntiEntropy, chain_observers
from atdnode.peers import PeerDialer, PeerSet
from atdnode.replication.ledger_access import LedgerAccess
from atdnode.node import loop_rng
from atdnode.replication.sync_connect import ConnectPulls, Waiter
from atdnode.replication.sync import PER_PEER_STREAMS, TOTAL_STREAMS, SyncResult, SyncVersions, pull, serve_sync
from atdnode.transport import MAX_GOSSIP, PeerLimits, Stream, Transport, TransportError
from ledger import Entry, Ledger
from ledger.errors import LedgerError
from ledger.keys import peer_id_from_public_key

log = logging.getLogger("atd.daemon")

BLOB_KINDS_SET = {"weights", "features", "aggregate"}
MERGE_BATCH = 512
MERGE_LINGER_S = 0.05  # under load, gossip merges at most this often (see merge_loop)
INBOX_SIZE = 20_000
VALIDATED_KEEP = 4096  # validated entries awaiting their delivery to on_gossip
HELD_TTL = 24 * 3600.0  # held entries (unknown authors, chain gaps) expire after this long ...
EXPIRE_EVERY = 600.0  # ... checked this often
SYNC_FANOUT = 1  # peers pulled from per periodic sync interval (in turn, see periodic_sync)


class Replicator:
    """The replication side of one `NodeDaemon` (module doc)."""

    def __init__(self, *, ledger: LedgerAccess, me: bytes, transport: Transport, gate: MembershipGate,
                 dialer: PeerDialer, peerset: PeerSet, stats: dict[str, int],
                 disk_trouble: Callable[[str, BaseException], Awaitable[None]],
                 on_blob_entries: Callable[[], Awaitable[None]], merge_observers: list,
                 sync_interval: float, sync_fanout: int, rng_seed: str | None = None) -> None:
        self.ledger, self.me, self.transport, self.gate = ledger, me, transport, gate
        self.dialer, self.peerset, self.stats = dialer, peerset, stats
        self.disk_trouble = disk_trouble
        self.on_blob_entries = on_blob_entries  # re-read blob entries (reader lists, wanted blobs)
        self.merge_observers = merge_observers  # fn(entry_ids: list[bytes]) after each merge that added entries
        self.sync_interval = sync_interval
        self.sync_fanout = sync_fanout
        self.rng_seed = rng_seed  # None: OS randomness (atdnode.node.rngs)
        self.members: frozenset[bytes] = frozenset()  # `Ledger.member_keys`
        self.head_confirmed = trio.Event()  # own chain head checked with a member (see module doc)
        self._inbox_send, self._inbox_recv = trio.open_memory_channel(INBOX_SIZE)
        self._validated: OrderedDict[bytes, Entry] = OrderedDict()  # wire bytes -> checked entry
        self._sync_limits = PeerLimits(per_peer=PER_PEER_STREAMS, total=TOTAL_STREAMS)
        self._versions = SyncVersions()  # which sync version each peer speaks
        self.connect_pulls = ConnectPulls()  # which end of a new connection pulls
        self.anti_entropy = AntiEntropy(  # periodic sync, paced by what happens (atdnode.replication.antientropy)
            stats=stats, interval=lambda: self.sync_interval, fanout=lambda: self.sync_fanout,
            members=self._pullable_peers,
            pull=self.sync_with, rng=loop_rng(rng_seed, "sync"))
        self._observe = chain_observers(self.connect_pulls.observed, self.anti_entropy.observed)
        self._last_merge = -math.inf  # when merge_loop last committed (see MERGE_LINGER_S)

    # ---------------------------------------------------------------- membership

    async def refresh_members(self) -> None:
        me = self.me

        def members(led: Ledger) -> tuple[frozenset[bytes], bool]:
            keys = led.member_keys()  # admitted, not revoked; the same object while unchanged
            if me in keys:
                return keys, False
            m = led.membership()  # not a member (yet, or any more): revoked, or rotated away?
            status = m.members.get(me)  # revoked, not rotated away (a rotated key reads as revoked too)
            return keys, status is not None and status.revoked and me not in m.rotations

        old = self.members
        self.members, revoked = await self.ledger.run(members)
        if self.members is not old:  # (the ledger hands out the same set while membership is unchanged)
            self.gate.update(peer_id_from_public_key(pk) for pk in self.members)  # same set as access.member_peer_ids
        self.dialer.membership_seen(changed=self.members != old, revoked=revoked)

    def member_peer_ids(self) -> set[str]:
        """Peer ids of the other members."""
        return {peer_id_from_public_key(k) for k in self.members if k != self.me}

    def is_other_member(self, peer_id: str) -> bool:
        """`peer_id in member_peer_ids()` without building the set (O(1): the gate holds the
        same member set as peer ids, `refresh_members`)."""
        return peer_id != self.gate.self_peer and peer_id in self.gate.members

    # ---------------------------------------------------------------- gossip

    def validate(self, data: bytes, from_peer: str) -> bool:
        """Cheap, synchronous gate before delivery and relay: signature + membership."""
        if len(data) > MAX_GOSSIP:
            return False
        if not (self.gate.self_is_member and self.gate.allows(from_peer)):
            # Gossip is between members only: a node not yet admitted learns the log by sync.
            self.stats["gossip_rejected"] += 1
            return False
        try:
            entry = Entry.from_bytes(data)  # checks structure and signature
        except LedgerError as exc:
            log.warning("dropped gossip from %s: %s", from_peer, exc)
            self.stats["gossip_rejected"] += 1
            return False
        if entry.kind != "genesis" and entry.author not in self.members:
            # Unknown authors are not relayed; sync fetches their entries once membership is known.
            self.stats["gossip_rejected"] += 1
            return False
        if self.ledger.quota is not None and self.ledger.quota.too_big(entry):  # over its size quota: not relayed
            self.stats["gossip_rejected"] += 1
            return False
        if entry.kind not in ("genesis", "member") and refusal(entry) is not None:  # merge would refuse it: not relayed
            self.stats["gossip_rejected"] += 1
            return False
        # Handed to on_gossip, which receives these same bytes right after: the entry is
        # parsed and its signature checked once per node, not again by merge.
        self._validated[data] = entry
        if len(self._validated) > VALIDATED_KEEP:
            self._validated.popitem(last=False)
        return True

    async def on_gossip(self, data: bytes, from_peer: str) -> None:
        """Queue an accepted gossip message; `merge_loop` merges queued ones in batches."""
        self.stats["gossip_in"] += 1
        try:
            self._inbox_send.send_nowait(self._validated.pop(data, None) or data)
        except trio.WouldBlock:  # overload: drop it here, the periodic sync fetches it later
            self.stats["gossip_overflow"] = self.stats.get("gossip_overflow", 0) + 1

    async def merge_loop(self) -> None:
        """Merge gossiped entries in batches: one transaction for whatever arrived meanwhile.

        Under load, merges are at least MERGE_LINGER_S apart: an entry arriving sooner after
        the last merge waits for the rest of that interval and goes in with whatever arrives
        meanwhile (one SQLite transaction per delivered entry was most of a
        gossiping node's CPU). An entry arriving after a quiet spell merges at once, so the
        idle latency is unchanged; relaying never waits (it happens at validation)."""
        while True:
            batch = [await self._inbox_recv.receive()]
            await trio.sleep_until(self._last_merge + MERGE_LINGER_S)
            while len(batch) < MERGE_BATCH:
                try:
                    batch.append(self._inbox_recv.receive_nowait())
                except trio.WouldBlock:
                    break
            self._last_merge = trio.current_time()
            try:
                result = await self.ledger.merge(batch)
            except (sqlite3.OperationalError, OSError) as exc:  # disk full / I/O error: sync re-fetches later
                await self.disk_trouble("merging gossip", exc)
                continue
            for _, err in result.rejected:
                log.warning("gossiped entry rejected: %s", err)
            if result.added:
                kinds = {_kind(item) for item in batch}
                for fn in self.merge_observers:
                    fn(list(result.added))
                await self.after_merge(kinds)

    async def after_merge(self, kinds: set[str] | None = None) -> None:
        """Refresh what depends on the log, but only for the kinds of entries that changed it."""
        if kinds is None or kinds & {"hello", "member", "genesis"}:
            self.dialer.hellos_changed()  # the peer-set loop re-reads hello entries (of members) now
        if kinds is None or kinds & {"genesis", "member"}:
            await self.refresh_members()
            await self.dialer.drop_non_members()
        if kinds is None or kinds & BLOB_KINDS_SET:  # reader lists matter with auto-fetch off too
            await self.on_blob_entries()

    # ---------------------------------------------------------------- sync

    async def serve_sync(self, stream: Stream) -> None:
        await serve_sync(stream, self.ledger, self._sync_limits, observe=self._observe)

    def on_connected(self, peer_id: str, start_soon: Callable) -> None:
        """Start the pull of a new connection to `peer_id` (`atdnode.replication.sync_connect`): the
        dialling end (or either, when the transport cannot tell) pulls at once; the dialled
        end, a member, waits for the dialler's request and pulls only if it showed that the
        peer holds something we lack, or if none came in time. Synchronous up to the
        `start_soon`: the wait is registered before any request on the connection is served."""
        if ConnectPulls.waits(self.transport.dialled(peer_id), self.gate.self_is_member):
            start_soon(self._pull_unless_in_step, peer_id, self.connect_pulls.expect(peer_id))
        elif self._may_pull_now(peer_id):
            start_soon(self.sync_with, peer_id)

    def _pullable_peers(self) -> list[str]:
        """Connected members a periodic pull may go to now: not those whose refusal back-off
        runs (a pull slot spent on one was skipped, so a round pulled from nobody)."""
        return [p for p in self.transport.peers() if self.gate.may_pull_from(p) and self.dialer.may_contact(p)]

    def _may_pull_now(self, peer_id: str) -> bool:
        """Not in a refusal back-off with `peer_id`, and no pull from it running already."""
        return self.dialer.may_contact(peer_id) and peer_id not in self.dialer.pulling

    async def _pull_unless_in_step(self, peer_id: str, waiter: Waiter) -> None:
        if await self.connect_pulls.peer_has_nothing_new(peer_id, waiter):
            self.stats["connect_pulls_skipped"] = self.stats.get("connect_pulls_skipped", 0) + 1
            if not self.head_confirmed.is_set() and self.is_other_member(peer_id):
                # its heads are nowhere ahead of ours: it holds no own entry of ours past our head
                log.info("own chain head confirmed with member %s (in step on connecting)", peer_id)
                self.head_confirmed.set()
            return
        if self._may_pull_now(peer_id):
            await self.sync_with(peer_id)

    async def sync_with(self, peer_id: str, *, asked: bool = False) -> int:
        """Pull what `peer_id` has and we lack; returns the number of entries added.
        `asked`: `peer_id` is talking to us right now and the caller needs its entries (e.g.
        a split client's hello before its campaign secret is made), so a refusal back-off
        from an earlier pull does not skip this one."""
        result = await self.pull_from(peer_id, asked=asked)
        return 0 if result is None else result.added

    async def pull_from(self, peer_id: str, *, asked: bool = False) -> SyncResult | None:
        """One sync pull; None when it failed. Confirms our own head if `peer_id` is a member.
        `asked`: see `sync_with`."""
        if not self.gate.may_pull_from(peer_id):
            self.gate.refuse(peer_id, "sync pull")
            return None
        if not asked and not self.dialer.may_contact(peer_id):  # it refused us lately (back-off), or we were revoked
            return None
        me = self.me
        self.dialer.pulling.add(peer_id)
        try:
            with trio.fail_after(60):
                t_open = trio.current_time()
                stream = await self._versions.open(self.transport, peer_id)  # v2, v1 for older daemons
                self.peerset.observe_rtt(peer_id, trio.current_time() - t_open)  # one negotiation round trip
                result = await pull(stream, self.ledger)
        except AccessRefused as exc:
            self.dialer.refused_by(peer_id)
            if getattr(exc, "added", 0):  # the refusal carried a genesis entry new to us
                await self.after_merge()
            return None
        except (TransportError, trio.TooSlowError) as exc:
            log.info("sync with %s failed: %s", peer_id, exc)
            return None
        except (sqlite3.OperationalError, OSError) as exc:
            await self.disk_trouble(f"syncing with {peer_id}", exc)
            return None
        finally:
            self.dialer.pulling.discard(peer_id)
        self.stats["sync_pulls"] += 1
        self.stats["sync_added"] += result.added
        kinds: set[str] = set()
        if result.added_ids:
            # own entries that came back *through this pull* (a CLI appending meanwhile is not a
            # loss), and the kinds added (what after_merge must refresh)
            def added(led: Ledger) -> tuple[int, set[str]]:
                found = [e for i in result.added_ids if (e := led.get(i)) is not None]
                return sum(1 for e in found if e.author == me), {e.kind for e in found}

            recovered, kinds = await self.ledger.run(added)
            if recovered:
                log.warning("peer %s returned %d of this node's own entries that its ledger had lost "
                            "(restored or truncated home); recovered them", peer_id, recovered)
                self.stats["own_recovered"] = self.stats.get("own_recovered", 0) + recovered
        if result.added:
            log.info("sync with %s: %d new entries", peer_id, result.added)
            await self.after_merge(kinds)  # membership first: the pull may have taught us who is a member
        if not self.head_confirmed.is_set() and self.is_other_member(peer_id):
            own_head = await self.ledger.run(lambda led: led.head_of(me))
            if own_chain.confirms(own_head, result.yours):  # every own entry the peer holds is back
                log.info("own chain head confirmed with member %s (seq %d)", peer_id, own_head)
                self.head_confirmed.set()
            else:
                log.warning("member %s holds this node's entries up to seq %s, its ledger only up to seq %d: "
                            "pulling again before signing anything", peer_id, result.yours, own_head)
        return result

    async def confirm_head_loop(self, every: float = 2.0) -> None:
        """Until a member confirmed our own chain head, pull from connected members every
        `every` s. The pull on connect is not enough: a member that did not know us yet
        (e.g. it joined after us, holding only genesis) refuses it, and periodic sync may be
        an hour away, while nothing of ours may be signed or gossiped meanwhile."""
        while not self.head_confirmed.is_set():
            with trio.move_on_after(every):
                await self.head_confirmed.wait()
            if self.head_confirmed.is_set():
                return
            try:
                peers = self.transport.peers()
            except TransportError:
                continue
            for peer in peers:
                if self.is_other_member(peer) and not self.head_confirmed.is_set():
                    await self.pull_from(peer)

    async def verify_peers(self) -> dict:
        """Pull from every connected peer and report each entry a peer held that we lacked.

        Nothing local can show that rows were cut from the end of the ledger (or a
        revocation deleted and the store chain recomputed): only another member's copy can.
        Entries found are merged (the pull repairs what it finds) and listed in `missing`.
        """
        out: dict = {"peers": [], "failed": [], "missing": [], "rejected": 0}
        for peer in self.transport.peers():
            result = await self.pull_from(peer)
            if result is None:
                out["failed"].append(peer)
                continue
            out["peers"].append(peer)
            out["rejected"] += result.rejected
            ids = list(result.added_ids)

            def describe(led: Ledger) -> list[dict]:
                found = [led.get(i) for i in ids]
                return [{"peer": peer, "id": e.id.hex(), "author": peer_id_from_public_key(e.author),
                         "seq": e.seq, "kind": e.kind} for e in found if e is not None]

            out["missing"].extend(await self.ledger.run(describe))
        return out

    async def periodic_sync(self) -> None:
        """Anti-entropy for what gossip missed: every `sync_interval` s, pull from the next
        `sync_fanout` connected members of a shuffled round (`peerset.plan_sync`), so each
        peer is pulled from once per round of ceil(peers / fanout) intervals and the idle cost
        does not grow with the peer set (a pull from every peer each interval was
        most of an idle daemon's CPU). Quiet pulls space out, up to SYNC_IDLE_FACTOR
        intervals, and a member seen ahead of us is pulled from next
        (`atdnode.replication.antientropy`). Connections still pull at once (`NodeDaemon._on_peer`)."""
        await self.anti_entropy.run()

    async def expire_loop(self) -> None:
        while True:
            try:
                n = await self.ledger.run(lambda led: led.expire_held(HELD_TTL, keep=self.ledger.own))
                if n:
                    log.info("expired %d held entries (unknown authors, chain gaps)", n)
            except (sqlite3.OperationalError, OSError) as exc:
                await self.disk_trouble("expiring held entries", exc)
            await trio.sleep(EXPIRE_EVERY)


def _kind(item: Entry | bytes) -> str | None:
    """The kind of a queued gossip item (a validated Entry, or raw bytes merge accepted)."""
    if isinstance(item, Entry):
        return item.kind
    try:
        return Entry.from_bytes(item).kind
    except LedgerError:
        return None
