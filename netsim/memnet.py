"""The in-memory back-end: N real `NodeDaemon`s in one process over one `MemoryNetwork`.

Each node is the daemon the CLI runs — real ledger (SQLite), blob store, sync protocol,
blob protocol, control socket — with a `MemoryTransport` instead of libp2p. The network
simulates per-link latency (with a seeded per-link jitter, so no two paths tie exactly),
bandwidth, gossip loss and partitions (see `atdnode.transport.memory`).

Simulated time. `simulate(fn, seed=...)` runs `fn` under trio's `MockClock` with
`autojump_threshold=0`: whenever every task is waiting, the clock jumps to the next
deadline, so a 60 s gossip scenario takes as long as its work, not 60 s. Inside the
simulation `trio.to_thread.run_sync` runs its function inline on the event loop (the
daemon's SQLite, hashing and disk calls then take zero simulated time and run in a fixed
order), and trio's scheduler shuffle is seeded — together with the seeded keys and link
RNGs this makes a run a pure function of the scenario seed.

Scale (1,000 full daemons in one process). A simulated second costs only the
CPU work the nodes do, so the simulation shares what one process can share without
changing any node's outcome: a signature one node verified is not recomputed for the
next (`shared_signature_checks`: same bytes, same result; failures always recomputed),
a stored entry parsed by one node is not parsed again by the next (`shared_entry_reads`;
both in netsim.memsim_share), each ledger's SQLite page cache is capped (it lives on
/dev/shm: `bound_page_cache`), each daemon's random choices follow the seed (`rng_seed`),
start-up objects are frozen for the GC (`quiet_gc`), the clock's autojump looks up only
the next deadline (`sim_clock`), and gossip arrives on a 1 ms grid (`GOSSIP_TICK_S`), so
nodes wake once per tick for all that is due. `MemCluster(established=True)` starts from
a consortium whose ledgers already hold every node's hello (no N^2 hello flood). Gossip
goes over a GossipSub-style mesh whose degrees follow each node's peer set
(`MemoryTransport(mesh=...)`, `atdnode.peers.peerset.gossip_degrees`), as on libp2p. Nodes
are full daemons; `netsim.litenode` has gossip-only peers for when a scenario asks for
them (`topology.peers = "lite"`; reports say which). Measured in bench/memsim_bench.py.
"""
from __future__ import annotations

import gc
import hashlib
import logging
import math
import random
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Awaitable, Callable, Collection, Iterator, TypeVar

import trio
import trio.testing

from atdnode import bodies
from atdnode.node import NodeConfig, NodeDaemon
from atdnode.peers import PeerSetConfig, gossip_degrees
from atdnode.replication import NodeStopping
from atdnode.transport import LinkConditions, MemoryNetwork, MemoryTransport, TransportError
from ledger import Ledger, Signer, peer_id_from_public_key, public_key_from_peer_id
from netsim.homes import Consortium, make_consortium
from netsim.memsim_share import shared_entry_reads, shared_signature_checks
from netsim.scenario import NetworkSpec

log = logging.getLogger("netsim.memnet")
T = TypeVar("T")


# ------------------------------------------------------------------ simulated time

@contextmanager
def inline_threads() -> Iterator[None]:
    """Make `trio.to_thread.run_sync` call its function inline (simulation only)."""
    original = trio.to_thread.run_sync

    async def run_inline(fn: Callable[..., T], *args: Any, **_kw: Any) -> T:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    trio.to_thread.run_sync = run_inline  # type: ignore[assignment]
    try:
        yield
    finally:
        trio.to_thread.run_sync = original  # type: ignore[assignment]


@contextmanager
def deterministic_scheduling(seed: int) -> Iterator[None]:
    """Make trio run each batch of runnable tasks in an order fixed by the seed.

    trio normally flips a coin per batch, and tasks woken by equal deadlines (every
    daemon's 1 s fetch loop) enter a batch in memory-address order. trio's own switch for
    reproducible runs (`_ALLOW_DETERMINISTIC_SCHEDULING`, used under Hypothesis) sorts
    each batch by task creation order, then shuffles it with its seeded RNG. Private API,
    best effort: without it a run is still correct, only its byte counts may vary a little.
    """
    run_mod = getattr(trio._core, "_run", None)
    r = getattr(run_mod, "_r", None)
    old = getattr(run_mod, "_ALLOW_DETERMINISTIC_SCHEDULING", None)
    state = r.getstate() if isinstance(r, random.Random) else None
    if isinstance(r, random.Random):
        r.seed(seed)
        if old is not None:
            run_mod._ALLOW_DETERMINISTIC_SCHEDULING = True
    try:
        yield
    finally:
        if state is not None:
            r.setstate(state)
            if old is not None:
                run_mod._ALLOW_DETERMINISTIC_SCHEDULING = old


