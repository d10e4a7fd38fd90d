"""The node daemon: replicate the ledger over gossip + sync, serve and fetch blobs, obey the CLI.

One `NodeDaemon` per node home. `run()` starts the transport, then:

* gossips every entry this node authors (whether it was appended by the daemon or by a
  CLI command in another process — the daemon watches its own head in the ledger), so
  entries written while the daemon was down go out when it starts (the home's `announced`
  file keeps the seq gossiped so far: a restart does not re-gossip older entries);
* validates every gossiped entry (signature, consortium membership) *before* the
  transport delivers or relays it, and merges accepted ones into the ledger;
* pulls missing entries from each peer on connect and, every `sync_interval`, from a
  few peers in turn (`atdnode.sync`),
  which covers gossip loss, late joiners, restarts and healed partitions;
* serves blobs it holds and fetches blobs announced by `weights` / `features` entries
  (auto-fetch; `atd fetch` asks for one explicitly);
* talks only to members (`atdnode.access.MembershipGate`, kept current on every
  membership change): non-members' streams are refused before their first frame, they are
  disconnected on connect and never dialled, their gossip is dropped;
* answers the local control socket (`atdnode.control`) for `atd node status`, `peers`,
  `fetch`, `connect`, `verify_peers`, `stop`.

Safe restart (issue 11). The daemon signs nothing (hello, `append`) and gossips none of
its own entries until it has pulled from at least one member -- which hands back any of
its own entries its ledger lost (home restored from a backup, WAL cut) -- so it never
signs a second entry at a seq it already used and never freezes itself. A founder whose
ledger names no other member confirms at once (limit: its home restored from a backup
made before any other member was admitted is not protected). Until a member is reached,
`append` waits.

Everything slow (SQLite, hashing, disk) runs in worker threads.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import sqlite3
import time
from collections import OrderedDict

import trio

from atdnode import bodies, control, own_chain
from atdnode.access import AccessRefused, MembershipGate
from atdnode.blobstore import BlobStore
from atdnode.config import NodeConfig
from atdnode.errors import DaemonError
from atdnode.gctune import tune_gc
from atdnode.home import NodeHome, home_lock
from atdnode.identity import NodeIdentity
from atdnode.ledger_access import LedgerAccess, quota_from_config
from atdnode.registry import ModelRegistry
from atdnode.dialer import PeerDialer
from atdnode.peerset import PeerSet, PeerSetConfig, gossip_degrees, plan_sync
from atdnode.split import role_services
from atdnode.blob_readers import BlobReaders
from atdnode.sync import PER_PEER_STREAMS, SYNC_PROTOCOL, TOTAL_STREAMS, CachedGenesis, SyncResult, pull, serve_sync
from atdnode.transport.limits import PeerLimits
from atdnode.transport.base import MAX_GOSSIP, Stream, Transport, TransportError
from atdnode.transport.blobxfer import BlobService
from ledger import Entry, Ledger
from ledger.errors import LedgerError
from ledger.keys import peer_id_from_public_key

log = logging.getLogger("atd.daemon")

BLOB_KINDS_SET = {"weights", "features", "aggregate"}
MERGE_BATCH = 512
INBOX_SIZE = 20_000
VALIDATED_KEEP = 4096  # validated entries awaiting their delivery to _on_gossip
HELD_TTL = 24 * 3600.0  # held entries of unknown authors expire after this long (issue 11) ...
EXPIRE_EVERY = 600.0  # ... checked this often
LEDGER_RECHECK_S = 5.0  # the announce loop reads the ledger at least this often, changed or not
SYNC_FANOUT = 1  # peers pulled from per periodic sync interval (in turn, see _periodic_sync)


def ledger_topic(genesis_id: str) -> str:
    return f"/atd/ledger/{genesis_id}"


class NodeDaemon:
    """A running node. Construct, then `await run(listen, bootstrap)` inside trio."""

    def __init__(
        self,
        home: NodeHome,
        *,
        transport: Transport | None = None,
        sync_interval: float = 10.0,
        sync_fanout: int = SYNC_FANOUT,
        poll_interval: float = 0.25,
        auto_fetch: bool = True,
        dashboard: tuple[str, int] | None = None,
        dashboard_public: bool = False,
    ) -> None:
        self.home = home.require()
        self.identity = NodeIdentity.load(home)
        self.config = NodeConfig.load(home)
        if not self.config.genesis_id:
            raise DaemonError("this node belongs to no consortium yet (init with --genesis or --join)")
        self.ledger = LedgerAccess(Ledger.open(home.ledger_db), own=self.identity.public_key,  # [quota]: issue 24
                                   quota=quota_from_config(self.config.extra.get("quota")))
        self.peerset = PeerSet(PeerSetConfig.from_table(self.config.extra.get("peers")))  # config.toml [peers]
        self.dialer = PeerDialer(self)  # connections: the membership gate, dialling, back-offs (atdnode.dialer)
        self.store = BlobStore(home.blobs_dir)
        self.transport = transport or self._libp2p_transport()
        self.gate = MembershipGate(self_peer=self.transport.peer_id)
        self.readers = BlobReaders(self.identity.public_key)  # who may fetch which blob (atdnode.blob_readers)
        self.blobs = BlobService(self.transport, self.store, gate=self.gate, may_read=self.readers.may_read,
                                 **self.config.bulk_options())
        self.sync_interval = sync_interval
        self.sync_fanout = sync_fanout
        self.poll_interval = poll_interval
        self.auto_fetch = auto_fetch
        self.topic = ledger_topic(self.config.genesis_id)
        self._stop = trio.Event()
        self._members: set[bytes] = set()
        self._announced_seq = 0
        self._hello_said: tuple | None = None  # (addrs, role) of our last signed hello
        self._wanted: set[str] = set()
        self._manifests: dict[str, str] = {}  # blob -> manifest hash named by a signed entry
        self._fetch_failures: dict[str, str] = {}
        self._retry_at: dict[str, tuple[float, float]] = {}  # blob -> (next try, back-off delay)
        self._head_confirmed = trio.Event()  # own chain head checked with a member (see module doc)
        self._disk_full_until = 0.0
        self._nursery: trio.Nursery | None = None
        self._inbox_send, self._inbox_recv = trio.open_memory_channel(INBOX_SIZE)
        self._validated: OrderedDict[bytes, Entry] = OrderedDict()  # wire bytes -> checked entry
        self._sync_limits = PeerLimits(per_peer=PER_PEER_STREAMS, total=TOTAL_STREAMS)
        self.merge_observers: list = []  # fn(entry_ids: list[bytes]) after each merge that added entries
        self.stats = {"gossip_in": 0, "gossip_rejected": 0, "sync_pulls": 0, "sync_added": 0}
        # Extension point: role services (e.g. a split-learning server). Each has
        # `install(daemon)` (called once the transport runs: register stream handlers) and
        # `async run(daemon)` (started in the daemon's nursery). Tests may append their own.
        self.services: list = role_services(home, self.config)
        self.dashboard = None
        if dashboard is not None:  # read-only web page + /metrics + /healthz (atdnode.dashboard)
            from atdnode.dashboard import Dashboard

            self.dashboard = Dashboard(self, host=dashboard[0], port=dashboard[1], public=dashboard_public)

    def _libp2p_transport(self) -> Transport:
        from atdnode.transport.libp2p_transport import GossipConfig, Libp2pTransport

        d, d_low, d_high = gossip_degrees(self.peerset.cfg)  # the mesh follows the bounded peer set
        return Libp2pTransport(self.identity.libp2p_keypair(),
                               gossip=GossipConfig(degree=d, degree_low=d_low, degree_high=d_high))

    # ---------------------------------------------------------------- lifecycle

    async def run(self, listen: list[str], bootstrap: list[str] = (), *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        # bootstrap peers are peer-set candidates too (a newcomer may know no hello yet)
        self.dialer.bootstrap = {a.rsplit("/p2p/", 1)[-1]: [a] for a in bootstrap if "/p2p/" in a}
        with home_lock(self.home):  # one daemon per home, even when two start at once
            await self._run_locked(listen, bootstrap, task_status=task_status)

    async def _run_locked(self, listen: list[str], bootstrap: list[str], *, task_status) -> None:
        if await trio.to_thread.run_sync(control.daemon_running, self.home.control_socket):
            raise DaemonError(f"a daemon already runs for {self.home.root}")
        logging.raiseExceptions = False  # a full disk must not turn every log call into a traceback
        await self._refresh_members()
        dropped = await self.ledger.run(ModelRegistry(self.home).drop_unrecorded)  # a killed `atd aggregate`
        if dropped:
            log.warning("removed %d model record(s) whose aggregate entry is not in the ledger", len(dropped))
        if self._members == {self.identity.public_key}:
            self._head_confirmed.set()  # a founder alone: no other member could hold entries of ours
        await self._queue_wanted_blobs()  # learn blob reader lists before serving anything; wanted blobs after a restart
        self._announced_seq = await trio.to_thread.run_sync(read_announced, self.home)
        self.transport.set_peer_gate(self.dialer.admit)  # every connection and gossip RPC, re-connections included
        async with self.transport.run(listen):
            await self.transport.subscribe(self.topic, self._on_gossip, self._validate)
            self.transport.set_stream_handler(  # a refusal costs no ledger job: the genesis bytes are cached
                SYNC_PROTOCOL, self.gate.guard(self._serve_sync, "ledger sync", CachedGenesis(self.ledger)))
            self.blobs.install()
            for service in self.services:
                service.install(self)
            self.transport.on_peer_connected(self._on_peer)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(control.serve, self.home.control_socket, self._control)
                if self.dashboard is not None:
                    await nursery.start(self.dashboard.serve)
                self._write_state()
                nursery.start_soon(self._merge_loop)
                nursery.start_soon(self._announce_loop)
                nursery.start_soon(self._periodic_sync)
                nursery.start_soon(self._fetch_loop)
                nursery.start_soon(self.dialer.discovery_loop)
                nursery.start_soon(self._expire_loop)
                nursery.start_soon(self._confirm_head_loop)
                for service in self.services:
                    nursery.start_soon(service.run, self)
                for addr in bootstrap:
                    nursery.start_soon(self.dialer.dial_bootstrap, addr)
                log.info("node %s listening on %s", self.transport.peer_id, " ".join(self.transport.addrs()))
                tune_gc()  # start-up objects out of the collector's scans: no GC pauses in the gossip path
                task_status.started(self.transport.addrs())
                await self._stop.wait()
                log.info("shutting down")
                nursery.cancel_scope.cancel()
        if self._announced_seq:  # clean stop: what went out since the announce loop's last write
            await trio.to_thread.run_sync(write_announced, self.home, self._announced_seq)
        self._clear_state()
        await self.ledger.close()

    def stop(self) -> None:
        self._stop.set()

    async def stopped(self) -> None:
        """Returns once `stop()` was called."""
        await self._stop.wait()

    def _write_state(self) -> None:
        state = {"pid": os.getpid(), "peer_id": self.transport.peer_id, "addrs": self.transport.addrs(), "started": time.time(),
                 "dashboard": self.dashboard.url if self.dashboard is not None else None}
        tmp = self.home.root / "daemon.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.home.root / "daemon.json")

    def _clear_state(self) -> None:
        try:
            (self.home.root / "daemon.json").unlink()
        except FileNotFoundError:
            pass

    # ---------------------------------------------------------------- gossip

    async def _refresh_members(self) -> None:
        me = self.identity.public_key

        def members(led: Ledger) -> tuple[set[bytes], bool]:
            m = led.membership()
            status = m.members.get(me)  # revoked, not rotated away (a rotated key reads as revoked too)
            revoked = status is not None and status.revoked and me not in m.rotations
            return {pk for pk in m.members if m.is_member(pk)}, revoked

        old = self._members
        self._members, revoked = await self.ledger.run(members)
        self.gate.update(peer_id_from_public_key(pk) for pk in self._members)  # same set as access.member_peer_ids
        self.dialer.membership_seen(changed=self._members != old, revoked=revoked)

    def _validate(self, data: bytes, from_peer: str) -> bool:
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
        if entry.kind != "genesis" and entry.author not in self._members:
            # Unknown authors are not relayed; sync fetches their entries once membership is known.
            self.stats["gossip_rejected"] += 1
            return False
        if self.ledger.quota is not None and self.ledger.quota.too_big(entry):  # over its size quota: not relayed
            self.stats["gossip_rejected"] += 1
            return False
        # Handed to _on_gossip, which receives these same bytes right after: the entry is
        # parsed and its signature checked once per node, not again by merge.
        self._validated[data] = entry
        if len(self._validated) > VALIDATED_KEEP:
            self._validated.popitem(last=False)
        return True

    async def _on_gossip(self, data: bytes, from_peer: str) -> None:
        """Queue an accepted gossip message; `_merge_loop` merges queued ones in batches."""
        self.stats["gossip_in"] += 1
        try:
            self._inbox_send.send_nowait(self._validated.pop(data, None) or data)
        except trio.WouldBlock:  # overload: drop it here, the periodic sync fetches it later
            self.stats["gossip_overflow"] = self.stats.get("gossip_overflow", 0) + 1

    async def _merge_loop(self) -> None:
        """Merge gossiped entries in batches: one transaction for whatever arrived meanwhile."""
        while True:
            batch = [await self._inbox_recv.receive()]
            while len(batch) < MERGE_BATCH:
                try:
                    batch.append(self._inbox_recv.receive_nowait())
                except trio.WouldBlock:
                    break
            try:
                result = await self.ledger.merge(batch)
            except (sqlite3.OperationalError, OSError) as exc:  # disk full / I/O error: sync re-fetches later
                await self._disk_trouble("merging gossip", exc)
                continue
            for _, err in result.rejected:
                log.warning("gossiped entry rejected: %s", err)
            if result.added:
                kinds = {_kind(item) for item in batch}
                for fn in self.merge_observers:
                    fn(list(result.added))
                await self._after_merge(kinds)

    async def _after_merge(self, kinds: set[str] | None = None) -> None:
        """Refresh what depends on the log, but only for the kinds of entries that changed it."""
        if kinds is None or kinds & {"hello", "member", "genesis"}:
            self.dialer.hellos_seen += 1  # the peer-set loop re-reads hello entries (of members)
        if kinds is None or kinds & {"genesis", "member"}:
            await self._refresh_members()
            await self.dialer.drop_non_members()
        if kinds is None or kinds & BLOB_KINDS_SET:  # reader lists matter with auto-fetch off too
            await self._queue_wanted_blobs()

    async def _announce_loop(self) -> None:
        """Gossip entries this node authored (by the daemon or by CLI commands) since last time."""
        me = self.identity.public_key
        with trio.move_on_after(30):
            await self._head_confirmed.wait()  # never gossip own entries a member may contradict
        if not self._head_confirmed.is_set():
            log.warning("no member reachable yet to confirm this node's own chain head: signing nothing until one is "
                        "(restart with --bootstrap <member address>)")
            await self._head_confirmed.wait()
        head = await self.ledger.run(lambda led: led.head_of(me))
        saved = self._announced_seq = min(self._announced_seq, head)  # a restored home may hold fewer
        stamp, recheck_at = None, 0.0
        while True:
            # Idle cost (issue 15): the ledger is read only when its files changed (a CLI
            # command appended, or a merge), when no hello went out yet, and every
            # LEDGER_RECHECK_S; otherwise a poll tick is two stat calls, no thread hop.
            now = trio.current_time()
            new_stamp = ledger_stamp(self.home.ledger_db)
            if new_stamp == stamp and now < recheck_at and self._hello_said is not None:
                await trio.sleep(self.poll_interval)
                continue
            stamp, recheck_at = new_stamp, now + LEDGER_RECHECK_S
            try:
                await self._maybe_say_hello()
            except (sqlite3.OperationalError, OSError) as exc:
                await self._disk_trouble("appending hello", exc)
            head = await self.ledger.run(lambda led: led.head_of(me))
            if self._announced_seq != saved:  # a restart re-gossips only what was never announced
                saved = self._announced_seq
                await trio.to_thread.run_sync(write_announced, self.home, saved)
            if head > self._announced_seq:
                seq = self._announced_seq
                entries = await self.ledger.run(lambda led: led.entries_after(me, seq))
                if {e.kind for e in entries} & BLOB_KINDS_SET:  # reader lists before anyone hears of a blob
                    await self.ledger.run(self.readers.refresh)
                for e in entries:
                    try:
                        await self.transport.publish(self.topic, e.to_bytes())
                    except TransportError as exc:  # no peers yet: sync will carry it
                        log.debug("publish of %s deferred: %s", e.id.hex()[:12], exc)
                    self._announced_seq = e.seq
                await self._after_merge({e.kind for e in entries})
            await trio.sleep(self.poll_interval)

    async def append(self, kind: str, body: dict) -> Entry:
        """Sign and store an entry, and gossip it at once (no wait for the announce loop).

        Waits until the own chain head was confirmed with a member (see the module doc)."""
        await self._head_confirmed.wait()
        entry = await self.ledger.append(self.identity.signer, kind, bodies.check_body(kind, body))  # group commit
        if kind in BLOB_KINDS_SET:  # its reader list holds before the entry is gossiped
            await self.ledger.run(self.readers.refresh)
        if entry.seq == self._announced_seq + 1:
            try:
                await self.transport.publish(self.topic, entry.to_bytes())
                self._announced_seq = entry.seq
            except TransportError as exc:
                log.debug("publish deferred: %s", exc)
        return entry

    async def _maybe_say_hello(self) -> None:
        """Append a signed `hello` (addresses, X25519 key, role) once we are a member and addrs changed."""
        me = self.identity.public_key
        if me not in self._members or not self._head_confirmed.is_set():
            return
        addrs = self.transport.addrs()
        said = (tuple(addrs), self.config.role)
        if self._hello_said == said:  # checked on every poll tick: no query each time
            return

        def current(led: Ledger):
            hellos = led.query(kind="hello", author=me)
            return hellos[-1].body if hellos else None

        last = await self.ledger.run(current)
        body = {
            "addrs": addrs,
            "x25519": self.identity.x25519_public,
            "role": self.config.role,
            "name": self.config.name,
        }
        if last is not None and last.get("addrs") == addrs and last.get("role") == body["role"]:
            self._hello_said = said
            return
        await self.ledger.append(self.identity.signer, "hello", bodies.check_body("hello", body))
        self._hello_said = said

    # ---------------------------------------------------------------- sync

    async def _serve_sync(self, stream: Stream) -> None:
        await serve_sync(stream, self.ledger, self._sync_limits)

    async def _on_peer(self, peer_id: str) -> None:
        if not self.dialer.admit(peer_id):  # the transport's gate ran first; membership may have changed since
            await self.transport.disconnect(peer_id)  # no gossip to outsiders either
            return
        self.dialer.changed.set()  # above max now? the peer-set loop prunes at once
        if self._nursery is not None and self.dialer.may_contact(peer_id) and peer_id not in self.dialer.pulling:
            self._nursery.start_soon(self.sync_with, peer_id)

    async def sync_with(self, peer_id: str) -> int:
        """Pull what `peer_id` has and we lack; returns the number of entries added."""
        result = await self._pull_from(peer_id)
        return 0 if result is None else result.added

    async def _pull_from(self, peer_id: str) -> SyncResult | None:
        """One sync pull; None when it failed. Confirms our own head if `peer_id` is a member."""
        if not self.gate.may_pull_from(peer_id):
            self.gate.refuse(peer_id, "sync pull")
            return None
        if not self.dialer.may_contact(peer_id):  # it refused us lately (back-off), or we were revoked
            return None
        me = self.identity.public_key
        self.dialer.pulling.add(peer_id)
        try:
            with trio.fail_after(60):
                t_open = trio.current_time()
                stream = await self.transport.open_stream(peer_id, SYNC_PROTOCOL)
                self.peerset.observe_rtt(peer_id, trio.current_time() - t_open)  # one negotiation round trip
                result = await pull(stream, self.ledger)
        except AccessRefused as exc:
            self.dialer.refused_by(peer_id)
            if getattr(exc, "added", 0):  # the refusal carried a genesis entry new to us
                await self._after_merge()
            return None
        except (TransportError, trio.TooSlowError) as exc:
            log.info("sync with %s failed: %s", peer_id, exc)
            return None
        except (sqlite3.OperationalError, OSError) as exc:
            await self._disk_trouble(f"syncing with {peer_id}", exc)
            return None
        finally:
            self.dialer.pulling.discard(peer_id)
        self.stats["sync_pulls"] += 1
        self.stats["sync_added"] += result.added
        kinds: set[str] = set()
        if result.added_ids:
            # own entries that came back *through this pull* (a CLI appending meanwhile is not a
            # loss), and the kinds added (what _after_merge must refresh)
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
            await self._after_merge(kinds)  # membership first: the pull may have taught us who is a member
        if not self._head_confirmed.is_set() and peer_id in self._member_peer_ids():
            own_head = await self.ledger.run(lambda led: led.head_of(me))
            if own_chain.confirms(own_head, result.yours):  # every own entry the peer holds is back (issue 24)
                log.info("own chain head confirmed with member %s (seq %d)", peer_id, own_head)
                self._head_confirmed.set()
            else:
                log.warning("member %s holds this node's entries up to seq %s, its ledger only up to seq %d: "
                            "pulling again before signing anything", peer_id, result.yours, own_head)
        return result

    async def _confirm_head_loop(self, every: float = 2.0) -> None:
        """Until a member confirmed our own chain head, pull from connected members every
        `every` s. The pull on connect is not enough: a member that did not know us yet
        (e.g. it joined after us, holding only genesis) refuses it, and periodic sync may be
        an hour away, while nothing of ours may be signed or gossiped meanwhile."""
        while not self._head_confirmed.is_set():
            with trio.move_on_after(every):
                await self._head_confirmed.wait()
            if self._head_confirmed.is_set():
                return
            try:
                peers = self.transport.peers()
            except TransportError:
                continue
            members = self._member_peer_ids()
            for peer in peers:
                if peer in members and not self._head_confirmed.is_set():
                    await self._pull_from(peer)

    def _member_peer_ids(self) -> set[str]:
        from ledger.keys import peer_id_from_public_key

        return {peer_id_from_public_key(k) for k in self._members if k != self.identity.public_key}

    async def verify_peers(self) -> dict:
        """Pull from every connected peer and report each entry a peer held that we lacked.

        Nothing local can show that rows were cut from the end of the ledger (or a
        revocation deleted and the store chain recomputed): only another member's copy can.
        Entries found are merged (the pull repairs what it finds) and listed in `missing`.
        """
        from ledger.keys import peer_id_from_public_key

        out: dict = {"peers": [], "failed": [], "missing": [], "rejected": 0}
        for peer in self.transport.peers():
            result = await self._pull_from(peer)
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

    async def _disk_trouble(self, what: str, exc: BaseException) -> None:
        """One log line per episode of disk trouble, then back off (never a traceback or a hot loop)."""
        now = trio.current_time()
        full = getattr(exc, "errno", None) == errno.ENOSPC or "full" in str(exc).lower()
        if now >= self._disk_full_until:
            log.error("%s failed: %s%s; backing off", what, "disk full" if full else "disk error",
                      f" ({str(exc)[:120]})" if not full else "")
        self._disk_full_until = now + 60.0
        self.stats["disk_errors"] = self.stats.get("disk_errors", 0) + 1
        await trio.sleep(5.0)

    async def _periodic_sync(self) -> None:
        """Anti-entropy for what gossip missed: every `sync_interval` s, pull from the next
        `sync_fanout` connected members of a shuffled round (`peerset.plan_sync`), so each
        peer is pulled from once per round of ceil(peers / fanout) intervals and the idle cost
        does not grow with the peer set (issue 15; a pull from every peer each interval was
        most of an idle daemon's CPU). Connections still pull at once (`_on_peer`)."""
        rng = random.Random()
        due: list[str] = []
        while True:
            await trio.sleep(self.sync_interval)
            members = [p for p in self.transport.peers() if self.gate.may_pull_from(p)]
            picks = plan_sync(due, members, self.sync_fanout, rng)
            for peer in picks:
                await self.sync_with(peer)

    async def _expire_loop(self) -> None:
        while True:
            try:
                n = await self.ledger.run(lambda led: led.expire_held(HELD_TTL, keep=self.ledger.own))
                if n:
                    log.info("expired %d held entries of unknown authors", n)
            except (sqlite3.OperationalError, OSError) as exc:
                await self._disk_trouble("expiring held entries", exc)
            await trio.sleep(EXPIRE_EVERY)

    # ---------------------------------------------------------------- blobs

    async def _queue_wanted_blobs(self) -> None:
        me = self.identity.public_key

        def wanted(led: Ledger) -> set[str]:
            out = set()
            named = led.query(kind="aggregate") + led.query(kind="weights") + led.query(kind="features")
            for e in named:
                if isinstance(e.body.get("blob"), str) and isinstance(e.body.get("manifest"), str):
                    self._manifests.setdefault(e.body["blob"], e.body["manifest"])
            self.readers.refresh(led, named)
            for kind in ("weights", "features"):
                for e in led.query(kind=kind):
                    if e.author == me:
                        continue
                    blob = e.body.get("blob")
                    if isinstance(blob, str) and not self.readers.for_me(blob):
                        continue  # for named readers only (sealed features, MSD's authorised list)
                    if isinstance(blob, str) and not self.store.has(blob):
                        out.add(blob)
            return out

        self._wanted |= await self.ledger.run(wanted)

    async def _fetch_loop(self) -> None:
        while True:
            # with --no-auto-fetch only explicit `fetch` calls download (they learn manifests, not wants)
            for blob in sorted(self._wanted) if self.auto_fetch else []:
                if self.store.has(blob) or blob in self._fetch_failures:
                    self._wanted.discard(blob)
                    continue
                now = trio.current_time()
                at, delay = self._retry_at.get(blob, (0.0, 1.0))
                if now < at:
                    continue
                try:
                    await self.fetch(blob)
                    self._retry_at.pop(blob, None)
                except (DaemonError, TransportError) as exc:
                    self._retry_at[blob] = (now + delay, min(delay * 2, 60.0))
                    log.info("fetch of %s postponed %.0f s: %s", blob[:12], delay, exc)
                except OSError as exc:  # disk full or unwritable store: one line, long back-off
                    self._retry_at[blob] = (now + max(delay, 30.0), min(max(delay, 30.0) * 2, 600.0))
                    await self._disk_trouble(f"fetching blob {blob[:12]}", exc)
            await trio.sleep(max(self.poll_interval, 1.0))

    async def fetch(self, blob: str, timeout: float = 600.0) -> str:
        """Fetch `blob` from whichever connected peers hold it; returns its hash when stored."""
        if self.store.has(blob):
            return blob
        if not self.transport.peers():
            raise DaemonError("no connected peers to fetch from")
        with trio.move_on_after(min(timeout, 15.0)):  # connected, but membership may still be syncing
            while not (peers := [p for p in self.transport.peers() if self.gate.allows(p)]):
                await trio.sleep(0.2)
        if not peers:
            raise DaemonError("no connected member peers to fetch from")
        if blob not in self._manifests:
            await self._queue_wanted_blobs()  # learn the manifest hash the signed entry names
        with trio.fail_after(timeout):
            await self.blobs.fetch(blob, peers, manifest_hash=self._manifests.get(blob))
        self._wanted.discard(blob)
        return blob

    def fetch_report(self, blob: str) -> dict:
        rep = self.blobs.fetcher.reports.get(blob)
        if rep is None:
            return {}
        return {"bytes": rep.bytes, "resumed_chunks": rep.resumed_chunks, "holders": list(rep.holders),
                "chunks_from": dict(rep.chunks_from), "bad_peers": dict(rep.bad_peers), "seconds": rep.seconds,
                "modes": dict(rep.modes), "bulk_failed": dict(rep.bulk_failed)}

    # ---------------------------------------------------------------- control

    async def _control(self, req: dict) -> dict:
        op = req["op"]
        if op == "ping":
            return {"peer_id": self.transport.peer_id}
        if op == "status":
            return await self.status()
        if op == "peers":
            return {"peers": self.transport.peers()}
        if op == "fetch":
            blob = req.get("blob")
            if not isinstance(blob, str):
                raise DaemonError("fetch needs a blob hash")
            await self.fetch(blob, timeout=float(req.get("timeout_s", 600)))
            return {"blob": blob, "size": self.store.size(blob), "report": self.fetch_report(blob)}
        if op == "connect":
            return {"peer": await self.transport.connect(str(req.get("addr")))}
        if op == "verify_peers":
            return await self.verify_peers()
        if op == "sync":
            added = 0
            for peer in self.transport.peers():
                added += await self.sync_with(peer)
            return {"added": added}
        if op == "stop":
            self.stop()
            return {}
        raise DaemonError(f"unknown control op {op!r}")

    async def status(self) -> dict:
        def ledger_state(led: Ledger) -> dict:
            from ledger.keys import peer_id_from_public_key

            heads = {peer_id_from_public_key(a): s for a, s in led.heads().items()}
            return {"heads": heads, "entries": sum(heads.values())}

        state = await self.ledger.run(ledger_state)
        return {
            "peer_id": self.transport.peer_id,
            "addrs": self.transport.addrs(),
            "peers": self.transport.peers(),
            "refused": sorted(self.gate.refused),  # non-members refused so far
            "members": len(self._member_peer_ids()),  # other members (the dashboard's "connected N of M")
            **self.dialer.status(),  # unreachable members (peer -> seconds), revoked, refusals received
            "ledger": state,
            "blobs": len(self.store.list()),
            "wanted": sorted(self._wanted),
            "bytes": self.transport.bytes_counters(),
            "stats": dict(self.stats),
            "peer_set": {"target": self.peerset.cfg.target, "max": self.peerset.cfg.max,
                         "dialled": self.peerset.dialled, "pruned": self.peerset.pruned},
            "dashboard": self.dashboard.url if self.dashboard is not None else None,
        }


def ledger_stamp(db: "os.PathLike[str] | str") -> tuple:
    """A cheap change signal for a SQLite ledger file: (size, mtime, inode) of the database
    and of its WAL. Any commit, from this process or another one (a CLI command), changes
    it. Two stat calls of a local file cost microseconds, so they run on the event loop;
    the ledger itself is read in a worker thread only when the stamp moved."""
    out = []
    for path in (os.fspath(db), os.fspath(db) + "-wal"):
        try:
            st = os.stat(path)
            out.append((st.st_size, st.st_mtime_ns, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def read_announced(home: NodeHome) -> int:
    """The seq up to which this node's own entries were gossiped (0: none, or unknown)."""
    try:
        return max(0, int(home.announced_file.read_text().strip() or 0))
    except (OSError, ValueError):
        return 0


def write_announced(home: NodeHome, seq: int) -> None:
    """Remember (atomically) that own entries up to `seq` were gossiped; best effort."""
    tmp = home.announced_file.with_suffix(".tmp")
    try:
        tmp.write_text(str(seq))
        tmp.replace(home.announced_file)
    except OSError as exc:  # a full disk costs only duplicate gossip after a restart
        log.debug("could not record the announced seq: %s", exc)


def _kind(item: Entry | bytes) -> str | None:
    """The kind of a queued gossip item (a validated Entry, or raw bytes merge accepted)."""
    if isinstance(item, Entry):
        return item.kind
    try:
        return Entry.from_bytes(item).kind
    except LedgerError:
        return None
