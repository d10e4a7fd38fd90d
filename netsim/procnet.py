"""The process back-end: real `atd node start` daemons as OS processes.

Each node is its own process (py-libp2p, Noise + yamux, GossipSub) listening on
127.0.0.1 — or, where the machine allows it and the scenario asks for it
(`[network] namespaces = "auto"`), inside its own network namespace behind a veth pair
on a private bridge, with `tc netem` shaping latency / rate / loss (see `netns.py`).
Where namespaces are not available, the report says so and the run goes on without them.

The driver talks to each daemon the way the CLI does: homes made in-process
(`homes.make_consortium`), daemons started and stopped as `atd local` and the tests do
(`atdnode.node.DaemonProcess`), entries appended to the node's ledger file (the daemon
gossips them), state read over the control socket (`atd node status`), blobs fetched
through the control socket (`atd fetch`). Readiness is a signal — the daemon announces
itself in HOME/daemon.json once it listens — and every wait has a deadline.

Faults: kill = SIGKILL, leave = SIGTERM for good, restart = start again on the same home.
Partitions and slow links need namespaces; without them they are `FaultUnsupported`.
"""
from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from typing import Awaitable, Callable, Collection, TypeVar

import trio

from atdnode import bodies
from atdnode.node import DaemonProcess, control
from atdnode.blobs import BlobStore
from atdnode.errors import DaemonError
from ledger import Ledger, Signer, peer_id_from_public_key
from netsim.faults import FaultUnsupported
from netsim.homes import make_consortium
from netsim.scenario import NetworkSpec

T = TypeVar("T")
READY_TIMEOUT = 90.0
STOP_TIMEOUT = 30.0


def run_trio(fn: Callable[[], Awaitable[T]]) -> T:
    """Run on the real clock (the process back-end's time is wall time)."""
    return trio.run(fn)


class _Node:
    def __init__(self) -> None:
        self.proc: DaemonProcess | None = None
        self.addr: str | None = None
        self.bytes_done = {"sent": 0, "received": 0}  # counters of earlier incarnations
        self.blob_bytes = {"sent": 0, "received": 0}  # payload of blobs fetched via `fetch`
        self.bytes_now = {"sent": 0, "received": 0}


