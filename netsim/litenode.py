"""Gossip-only peers for in-memory runs of 1,000 nodes and more.

A full `NodeDaemon` per node (SQLite ledger, control socket, hello + discovery loops) costs
too much for thousands of nodes in one process. A `LitePeer` keeps the parts that decide
how entries spread — the real `MemoryTransport` gossip (validator before relay), real
signed `ledger.Entry` bytes verified on arrival, and the real ledger sync protocol
(`atdnode.replication.sync`, on connect and periodically) — over an in-memory log instead of SQLite.
`LiteCluster` has the same calls as `memnet.MemCluster`, so `workload.run_gossip` and the
faults drive either.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Collection, TypeVar

import trio

from atdnode.peers import PeerSetConfig, gossip_degrees
from atdnode.replication import SYNC_PROTOCOL, pull, serve_sync
from atdnode.transport import Stream, TransportError
from ledger import Entry, LedgerError, Signer, peer_id_from_public_key
from netsim.homes import node_seed
from netsim.memnet import CappedTransport, SimNetwork
from netsim.scenario import NetworkSpec

T = TypeVar("T")
TOPIC = "/atd/ledger/netsim-lite"


@dataclass
class _Merged:
    added: list[bytes] = field(default_factory=list)
    rejected: list[tuple[bytes | None, LedgerError]] = field(default_factory=list)


class MemLog:
    """Verified entries of known members, per-author contiguous heads (what sync needs)."""

    def __init__(self, members: set[bytes]) -> None:
        self.members = members
        self.by_author: dict[bytes, dict[int, Entry]] = {}
        self.head: dict[bytes, int] = {}

    def heads(self, *, copy: bool = True) -> dict[bytes, int]:
        """author -> contiguous head, as `Ledger.heads` (`copy=False`: the live map, read only)."""
        return dict(self.head) if copy else self.head

    def forks(self) -> dict[bytes, int]:
        """author -> first forked seq, as `Ledger.forks`. A lite log keeps the first entry it
        sees per (author, seq) and records no evidence, so it knows of no fork to prove."""
        return {}

    def entries_after(self, author: bytes, seq: int) -> list[Entry]:
        chain = self.by_author.get(author, {})
        return [chain[s] for s in range(seq + 1, self.head.get(author, 0) + 1)]

    def merge(self, items) -> _Merged:
        out = _Merged()
        for raw in items:
            try:
                e = raw if isinstance(raw, Entry) else Entry.from_bytes(raw)
            except LedgerError as exc:
                out.rejected.append((None, exc))
                continue
            if e.author not in self.members:
                continue
            chain = self.by_author.setdefault(e.author, {})
            if e.seq in chain:
                continue
            chain[e.seq] = e
            h = self.head.get(e.author, 0)
            while h + 1 in chain:
                h += 1
                out.added.append(chain[h].id)
            self.head[e.author] = h
        return out

    def append(self, signer: Signer, kind: str, body: dict) -> Entry:
        me = signer.public_key
        seq = self.head.get(me, 0)
        prev = self.by_author[me][seq].id if seq else b"\0" * 32
        e = Entry.create(signer, seq=seq + 1, prev=prev, lamport=seq + 1, kind=kind, body=body)
        self.merge([e])
        return e


class _Access:
    """The `LedgerAccess` calls `atdnode.replication.sync` makes, answered inline from a `MemLog`."""

    def __init__(self, log: MemLog) -> None:
        self.log = log

    async def run(self, fn: Callable[[MemLog], T]) -> T:
        await trio.lowlevel.checkpoint()
        return fn(self.log)

    async def merge(self, items) -> _Merged:
        await trio.lowlevel.checkpoint()
        return self.log.merge(list(items))


class LitePeer:
    def __init__(self, cluster: "LiteCluster", name: str) -> None:
        self.cluster, self.name = cluster, name
        self.seed = node_seed(cluster.seed, name)
        self.signer = Signer.from_seed(self.seed)
        self.log = MemLog(cluster.members)  # survives kill / restart, like a disk
        self.access = _Access(self.log)
        self.transport: CappedTransport | None = None
        self.announced = 0
        self._checked: dict[bytes, Entry] = {}

    async def run(self, bootstrap: list[str], task_status=trio.TASK_STATUS_IGNORED) -> None:
        c = self.cluster
        t = CappedTransport(c.net, self.seed, name=self.name, max_peers=c.max_peers,
                            mesh=gossip_degrees(PeerSetConfig()))  # the daemon's default mesh
        self.transport = t
        t.set_stream_handler(SYNC_PROTOCOL, lambda s: serve_sync(s, self.access))
        async with t.run([]):
            await t.subscribe(TOPIC, self._on_gossip, self._validate)
            async with trio.open_nursery() as nursery:
                t.on_peer_connected(lambda p: self._spawn(nursery, p))
                await self._dial(bootstrap)
                nursery.start_soon(self._periodic_sync, bootstrap)
                task_status.started()
                await self._announce()
                await trio.sleep_forever()

    async def _spawn(self, nursery: trio.Nursery, peer: str) -> None:
        nursery.start_soon(self._sync, peer)

    def _validate(self, data: bytes, _from: str) -> bool:
        try:
            e = Entry.from_bytes(data)  # decodes and verifies the signature
        except LedgerError:
            return False
        if e.author not in self.cluster.members:
            return False
        self._checked[data] = e  # delivered right after: merge it without verifying twice
        return True

    async def _on_gossip(self, data: bytes, _from: str) -> None:
        self.log.merge([self._checked.pop(data, data)])

    async def _sync(self, peer: str) -> None:
        try:
            with trio.move_on_after(30):
                stream: Stream = await self.transport.open_stream(peer, SYNC_PROTOCOL)
                await pull(stream, self.access)
        except TransportError:
            pass

    async def _dial(self, addrs: list[str]) -> None:
        for addr in addrs:
            try:
                await self.transport.connect(addr)
            except TransportError:
                pass

    async def _periodic_sync(self, bootstrap: list[str]) -> None:
        c = self.cluster
        rng = random.Random(f"{c.seed}|redial|{self.name}")
        while True:
            await trio.sleep(c.sync_interval)
            if len(self.transport.peers()) < max(1, c.max_peers // 2):
                # few links (restarted during a partition, or an island of restarted peers):
                # dial the bootstrap peers again and two live members at random (what a
                # daemon's discovery does from hellos)
                others = [n for n in c.names if n != self.name and c.alive(n)]
                await self._dial(bootstrap + [c.address(n) for n in rng.sample(others, min(2, len(others)))])
            for p in self.transport.peers():
                await self._sync(p)

    async def _announce(self) -> None:
        """Gossip own entries not yet announced (those appended while down, then new ones)."""
        me = self.signer.public_key
        for e in self.log.entries_after(me, self.announced):
            await self.publish(e)

    async def publish(self, e: Entry) -> None:
        try:
            await self.transport.publish(TOPIC, e.to_bytes())
        except TransportError:
            pass
        self.announced = max(self.announced, e.seq)


class LiteCluster:
    """`LitePeer`s for `names` on one simulated network; the calls of `memnet.MemCluster`."""

    def __init__(self, names: list[str], *, seed: int, network: NetworkSpec, sync_interval: float = 5.0,
                 max_peers: int = 8) -> None:
        self.names = list(names)
        self.seed = seed
        self.net = SimNetwork(network, seed=seed)
        self.sync_interval = sync_interval
        self.max_peers = max_peers
        self.members = {Signer.from_seed(node_seed(seed, n)).public_key for n in self.names}
        self.peers_by_name = {n: LitePeer(self, n) for n in self.names}
        self.peer_ids = {n: p.signer.peer_id for n, p in self.peers_by_name.items()}
        self._pid_of = {p.signer.public_key: p.signer.peer_id for p in self.peers_by_name.values()}
        self.status = {n: "not started" for n in self.names}
        self._scopes: dict[str, trio.CancelScope] = {}
        self._done: dict[str, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        for link in network.links:
            self.set_link(link.a, link.b, latency_ms=link.latency_ms, bandwidth_mbps=link.bandwidth_mbps,
                          loss=link.loss)

    def running(self):
        cluster = self

        class _Run:
            async def __aenter__(self) -> "LiteCluster":
                self._cm = trio.open_nursery()
                cluster._nursery = await self._cm.__aenter__()
                return cluster

            async def __aexit__(self, *exc: object):
                cluster._nursery.cancel_scope.cancel()
                return await self._cm.__aexit__(*exc)

        return _Run()

    def alive(self, name: str) -> bool:
        return self.status.get(name) == "running"

    def address(self, name: str) -> str:
        return f"/memory/{name}/p2p/{self.peer_ids[name]}"

    async def start(self, name: str, bootstrap: list[str] = ()) -> None:
        if self.alive(name):
            return
        await self._nursery.start(self._run, name, [self.address(b) for b in bootstrap if b != name])

    async def _run(self, name: str, bootstrap: list[str], task_status=trio.TASK_STATUS_IGNORED) -> None:
        done = self._done[name] = trio.Event()
        try:
            with trio.CancelScope() as scope:
                self._scopes[name] = scope
                self.status[name] = "running"
                await self.peers_by_name[name].run(bootstrap, task_status=task_status)
        finally:
            self._scopes.pop(name, None)
            done.set()

    async def kill(self, name: str) -> None:
        scope = self._scopes.get(name)
        if scope is not None:
            scope.cancel()
            await self._done[name].wait()
        self.status[name] = "killed"

    async def stop(self, name: str, *, status: str = "stopped") -> None:
        await self.kill(name)
        self.status[name] = status

    async def restart(self, name: str, bootstrap: list[str] = ()) -> None:
        await self.kill(name)
        await self.start(name, list(bootstrap))

    def partition(self, groups: list[list[str]]) -> None:
        self.net.partition(*[{self.peer_ids[n] for n in g} for g in groups])

    def heal(self) -> None:
        self.net.heal()

    def set_link(self, a: str, b: str, **kw) -> None:
        from netsim.memnet import link_conditions

        pa, pb = self.peer_ids[a], self.peer_ids[b]
        self.net.set_link(pa, pb, link_conditions(self.net.spec, jitter_u=self.net.jitter(pa, pb), **kw))

    async def append(self, name: str, kind: str, body: dict) -> int:
        p = self.peers_by_name[name]
        e = p.log.append(p.signer, kind, body)
        if self.alive(name):
            await p.publish(e)
        else:
            await trio.lowlevel.checkpoint()
        return e.seq

    async def heads(self, name: str, authors: Collection[str] | None = None) -> dict[str, int]:
        """Author peer id -> contiguous seq (only `authors`' when given, as `MemCluster.heads`)."""
        await trio.lowlevel.checkpoint()
        pid = self._pid_of
        out = {pid.get(a) or peer_id_from_public_key(a): s for a, s in self.peers_by_name[name].log.head.items()}
        return out if authors is None else {p: s for p, s in out.items() if p in authors}

    def peers(self, name: str) -> list[str]:
        t = self.peers_by_name[name].transport
        return t.peers() if t is not None and self.alive(name) else []

    def node_bytes(self, name: str) -> dict[str, int]:
        return self.net.node_stats(self.peer_ids[name])


__all__ = ["LiteCluster", "LitePeer", "MemLog"]
