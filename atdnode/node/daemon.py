"""The node daemon: replicate the ledger over gossip + sync, serve and fetch blobs, obey the CLI.

One `NodeDaemon` per node home. `run()` starts the transport, then:

* gossips every entry this node authors (whether it was appended by the daemon or by a
  CLI command in another process — the daemon watches its own head in the ledger), so
  entries written while the daemon was down go out when it starts (the home's `announced`
  file keeps the seq gossiped so far: a restart does not re-gossip older entries);
* validates every gossiped entry (signature, consortium membership) *before* the
  transport delivers or relays it, and merges accepted ones into the ledger;
* pulls missing entries from each peer on connect and, every `sync_interval`, from a
  few peers in turn (`atdnode.replication.sync`),
  which covers gossip loss, late joiners, restarts and healed partitions;
* serves blobs it holds and fetches blobs announced by `weights` / `features` entries
  (auto-fetch; `atd fetch` asks for one explicitly);
* talks only to members (`atdnode.replication.access.MembershipGate`, kept current on every
  membership change): non-members' streams are refused before their first frame, they are
  disconnected on connect and never dialled, their gossip is dropped;
* answers the local control socket (`atdnode.node.control`) for `atd node status`, `peers`,
  `fetch`, `connect`, `verify_peers`, `stop`.

Safe restart. The daemon signs nothing (hello, `append`) and gossips none of
its own entries until it has pulled from at least one member -- which hands back any of
its own entries its ledger lost (home restored from a backup, WAL cut) -- so it never
signs a second entry at a seq it already used and never freezes itself. A founder whose
ledger names no other member confirms at once (limit: its home restored from a backup
made before any other member was admitted is not protected). Until a member is reached,
`append` waits.

Everything slow (SQLite, hashing, disk) runs in worker threads.

`NodeDaemon` is the coordinator: it builds the parts, wires them to the transport, runs
their loops in one nursery and offers the public API (`append`, `sync_with`, `fetch`,
`verify_peers`, `status`, `snapshot`, `stop`). The parts:

* `atdnode.replication.replicator.Replicator`: gossip in (validate, merge), sync pulls, own-head check;
* `atdnode.replication.announce.Announcer`: gossip out (own entries, `hello`, the announced seq);
* `atdnode.peers.dialer.PeerDialer`: the membership gate on connections, dialling, back-offs;
* `atdnode.blobs.autofetch.AutoFetcher`: blob auto-fetch with the reader policy;
* `atdnode.node.daemon_control.DaemonControl`: the control socket's requests and the status;
* `atdnode.node.disk_trouble.DiskTrouble`: one log line per episode of disk errors;
* `atdnode.plans.service.PlanService`: carries out the plans this node accepted (a service).

A web front (the dashboard) runs beside it: `run(..., web=front)` starts `front.serve` in the
daemon's nursery before `daemon.json` is written (its URL goes there and to the status). The
daemon never imports it; the front reads `NodeDaemon.snapshot()` (`atdnode.node.snapshot`).
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Protocol

import trio

from atdnode.node import control
from atdnode.replication import (SYNC_FANOUT, SYNC_PROTOCOLS, Announcer, CachedGenesis, LedgerAccess, MembershipGate,
                                 Replicator, quota_from_config)
from atdnode.blobs import AutoFetcher, BlobReaders, BlobService, BlobStore
from atdnode.node.advertise import advertised
from atdnode.node.config import NodeConfig
from atdnode.node.daemon_control import DaemonControl
from atdnode.peers import PeerDialer, PeerSet, PeerSetConfig, gossip_degrees
from atdnode.node.disk_trouble import DiskTrouble
from atdnode.errors import ConfigError, DaemonError
from atdnode.node.gctune import tune_gc
from atdnode.node.home import NodeHome, home_lock
from atdnode.node.identity import NodeIdentity
from atdnode.node.snapshot import NodeSnapshot, campaign_states, fetch_progress
from atdnode.models import ModelRegistry
from atdnode.split import role_services
from atdnode.plans import plan_services
from atdnode.transport import Transport
from ledger import Entry, Ledger

log = logging.getLogger("atd.daemon")


def ledger_topic(genesis_id: str) -> str:
    return f"/atd/ledger/{genesis_id}"


class WebFront(Protocol):
    """A web view run beside the daemon (e.g. `atdnode.report.dashboard.Dashboard`)."""

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, report the URL through `task_status`, serve until cancelled."""


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
        rng_seed: str | None = None,
    ) -> None:
        self.home = home.require()
        self.rng_seed = rng_seed  # seeds the dialer's and periodic sync's choices (simulations; atdnode.node.rngs)
        self.identity = NodeIdentity.load(home)
        self.config = NodeConfig.load(home)
        self.announce = self.config.announce()  # [network] announce: what others dial (atdnode.node.advertise)
        if not self.config.genesis_id:
            raise DaemonError("this node belongs to no consortium yet (init with --genesis or --join)")
        me = self.identity.public_key
        self.ledger = LedgerAccess(Ledger.open(home.ledger_db), own=me,  # [quota]: per-author quotas on merge
                                   quota=quota_from_config(self.config.extra.get("quota")))
        self.peerset = PeerSet(PeerSetConfig.from_table(self.config.extra.get("peers")))  # config.toml [peers]
        self.dialer = PeerDialer(self)  # connections: the membership gate, dialling, back-offs (atdnode.peers.dialer)
        self.store = BlobStore(home.blobs_dir)
        self.transport = transport or self._libp2p_transport()
        self.gate = MembershipGate(self_peer=self.transport.peer_id)
        self.readers = BlobReaders(me)  # who may fetch which blob (atdnode.blobs.readers)
        self.blobs = BlobService(self.transport, self.store, gate=self.gate, may_read=self.readers.may_read,
                                 **self.config.bulk_options())
        self.poll_interval = poll_interval
        self.topic = ledger_topic(self.config.genesis_id)
        self.stats = {"gossip_in": 0, "gossip_rejected": 0, "sync_pulls": 0, "sync_added": 0}
        self.merge_observers: list = []  # fn(entry_ids: list[bytes]) after each merge that added entries
        disk_trouble = DiskTrouble(self.stats)
        self.fetcher = AutoFetcher(ledger=self.ledger, me=me, store=self.store, transport=self.transport,
                                   gate=self.gate, blobs=self.blobs, readers=self.readers, disk_trouble=disk_trouble,
                                   poll_interval=poll_interval, auto_fetch=auto_fetch)
        self.replica = Replicator(ledger=self.ledger, me=me, transport=self.transport, gate=self.gate,
                                  dialer=self.dialer, peerset=self.peerset, stats=self.stats,
                                  disk_trouble=disk_trouble, on_blob_entries=self.fetcher.queue_wanted_blobs,
                                  merge_observers=self.merge_observers, sync_interval=sync_interval,
                                  sync_fanout=sync_fanout, rng_seed=rng_seed)
        self.announcer = Announcer(home=self.home, identity=self.identity, config=self.config, ledger=self.ledger,
                                   transport=self.transport, topic=self.topic, readers=self.readers,
                                   replica=self.replica, poll_interval=poll_interval, addrs=self.addrs)
        self.controller = DaemonControl(self)
        self.web_url: str | None = None  # the URL of the web front run beside the daemon, if any
        self._stop = trio.Event()
        self._nursery: trio.Nursery | None = None
        # Extension point: role services (e.g. a split-learning server). Each has
        # `install(daemon)` (called once the transport runs: register stream handlers) and
        # `async run(daemon)` (started in the daemon's nursery). Tests may append their own.
        # Every node also carries out the plans it accepted (atdnode.plans.service).
        self.services: list = role_services(home, self.config) + plan_services(home, self.config)

    def _libp2p_transport(self) -> Transport:
        from atdnode.transport import GossipConfig, Libp2pTransport

        d, d_low, d_high = gossip_degrees(self.peerset.cfg)  # the mesh follows the bounded peer set
        return Libp2pTransport(self.identity.libp2p_keypair(),
                               gossip=GossipConfig(degree=d, degree_low=d_low, degree_high=d_high))

    # ---------------------------------------------------------------- settings read live by the loops

    @property
    def sync_interval(self) -> float:
        return self.replica.sync_interval

    @sync_interval.setter
    def sync_interval(self, value: float) -> None:
        self.replica.sync_interval = value

    @property
    def auto_fetch(self) -> bool:
        return self.fetcher.auto_fetch

    @auto_fetch.setter
    def auto_fetch(self, value: bool) -> None:
        self.fetcher.auto_fetch = value

    @property
    def members(self) -> set[bytes]:
        """Public keys of the consortium's current members (this node's view)."""
        return self.replica.members

    @property
    def head_confirmed(self) -> bool:
        """Whether a member confirmed this node's own chain head (it signs nothing before)."""
        return self.replica.head_confirmed.is_set()

    # ---------------------------------------------------------------- lifecycle

    def addrs(self) -> list[str]:
        """The addresses others dial (hello, status, daemon.json): `announce`, else the listen
        addresses with 0.0.0.0 / :: expanded to the host's (`atdnode.node.advertise`)."""
        return advertised(self.transport.addrs(), peer_id=self.transport.peer_id, announce=self.announce)

    async def run(self, listen: list[str], bootstrap: list[str] = (), *, web: WebFront | None = None,
                  announce: list[str] | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until `stop()`; reports the addresses others dial (`addrs()`) through
        `task_status` once ready. `web`: a view served beside the daemon (started before
        `daemon.json` is written). `announce`: replaces `[network] announce` of config.toml."""
        if announce is not None:
            self.announce = list(announce)
        for a in self.announce:
            if "/p2p/" in a and a.rsplit("/p2p/", 1)[1] != self.transport.peer_id:
                raise ConfigError(f"announce {a!r}: the /p2p/ part is not this node's peer id {self.transport.peer_id}")
        # bootstrap peers are peer-set candidates too (a newcomer may know no hello yet)
        self.dialer.bootstrap = {a.rsplit("/p2p/", 1)[-1]: [a] for a in bootstrap if "/p2p/" in a}
        with home_lock(self.home):  # one daemon per home, even when two start at once
            await self._run_locked(listen, bootstrap, web, task_status=task_status)

    async def _run_locked(self, listen: list[str], bootstrap: list[str], web: WebFront | None, *,
                          task_status) -> None:
        if await trio.to_thread.run_sync(control.daemon_running, self.home.control_socket):
            raise DaemonError(f"a daemon already runs for {self.home.root}")
        logging.raiseExceptions = False  # a full disk must not turn every log call into a traceback
        replica = self.replica
        await replica.refresh_members()
        dropped = await self.ledger.run(ModelRegistry(self.home).drop_unrecorded)  # a killed `atd aggregate`
        if dropped:
            log.warning("removed %d model record(s) whose aggregate entry is not in the ledger", len(dropped))
        if replica.members == {self.identity.public_key}:
            replica.head_confirmed.set()  # a founder alone: no other member could hold entries of ours
        await self.fetcher.queue_wanted_blobs()  # learn blob reader lists before serving anything; wanted blobs after a restart
        await self.announcer.load()
        self.transport.set_peer_gate(self.dialer.admit)  # every connection and gossip RPC, re-connections included
        async with self.transport.run(listen):
            await self.transport.subscribe(self.topic, replica.on_gossip, replica.validate)
            genesis = CachedGenesis(self.ledger)  # a refusal costs no ledger job: the genesis bytes are cached
            for proto in SYNC_PROTOCOLS:  # v2, and v1 for older daemons (atdnode.replication.sync)
                self.transport.set_stream_handler(proto, self.gate.guard(replica.serve_sync, "ledger sync", genesis))
            self.blobs.install()
            for service in self.services:
                service.install(self)
            self.transport.on_peer_connected(self._on_peer)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(control.serve, self.home.control_socket, self.controller.handle)
                if web is not None:
                    self.web_url = await nursery.start(web.serve)
                self._write_state()
                for loop in (replica.merge_loop, self.announcer.announce_loop, replica.periodic_sync,
                             self.fetcher.fetch_loop, self.dialer.discovery_loop, replica.expire_loop,
                             replica.confirm_head_loop):
                    nursery.start_soon(loop)
                for service in self.services:
                    nursery.start_soon(service.run, self)
                for addr in bootstrap:
                    nursery.start_soon(self.dialer.dial_bootstrap, addr)
                log.info("node %s listening on %s; others dial %s", self.transport.peer_id,
                         " ".join(self.transport.addrs()), " ".join(self.addrs()))
                tune_gc()  # start-up objects out of the collector's scans: no GC pauses in the gossip path
                task_status.started(self.addrs())
                await self._stop.wait()
                log.info("shutting down")
                nursery.cancel_scope.cancel()
            self._nursery = None  # closed: a peer connecting while the transport stops starts nothing
        await self.announcer.save()  # clean stop: what went out since the announce loop's last write
        self._clear_state()
        await self.ledger.close()

    def stop(self) -> None:
        self._stop.set()

    async def stopped(self) -> None:
        """Returns once `stop()` was called."""
        await self._stop.wait()

    def _write_state(self) -> None:
        state = {"pid": os.getpid(), "peer_id": self.transport.peer_id, "addrs": self.addrs(),
                 "started": time.time(), "dashboard": self.web_url}
        tmp = self.home.root / "daemon.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.home.root / "daemon.json")

    def _clear_state(self) -> None:
        try:
            (self.home.root / "daemon.json").unlink()
        except FileNotFoundError:
            pass

    async def _on_peer(self, peer_id: str) -> None:
        if not self.dialer.admit(peer_id):  # the transport's gate ran first; membership may have changed since
            await self.transport.disconnect(peer_id)  # no gossip to outsiders either
            return
        self.dialer.changed.set()  # above max now? the peer-set loop prunes at once
        if self._nursery is not None:
            self.replica.on_connected(peer_id, self._nursery.start_soon)  # which end pulls: atdnode.replication.sync_connect

    # ---------------------------------------------------------------- public API (delegates)

    async def append(self, kind: str, body: dict) -> Entry:
        """Sign, store and gossip an entry at once; waits until the own chain head is confirmed."""
        return await self.announcer.append(kind, body)

    async def sync_with(self, peer_id: str, *, asked: bool = False) -> int:
        """Pull what `peer_id` has and we lack; returns the number of entries added
        (`asked`: see `Replicator.sync_with`)."""
        return await self.replica.sync_with(peer_id, asked=asked)

    async def verify_peers(self) -> dict:
        """Pull from every connected peer; list each entry a peer held that we lacked."""
        return await self.replica.verify_peers()

    async def fetch(self, blob: str, timeout: float = 600.0) -> str:
        """Fetch `blob` from whichever connected peers hold it; returns its hash when stored."""
        return await self.fetcher.fetch(blob, timeout)

    def fetch_report(self, blob: str) -> dict:
        return self.fetcher.fetch_report(blob)

    async def status(self) -> dict:
        """What `atd node status --json` prints."""
        return await self.controller.status()

    def snapshot(self) -> NodeSnapshot:
        """A read-only picture of the running daemon for views beside it (atdnode.node.snapshot)."""
        t = self.transport
        return NodeSnapshot(peer_id=t.peer_id, public_key=self.identity.public_key, name=self.config.name,
                            role=self.config.role, addrs=tuple(self.addrs()), peers=tuple(t.peers()),
                            wanted=frozenset(self.fetcher.wanted), stats=dict(self.stats),
                            fetches=fetch_progress(self.blobs.fetcher.reports), bytes_by_peer=dict(t.bytes_by_peer()),
                            bytes_by_protocol=dict(t.bytes_by_protocol()), campaigns=campaign_states(self.services))