class ProcCluster:
    """Daemons for `names` as OS processes; the calls of `memnet.MemCluster`."""

    def __init__(self, root: Path, names: list[str], *, seed: int, network: NetworkSpec,
                 sync_interval: float = 5.0, auto_fetch: bool = True, roles: dict[str, str] | None = None,
                 ready_timeout: float = READY_TIMEOUT) -> None:
        self.root = Path(root)
        self.names = list(names)
        self.seed = seed
        self.spec = network
        self.sync_interval = sync_interval
        self.auto_fetch = auto_fetch
        self.ready_timeout = ready_timeout  # a loaded machine starts a daemon slowly (imports)
        self.c = make_consortium(self.root / "homes", self.names, seed=seed, roles=roles)
        self.status = {n: "not started" for n in self.names}
        self.nodes = {n: _Node() for n in self.names}
        self.notes: list[str] = []
        self._ledgers: dict[str, Ledger] = {}  # the driver's own handle on each node's ledger file
        self._ledgers_lock = threading.Lock()
        self._pid_of = {Signer.from_seed(k).public_key: self.c.peer_ids[n] for n, k in self.c.seeds.items()}
        self._waiters: trio.CapacityLimiter | None = None  # worker threads that wait on daemons
        self.netns = None
        if network.namespaces == "auto":
            from netsim.netns import NetnsLab, netns_available

            ok, why = netns_available()
            if ok:
                self.netns = NetnsLab(self.names, seed=seed, network=network)
                self.notes.append(f"network namespaces + tc netem in use ({self.netns.describe()})")
            else:
                self.notes.append(f"network namespaces not available here ({why}); daemons run on 127.0.0.1 "
                                  "without latency / bandwidth / loss shaping, and partitions / slow links "
                                  "are reported as unsupported")
        else:
            self.notes.append("daemons run on 127.0.0.1 (no namespaces); link conditions are not simulated")

    @property
    def peer_ids(self) -> dict[str, str]:
        return self.c.peer_ids

    def running(self):
        cluster = self

        class _Run:
            async def __aenter__(self) -> "ProcCluster":
                if cluster.netns is not None:
                    await trio.to_thread.run_sync(cluster.netns.setup)
                    for link in cluster.spec.links:
                        cluster.set_link(link.a, link.b, latency_ms=link.latency_ms,
                                         bandwidth_mbps=link.bandwidth_mbps, loss=link.loss)
                elif cluster.spec.links:
                    cluster.notes.append("[[network.links]] conditions need namespaces; not applied")
                return cluster

            async def __aexit__(self, *exc: object) -> None:
                with trio.CancelScope(shield=True):
                    async with trio.open_nursery() as nursery:  # all at once: 100 daemons stop in seconds
                        for n in cluster.names:
                            if cluster.alive(n):
                                nursery.start_soon(partial(cluster.stop, n, status="running at the end"))
                    if cluster.netns is not None:
                        await trio.to_thread.run_sync(cluster.netns.teardown)
                    for led in cluster._ledgers.values():
                        led.close()
                    cluster._ledgers.clear()

        return _Run()

    # -- lifecycle --------------------------------------------------------------------

    def alive(self, name: str) -> bool:
        p = self.nodes[name].proc
        if self.status.get(name) == "running" and p is not None and p.returncode is not None:
            self.status[name] = f"crashed (exit {p.returncode})"  # died on its own: the report says so
            self.notes.append(f"{name}: daemon exited with {p.returncode} (see its netsim-daemon.log)")
        return self.status.get(name) == "running" and p is not None and p.returncode is None

    def _listen(self, name: str) -> str:
        ip = self.netns.ip(name) if self.netns is not None else "127.0.0.1"
        return f"/ip4/{ip}/tcp/0"

    async def _in_thread(self, fn, *args):
        """`fn(*args)` (a blocking wait on a daemon) in a worker thread: one per daemon, so
        100 daemons starting or stopping at once do not queue behind trio's default 40."""
        if self._waiters is None:
            self._waiters = trio.CapacityLimiter(max(1, len(self.names)))
        return await trio.to_thread.run_sync(partial(fn, *args), limiter=self._waiters, abandon_on_cancel=True)

    async def start(self, name: str, bootstrap: list[str] = ()) -> None:
        """Start `name`'s daemon; returns once it announced itself (deadline)."""
        if self.alive(name):
            return
        node = self.nodes[name]
        home = self.c.homes[name]
        args = ["--listen", self._listen(name), "--sync-interval", str(self.sync_interval)]
        if not self.auto_fetch:
            args.append("--no-auto-fetch")
        for b in bootstrap:
            if self.nodes[b].addr:
                args += ["--bootstrap", self.nodes[b].addr]
        wrap = self.netns.wrap(name, []) if self.netns is not None else ()
        node.proc = await self._in_thread(partial(DaemonProcess.start, home, *args, out=home.root / "netsim-daemon.log",
                                                  wrap=wrap, one_thread=True))
        try:
            addrs = await self._in_thread(node.proc.wait_ready, self.ready_timeout)
        except DaemonError:
            await self._in_thread(node.proc.kill)
            self.status[name] = "failed to start"
            raise
        node.addr = addrs[0]
        node.bytes_now = {"sent": 0, "received": 0}
        self.status[name] = "running"

    def _retire(self, name: str) -> None:
        node = self.nodes[name]
        for k in ("sent", "received"):
            node.bytes_done[k] += node.bytes_now[k]
        node.bytes_now = {"sent": 0, "received": 0}

    async def kill(self, name: str) -> None:
        """SIGKILL: the process dies at once."""
        await self._refresh_bytes(name)
        d = self.nodes[name].proc
        if d is not None:
            await self._in_thread(d.kill)
        self._retire(name)
        self.status[name] = "killed"

    async def stop(self, name: str, *, status: str = "stopped") -> None:
        """SIGTERM and wait for the clean shutdown (SIGKILL after 30 s)."""
        await self._refresh_bytes(name)
        d = self.nodes[name].proc
        if d is not None and await self._in_thread(d.stop, STOP_TIMEOUT) == "killed":
            self.notes.append(f"{name} ignored SIGTERM for {STOP_TIMEOUT:g} s and was killed")
        self._retire(name)
        self.status[name] = status

    async def restart(self, name: str, bootstrap: list[str] = ()) -> None:
        if self.alive(name):
            await self.kill(name)
        await self.start(name, list(bootstrap))

    # -- network faults ----------------------------------------------------------------

    def _need_netns(self, what: str):
        if self.netns is None:
            raise FaultUnsupported(f"{what} needs network namespaces, not available for this run "
                                   "(root + `ip netns` + `tc` and [network] namespaces = \"auto\")")
        return self.netns

    def partition(self, groups: list[list[str]]) -> None:
        self._need_netns("a partition").partition(groups)

    def heal(self) -> None:
        self._need_netns("heal").heal()

    def set_link(self, a: str, b: str, *, latency_ms: float | None = None, bandwidth_mbps: float | None = None,
                 loss: float | None = None) -> None:
        self._need_netns("a slow link").set_link(a, b, latency_ms=latency_ms, bandwidth_mbps=bandwidth_mbps,
                                                 loss=loss)

    # -- ledger and daemon state ---------------------------------------------------------

    async def _status(self, name: str) -> dict | None:
        if not self.alive(name):
            return None
        sock = self.c.homes[name].control_socket
        try:
            return await trio.to_thread.run_sync(lambda: control.call(sock, "status", timeout=30))
        except DaemonError:
            return None

    async def _refresh_bytes(self, name: str) -> None:
        st = await self._status(name)
        if st is not None:
            self.nodes[name].bytes_now = {k: int(st["bytes"].get(k, 0)) for k in ("sent", "received")}

    def _ledger(self, name: str) -> Ledger:
        """The driver's own handle on `name`'s ledger file, opened once (opening costs ~4x an
        append); SQLite's WAL lets the daemon write the same file meanwhile."""
        with self._ledgers_lock:  # called from worker threads
            led = self._ledgers.get(name)
            if led is None:
                led = self._ledgers[name] = Ledger.open(self.c.homes[name].ledger_db)
            return led

    async def append(self, name: str, kind: str, body: dict) -> int:
        """Append to the node's ledger file, as a CLI command does; the daemon gossips it."""
        signer = Signer.from_seed(self.c.seeds[name])
        return await trio.to_thread.run_sync(lambda: bodies.append(self._ledger(name), signer, kind, body).seq)

    async def heads(self, name: str, authors: Collection[str] | None = None) -> dict[str, int]:
        """Author peer id -> contiguous seq, read from the node's ledger file (what the daemon
        committed), as `atd ledger` would: no control call, so polling every node costs the
        daemons nothing (a `status` call per node per poll was a load of its own with 30+
        daemons sharing two cores)."""
        pid = self._pid_of

        def read() -> dict[str, int]:
            out = {pid.get(a) or peer_id_from_public_key(a): s for a, s in self._ledger(name).heads().items()}
            return out if authors is None else {p: s for p, s in out.items() if p in authors}

        return await trio.to_thread.run_sync(read)

    def peers(self, name: str) -> list[str]:
        """Connected peers (blocking control call: for use between steps)."""
        if not self.alive(name):
            return []
        try:
            return control.call(self.c.homes[name].control_socket, "peers", timeout=10)["peers"]
        except DaemonError:
            return []

    async def apeers(self, name: str) -> list[str]:
        if not self.alive(name):
            return []
        sock = self.c.homes[name].control_socket
        try:
            return (await trio.to_thread.run_sync(lambda: control.call(sock, "peers", timeout=10)))["peers"]
        except DaemonError:
            return []

    async def fetch(self, name: str, blob: str, manifest: str, sources: list[str], timeout: float) -> str:
        """`atd fetch`: ask the node's daemon to fetch `blob` from its peers."""
        if not self.alive(name):
            return "node is down"
        sock = self.c.homes[name].control_socket
        store = BlobStore(self.c.homes[name].blobs_dir)
        end = trio.current_time() + timeout
        while True:  # the daemon's own fetch loop may be fetching the same blob: retry until held
            left = end - trio.current_time()
            try:
                rep = await trio.to_thread.run_sync(lambda: control.call(sock, "fetch", blob=blob, timeout_s=left,
                                                                         timeout=left + 30))
                break
            except DaemonError as exc:
                if store.has(blob):
                    rep = {"size": store.size(blob)}
                    break
                if trio.current_time() + 0.5 >= end or not self.alive(name):
                    return f"fetch failed: {exc}"
                await trio.sleep(0.5)
        if self.netns is None and sources:  # the bulk channel is outside the transport's counters
            size = int(rep.get("size", 0))
            self.nodes[name].blob_bytes["received"] += size
            self.nodes[sources[0]].blob_bytes["sent"] += size
        return "ok"

    def node_bytes(self, name: str) -> dict[str, int]:
        """Application bytes (gossip + libp2p stream frames) the node's daemon counted, over
        all its incarnations; with namespaces, the node's interface counters instead."""
        if self.netns is not None:
            return self.netns.counters(name)
        n = self.nodes[name]
        return {k: n.bytes_done[k] + n.bytes_now[k] + n.blob_bytes[k] for k in ("sent", "received")}

    link_bytes = node_bytes

    async def refresh_all(self) -> None:
        for n in self.names:
            await self._refresh_bytes(n)


def run_vgs_process(scn, data, work: Path, *, progress=lambda _m: None,
                    base_files: dict | None = None) -> tuple[list, list[dict], list[str]]:
    """VGS-ATD with every node a real daemon process; the protocol steps run in this
    process against the node homes (the library calls behind the CLI commands), the bytes
    move between the daemons. Returns (phase results, fault outcomes, notes)."""
    from netsim.vgs import VgsRunner

    t = scn.topology
    cluster = ProcCluster(work / "procs", list(data.nodes), seed=scn.seed, network=scn.network,
                          sync_interval=t.sync_interval_s, auto_fetch=False, roles=scn.node_roles())
    runner = VgsRunner(scn, data, cluster, work, log=progress, real_clock=True, base_files=base_files)
    phases = run_trio(runner.run)
    notes = cluster.notes + ["process back-end: bytes are what each daemon's transport counted (gossip and "
                             "libp2p stream frames) plus the payload of each blob a node fetched, counted as "
                             "received by it and sent by its publisher (the daemons' bulk TCP channel is "
                             "outside the transport's counters)" if cluster.netns is None else
                             "process back-end: bytes are each node's interface counters (wire bytes)"]
    return phases, runner.fault_log, notes