@contextmanager
def quiet_gc(gen0: int = 50_000) -> Iterator[None]:
    """Freeze what exists before the run and collect young objects less often.

    A thousand daemons in one process hold millions of objects; with CPython's default
    thresholds every 100th collection walks all of them. Frozen objects are never walked;
    cycles made during the run are still collected. Restored afterwards."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(gen0, old[0]), old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def sim_clock() -> trio.testing.MockClock:
    """trio's `MockClock` (autojump) whose jumps look up only the next deadline.

    `MockClock` asks for the full run statistics on every jump, and those count every
    file descriptor the run waits on -- with 1,000 daemons (each with its control socket)
    that count dominated the simulation. Same jumps, without the count (private trio API,
    best effort: MockClock's own autojump is kept when it is not there)."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    own = clock._autojump

    def autojump() -> None:
        try:
            runner = trio._core._run.GLOBAL_RUN_CONTEXT.runner
            jump = runner.deadlines.next_deadline() - clock.current_time()
        except AttributeError:
            return own()
        if 0 < jump < math.inf:
            clock.jump(jump)

    clock._autojump = autojump
    return clock


def simulate(fn: Callable[[], Awaitable[T]], *, seed: int = 0) -> T:
    """Run `fn()` in a fresh trio run on simulated time (see the module doc)."""
    clock = sim_clock()
    with inline_threads(), deterministic_scheduling(seed), shared_signature_checks(), shared_entry_reads(), quiet_gc():
        return trio.run(fn, clock=clock)


# ------------------------------------------------------------------ the network

def link_conditions(net: NetworkSpec, *, latency_ms: float | None = None, bandwidth_mbps: float | None = None,
                    loss: float | None = None, jitter_u: float = 0.0) -> LinkConditions:
    lat = net.latency_ms if latency_ms is None else latency_ms
    bw = net.bandwidth_mbps if bandwidth_mbps is None else bandwidth_mbps
    return LinkConditions(latency_s=lat / 1000.0 * (1.0 + net.jitter * jitter_u),
                          bandwidth_Bps=bw * 1e6 / 8 if bw else None,
                          loss=net.loss if loss is None else loss)


GOSSIP_TICK_S = 0.001  # gossip delivery times are rounded up to this grid (see MemoryNetwork)


class SimNetwork(MemoryNetwork):
    """A `MemoryNetwork` whose links get the scenario's conditions, with a seeded
    latency jitter per node pair (the same both ways) applied when a link is first used."""

    def __init__(self, spec: NetworkSpec, *, seed: int) -> None:
        super().__init__(seed=seed, default=link_conditions(spec))
        self.gossip_tick_s = GOSSIP_TICK_S
        self.spec = spec

    def jitter(self, a: str, b: str) -> float:
        lo, hi = sorted((a, b))
        d = hashlib.sha256(f"{self.seed}|jitter|{lo}|{hi}".encode()).digest()
        return int.from_bytes(d[:8], "big") / 2**64 * 2 - 1  # in [-1, 1)

    def new_link(self, src: str, dst: str):
        lk = super().new_link(src, dst)
        if lk.cond.up and lk.cond == self.default:
            lk.cond = link_conditions(self.spec, jitter_u=self.jitter(src, dst))
        return lk


SIM_PAGE_CACHE_KIB = 128  # SQLite page cache per simulated ledger (see bound_page_cache)


def bound_page_cache(daemon: NodeDaemon, kib: int) -> None:
    """Cap the SQLite page cache of a simulated node's ledger connection at `kib` KiB.

    A real daemon keeps SQLite's default (up to 2 MiB) for a database on disk. A simulated
    node's database lives on /dev/shm, i.e. already in RAM, so a page-cache miss is a memory
    copy, not a disk read; with the default, 1,000 nodes' caches filled with the pages of
    1,000-entry ledgers and made memory per node grow with N."""
    store = getattr(daemon.ledger.ledger, "_store", None)
    if store is not None:
        store.conn.execute(f"PRAGMA cache_size=-{int(kib)}")


class CappedTransport(MemoryTransport):
    """A `MemoryTransport` that stops dialing once it has `max_peers` connections — the
    connection manager a real deployment needs (the daemon's discovery would otherwise
    dial every member it hears of, a full mesh: N^2 links and N^2 gossip copies).
    Inbound connections are still accepted, so degrees stay around 2 x max_peers at most."""

    def __init__(self, network: MemoryNetwork, seed: bytes, *, name: str, max_peers: int,
                 mesh: tuple[int, int, int] | None = None) -> None:
        super().__init__(network, seed, name=name, mesh=mesh)
        self.max_peers = max_peers

    async def connect(self, addr: str) -> str:
        peer = addr.rsplit("/p2p/", 1)[-1]
        if peer not in self.peers() and len(self.peers()) >= self.max_peers:
            await trio.lowlevel.checkpoint()
            raise TransportError(f"connection limit ({self.max_peers}) reached")
        return await super().connect(addr)


# ------------------------------------------------------------------ the cluster

class MemCluster:
    """Real daemons for `names` on one simulated network. Use inside `simulate()`:

        cluster = MemCluster(root, names, seed=1, network=spec)
        async with cluster.running():
            await cluster.start("n0"); await cluster.start("n1", bootstrap=["n0"]) ...

    Node operations mirror what an operator (or a crash) does to a real node: `kill`
    (the process dies: no clean shutdown), `stop` (SIGTERM), `restart`, plus network
    faults (`partition`, `heal`, `set_link`). `append` writes a ledger entry the way a CLI
    command does; the daemon gossips it.
    """

    def __init__(self, root: Path, names: list[str], *, seed: int, network: NetworkSpec,
                 sync_interval: float = 5.0, poll_interval: float = 0.1, max_peers: int = 8,
                 auto_fetch: bool = True, roles: dict[str, str] | None = None,
                 consortium: Consortium | None = None, established: bool = False) -> None:
        self.names = list(names)
        self.seed = seed
        self.net = SimNetwork(network, seed=seed)
        self.c = consortium or make_consortium(root, self.names, seed=seed, roles=roles,
                                                   established=established)
        self._pid_of = {Signer.from_seed(k).public_key: self.c.peer_ids[n] for n, k in self.c.seeds.items()}
        self._key_of = {p: k for k, p in self._pid_of.items()}
        self.sync_interval = sync_interval
        self.poll_interval = poll_interval
        self.max_peers = max_peers
        self.auto_fetch = auto_fetch
        self.daemons: dict[str, NodeDaemon] = {}
        self._runs: dict[str, int] = {}  # starts of each node (its daemon's rng_seed)
        self._scopes: dict[str, trio.CancelScope] = {}
        self._done: dict[str, trio.Event] = {}
        self.status: dict[str, str] = {n: "not started" for n in self.names}
        self.errors: dict[str, str] = {}
        self._nursery: trio.Nursery | None = None
        self.addrs: dict[str, str] = {}
        self._polled: dict[str, tuple] = {}  # name -> (ledger, its local_writes, authors, heads): see heads()
        for link in network.links:  # the scenario's per-link conditions
            self.set_link(link.a, link.b, latency_ms=link.latency_ms, bandwidth_mbps=link.bandwidth_mbps,
                          loss=link.loss)

    # -- lifecycle --------------------------------------------------------------------

    @property
    def peer_ids(self) -> dict[str, str]:
        return self.c.peer_ids

    def running(self):
        cluster = self

        class _Run:
            async def __aenter__(self) -> "MemCluster":
                self._cm = trio.open_nursery()
                cluster._nursery = await self._cm.__aenter__()
                return cluster

            async def __aexit__(self, *exc: object) -> bool | None:
                for n in list(cluster._scopes):
                    cluster._scopes[n].cancel()
                cluster._nursery.cancel_scope.cancel()
                try:
                    return await self._cm.__aexit__(*exc)
                finally:
                    cluster._close_all()

        return _Run()

    def alive(self, name: str) -> bool:
        """Running, and not yet past the step that closes its ledger (a kill marks the status
        only once that step is done; a read in between would meet a closed database)."""
        return self.status.get(name) == "running" and name in self._scopes

    def address(self, name: str) -> str:
        return f"/memory/{name}/p2p/{self.c.peer_ids[name]}"

    async def start(self, name: str, bootstrap: list[str] = ()) -> None:
        """Start `name`'s daemon, dialing the named peers; returns once it is ready."""
        if self._nursery is None:
            raise RuntimeError("use `async with cluster.running():`")
        if self.alive(name):
            return
        addrs = [self.address(b) for b in bootstrap if b != name]
        await self._nursery.start(self._run_node, name, addrs)

    async def _run_node(self, name: str, bootstrap: list[str], task_status=trio.TASK_STATUS_IGNORED) -> None:
        home = self.c.homes[name]  # the gossip mesh follows the node's peer set, as on libp2p
        mesh = gossip_degrees(PeerSetConfig.from_table(NodeConfig.load(home).extra.get("peers")))
        transport = CappedTransport(self.net, self.c.seeds[name], name=name, max_peers=self.max_peers, mesh=mesh)
        runs = self._runs[name] = self._runs.get(name, 0) + 1  # each run of a node its own choices
        daemon = NodeDaemon(self.c.homes[name], transport=transport, sync_interval=self.sync_interval,
                            poll_interval=self.poll_interval, auto_fetch=self.auto_fetch,
                            rng_seed=f"{self.seed}|{name}|{runs}")
        bound_page_cache(daemon, SIM_PAGE_CACHE_KIB)
        done = trio.Event()
        self._done[name] = done
        self.daemons[name] = daemon
        try:
            with trio.CancelScope() as scope:
                self._scopes[name] = scope
                self.status[name] = "running"
                await daemon.run([], bootstrap, task_status=task_status)
            if not scope.cancelled_caught:
                self.status[name] = "stopped"
        except Exception as exc:  # a crashing node is an outcome, not a harness failure
            self.status[name] = "crashed"
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            log.exception("node %s crashed", name)
        finally:
            self._scopes.pop(name, None)
            self._close_ledger(daemon)
            done.set()

    @staticmethod
    def _close_ledger(daemon: NodeDaemon) -> None:
        try:
            daemon.ledger.ledger.close()
        except Exception:  # already closed by a clean stop
            pass

    def _close_all(self) -> None:
        for d in self.daemons.values():
            self._close_ledger(d)

    async def kill(self, name: str) -> None:
        """The node dies at once (no clean shutdown): its connections drop, its disk stays."""
        scope = self._scopes.get(name)
        if scope is not None:
            scope.cancel()
            await self._done[name].wait()
        self.status[name] = "killed"

    async def stop(self, name: str, *, status: str = "stopped") -> None:
        """Clean shutdown (what SIGTERM does)."""
        if self.alive(name):
            self.daemons[name].stop()
            await self._done[name].wait()
        self.status[name] = status

    async def restart(self, name: str, bootstrap: list[str] = ()) -> None:
        if self.alive(name):
            await self.kill(name)
        await self.start(name, list(bootstrap))

    # -- network faults ----------------------------------------------------------------

    def partition(self, groups: list[list[str]]) -> None:
        self.net.partition(*[{self.c.peer_ids[n] for n in g} for g in groups])

    def heal(self) -> None:
        self.net.heal()

    def set_link(self, a: str, b: str, *, latency_ms: float | None = None, bandwidth_mbps: float | None = None,
                 loss: float | None = None) -> None:
        pa, pb = self.c.peer_ids[a], self.c.peer_ids[b]
        cond = link_conditions(self.net.spec, latency_ms=latency_ms, bandwidth_mbps=bandwidth_mbps, loss=loss,
                               jitter_u=self.net.jitter(pa, pb))
        self.net.set_link(pa, pb, cond)

    # -- ledger ------------------------------------------------------------------------

    def _ledger_call(self, name: str, fn: Callable[[Ledger], T]) -> T:
        if self.alive(name):
            return fn(self.daemons[name].ledger.ledger)
        with Ledger.open(self.c.homes[name].ledger_db) as led:  # what a CLI command does
            return fn(led)

    async def append(self, name: str, kind: str, body: dict) -> int:
        """Append a signed entry to `name`'s ledger; returns its seq. A running node signs
        and gossips it at once (`NodeDaemon.append`); a node that is down gets it the way a
        CLI command writes it (straight into its ledger) and gossips it when it starts. A node
        killed or stopped while the append waits on its ledger closes it before the entry
        commits (SQLite rolls the open transaction back): the entry is then written as to a
        down node."""
        if self.alive(name) and self.daemons[name].head_confirmed:
            daemon, done = self.daemons[name], self._done[name]
            try:
                return (await daemon.append(kind, body)).seq
            except (sqlite3.ProgrammingError, NodeStopping):
                # a kill closes the raw ledger under a call in flight ("Cannot operate on a
                # closed database") in the same step that sets `done`; a clean stop closes it
                # through its access (`closed`), which then refuses every call (NodeStopping)
                if not (done.is_set() or daemon.ledger.closed):
                    raise
                await done.wait()
        signer = Signer.from_seed(self.c.seeds[name])
        await trio.lowlevel.checkpoint()
        return self._ledger_call(name, lambda led: bodies.append(led, signer, kind, body)).seq

    async def heads(self, name: str, authors: Collection[str] | None = None) -> dict[str, int]:
        """Author peer id -> highest contiguous seq in `name`'s ledger; with `authors` (peer
        ids), only theirs (`Ledger.heads_of`: the convergence poll asks for the publishers'
        heads of every node: with 1,000 nodes mapping every author of every node, then
        reading every head of a ledger that changed since the last poll, was most of a run's
        CPU).

        A running node's answer is kept and given again while its ledger has not been
        written since (`Ledger.local_writes`: every writer of a simulated ledger -- its
        daemon, a CLI command the cluster runs for it -- lives in this process), so a poll
        re-reads only the ledgers that changed, and a change is never missed."""
        await trio.lowlevel.checkpoint()
        if authors is not None:
            led = self.daemons[name].ledger.ledger if self.alive(name) else None
            stamp = led.local_writes() if led is not None else None
            kept = self._polled.get(name)
            if led is not None and kept is not None and kept[0] is led and kept[1] == stamp and kept[2].issuperset(authors):
                held = kept[3]
                return {p: held[p] for p in authors if p in held}
            key_of = self._key_of
            keys = [(p, key_of.get(p) or public_key_from_peer_id(p)) for p in authors]
            h = self._ledger_call(name, lambda led: led.heads_of(k for _, k in keys))
            out = {p: h[k] for p, k in keys if k in h}
            if led is not None:
                self._polled[name] = (led, stamp, frozenset(authors), out)
            return out
        pid = self._pid_of
        return {pid.get(a) or peer_id_from_public_key(a): s
                for a, s in self._ledger_call(name, lambda led: led.heads()).items()}

    def peers(self, name: str) -> list[str]:
        d = self.daemons.get(name)
        return d.transport.peers() if d is not None and self.alive(name) else []

    def entry_ids(self, name: str) -> set[bytes]:
        return self._ledger_call(name, lambda led: {e.id for e in led.all_entries()})

    async def fetch(self, name: str, blob: str, manifest: str, sources: list[str], timeout: float) -> str:
        """Fetch `blob` into `name`'s store over the blob protocol from the live `sources`
        (e.g. its publisher; any connected holder when none is up): "ok", "held" or why not."""
        d = self.daemons.get(name)
        if d is None or not self.alive(name):
            return "node is down"
        if d.store.has(blob):
            return "held"
        peers = [self.c.peer_ids[s] for s in sources if s != name and self.alive(s)] or d.transport.peers()
        if not peers:
            return "no peer to fetch from"
        try:
            with trio.fail_after(timeout):
                await d.blobs.fetch(blob, peers, manifest_hash=manifest)
        except trio.TooSlowError:
            return f"timeout after {timeout:g} s"
        except Exception as exc:  # BlobError, TransportError, ...: the outcome names it
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    # -- counters ----------------------------------------------------------------------

    def link_bytes(self, name: str) -> dict[str, int]:
        """Bytes the node put on / took off its links (gossip + streams), over the whole run."""
        return self.net.node_stats(self.c.peer_ids[name])

    def node_bytes(self, name: str) -> dict[str, int]:
        return self.link_bytes(name)
