"""A local consortium of N nodes on this machine (`atd local up|status|down`).

Layout::

    DIR/
      local.json        the consortium: node names, genesis id, listen host
      node1/ ... nodeN  ordinary node homes (node1 founded the consortium)
        daemon.pid      pid of the detached `atd node start` process (written here)
        logs/daemon.log the daemon's rotating log; logs/daemon.out its stdout/stderr

`up` makes the homes with the library calls behind `atd init` and `atd member add`
(`found_consortium`), then starts each daemon as a detached OS process
(`DaemonProcess.start`: `atd node start --quiet`, its own session, so it outlives the command) listening on
127.0.0.1, all at once; once they answer, each new one is told to connect to the founder
(the founder, when it alone restarted, to the running members) over its control socket. It returns only when
every daemon has announced itself (HOME/daemon.json with its pid), answers on its control
socket and is connected to every other one — readiness read from the daemons, never a
sleep — or raises LocalNetError with a deadline message naming the node and its log. A
daemon counts as exited at start only by its exit status (the wait status of the child
`up` started), reported with what that start wrote to logs/daemon.out. Running `up` again
on the same DIR restarts the daemons that are not running and keeps the homes.

`down` stops each daemon (`DaemonProcess.stop`: SIGTERM, SIGKILL after a deadline); it
also cleans up after a crash (a pidfile whose process is gone, a stale socket). A pid is
only signalled when that process is an `atd node start` for this very home, so a recycled
pid is never hit.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from atdnode.errors import AtdError, DaemonError
from atdnode.node import control
from atdnode.node.daemon_proc import PIDFILE, STOP_TIMEOUT, DaemonProcess, clear_stale
from atdnode.node.home import NodeHome

MANIFEST = "local.json"
READY_TIMEOUT = 120.0


class LocalNetError(AtdError):
    """A local consortium could not be made, started, found or stopped."""


@dataclass
class NodeState:
    name: str
    home: Path
    peer_id: str
    founder: bool
    pid: int | None
    running: bool
    addrs: list[str]
    peers: list[str]
    dashboard: str | None = None  # URL, when the daemon serves one

    def to_json(self) -> dict:
        return {"name": self.name, "home": str(self.home), "peer_id": self.peer_id, "founder": self.founder,
                "pid": self.pid, "running": self.running, "addrs": self.addrs, "peers": self.peers,
                "dashboard": self.dashboard}


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise LocalNetError(f"no local consortium in {root} (run `atd local up --dir {root}` first)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise LocalNetError(f"{path} is unreadable: {exc}") from None
    if not isinstance(m, dict) or not isinstance(m.get("nodes"), list) or not m["nodes"]:
        raise LocalNetError(f"{path} names no nodes")
    return m


def homes(root: Path) -> list[NodeHome]:
    return [NodeHome.at(Path(root) / n) for n in read_manifest(root)["nodes"]]


def create(root: Path, n: int, *, consortium: str = "local") -> list[NodeHome]:
    """Make N node homes under `root`: node1 founds `consortium`, the others join and are admitted.

    The joiners' ledgers get the founder's genesis and admissions merged (what their first
    sync would pull), so they know who may talk to them before their daemons start.
    """
    from atdnode.node.identity import NodeIdentity, found_consortium

    if n < 1:
        raise LocalNetError("a local consortium needs at least one node (-n 1 or more)")
    root = Path(root).expanduser().resolve()
    if (root / MANIFEST).exists():
        raise LocalNetError(f"{root} already holds a local consortium")
    names = [f"node{i}" for i in range(1, n + 1)]
    for name in names:
        if NodeHome.at(root / name).is_initialised():
            raise LocalNetError(f"{root / name} already holds an atd node; choose an empty --dir")
    root.mkdir(parents=True, exist_ok=True)
    hs = [NodeHome.at(root / name) for name in names]
    genesis = found_consortium(hs, consortium, name_admissions=True, share_ledger=True)
    manifest = {"nodes": names, "genesis": genesis.id.hex(), "consortium": consortium,
                "founder": NodeIdentity.load(hs[0]).peer_id, "created": time.time()}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(root / MANIFEST)
    return hs


# ---------------------------------------------------------------- processes


def _wait(cond, deadline: float, what: str, interval: float = 0.2):
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise LocalNetError(f"timed out waiting for {what}")
        time.sleep(interval)


def _wait_all_ready(daemons: dict[str, DaemonProcess], deadline: float) -> dict[str, dict]:
    """Every daemon's status once all are ready (they start side by side: a daemon's start is
    mostly importing py-libp2p, ~3 s of one core, so N starts overlap instead of queueing).
    Ready: the daemon announced itself (`DaemonProcess.ready`) and answers `status` with its
    addresses; one that exited raises LocalNetError with its exit status and last line."""
    ready: dict[str, dict] = {}

    def all_ready():
        for name, d in daemons.items():
            if name not in ready:
                try:
                    st = d.status() if d.ready() is not None else None
                except DaemonError as exc:
                    raise LocalNetError(str(exc)) from None
                if st and st.get("addrs"):
                    ready[name] = st
        return len(ready) == len(daemons)

    waiting = lambda: ", ".join(f"{n}'s daemon" for n in daemons if n not in ready)  # noqa: E731
    while not all_ready():
        if time.monotonic() > deadline:
            raise LocalNetError(f"timed out waiting for {waiting()} to answer (see its logs/daemon.log)")
        time.sleep(0.1)
    return ready


def _introduce(home: NodeHome, addr: str, deadline: float) -> None:
    """Have `home`'s running daemon connect to `addr` (what `--bootstrap addr` does at start;
    here the address is only known once that daemon is up). The daemon pulls the ledger from
    the peer on connection and finds every other member from their new `hello`s itself."""
    while True:
        try:
            control.call(home.control_socket, "connect", addr=addr, timeout=30.0)
            return
        except AtdError as exc:
            if time.monotonic() > deadline:
                raise LocalNetError(f"{home.root.name} could not connect to {addr}: {exc}") from None
            time.sleep(0.2)


def up(root: Path, n: int | None = None, *, timeout: float = READY_TIMEOUT, extra_args: list[str] | None = None,
       roles: dict[str, str] | None = None, start: bool = True, log=lambda _m: None) -> list[NodeState]:
    """Create (if needed) and start a local consortium of `n` nodes; wait until every daemon
    is connected to every other one and all ledgers hold the same entries (every node's
    signed `hello` is known everywhere). `roles` {node name: role} are written to those
    nodes' config.toml before their daemons start (a running daemon keeps its role);
    `start=False` only creates the homes. `extra_args` go to every `atd node start` (e.g.
    ["--dashboard=127.0.0.1:0"]) and are kept in local.json for later restarts; None reuses them."""
    root = Path(root).expanduser().resolve()
    if (root / MANIFEST).exists():
        have = len(read_manifest(root)["nodes"])
        if n and n != have:
            raise LocalNetError(f"{root} holds a consortium of {have} nodes, not {n}; "
                                f"`atd local down --dir {root}` and use another --dir")
        hs = homes(root)
    else:
        n = n or 3
        hs = create(root, n)
        log(f"created {n} node homes under {root} (node1 founded the consortium, the others are admitted)")
    if extra_args is not None:
        _update_manifest(root, daemon_args=list(extra_args))
    extra_args = list(read_manifest(root).get("daemon_args", []))
    if roles:
        _set_roles(hs, roles)
    if not start:
        return status(root)
    deadline = time.monotonic() + timeout
    daemons: dict[str, DaemonProcess] = {}
    fresh: set[str] = set()
    for h in hs:  # start every stopped daemon at once; none needs another's address to start
        running = DaemonProcess.find_running(h)
        if running is not None:
            daemons[h.root.name] = running
            continue
        clear_stale(h)
        daemons[h.root.name] = started = DaemonProcess.start(
            h, "--quiet", "--listen", "/ip4/127.0.0.1/tcp/0", *extra_args, detach=True)
        fresh.add(h.root.name)
        log(f"started {h.root.name} (pid {started.pid})")
    ready = _wait_all_ready(daemons, deadline)
    founder = hs[0].root.name
    meet: list[tuple[str, str]] = []  # (a daemon just started, whom it is introduced to)
    for name in sorted(fresh):  # a new start knows no current address: introduce it as --bootstrap would
        if name != founder:
            meet.append((name, founder))
        else:  # the founder restarted beside running members: it meets them at their addresses
            meet += [(name, other) for other in sorted(set(daemons) - fresh)]
    if meet:  # side by side: one slow handshake does not hold up the others
        with ThreadPoolExecutor(max_workers=len(meet)) as pool:
            list(pool.map(lambda m: _introduce(daemons[m[0]].home, ready[m[1]]["addrs"][0], deadline), meet))
    ids = {name: st["peer_id"] for name, st in ready.items()}

    def converged():
        heads = []
        for d in daemons.values():
            st = d.status()
            if st is None or not set(ids.values()) - {st["peer_id"]} <= set(st.get("peers", [])):
                return False
            heads.append(st["ledger"]["heads"])
        return set(heads[0]) == set(ids.values()) and all(hd == heads[0] for hd in heads)

    _wait(converged, deadline, f"all {len(hs)} daemons to connect and agree on the ledger (logs: {root}/node*/logs)")
    return status(root)


def _update_manifest(root: Path, **changes) -> None:
    m = {**read_manifest(root), **changes}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(m, indent=2))
    tmp.replace(root / MANIFEST)


def _set_roles(hs: list[NodeHome], roles: dict[str, str]) -> None:
    from atdnode.node.config import NodeConfig

    by_name = {h.root.name: h for h in hs}
    for name, role in roles.items():
        if name not in by_name:
            raise LocalNetError(f"--role {name}={role}: no node {name!r} (nodes: {', '.join(by_name)})")
        h = by_name[name]
        cfg = NodeConfig.load(h)
        if cfg.role != role and DaemonProcess.find_running(h) is not None:
            raise LocalNetError(f"{name} is running as {cfg.role!r}; `atd local down` first to change its role")
        cfg.role = role
        cfg.save(h)


def status(root: Path) -> list[NodeState]:
    """Each node's daemon: running or not, pid, addresses, connected peers."""
    from atdnode.node.identity import NodeIdentity

    root = Path(root).expanduser().resolve()
    founder = read_manifest(root).get("founder")
    out = []
    for h in homes(root):
        d = DaemonProcess.find_running(h)
        st = d.status() if d is not None else None
        peer_id = st["peer_id"] if st else NodeIdentity.load(h).peer_id
        out.append(NodeState(name=h.root.name, home=h.root, peer_id=peer_id, founder=peer_id == founder,
                             pid=d.pid if d is not None else None, running=st is not None,
                             addrs=list(st.get("addrs", [])) if st else [],
                             peers=list(st.get("peers", [])) if st else [],
                             dashboard=st.get("dashboard") if st else None))
    return out


def stop_daemon(home: NodeHome, timeout: float = STOP_TIMEOUT) -> str:
    """Stop `home`'s daemon and clean up; returns what happened ("stopped", "killed", "not running")."""
    d = DaemonProcess.find_running(home)
    if d is not None:
        what = d.stop(timeout)
    else:
        what = "had exited (stale pidfile removed)" if (home.root / PIDFILE).exists() else "not running"
    clear_stale(home)
    return what


def down(root: Path, *, timeout: float = STOP_TIMEOUT) -> dict[str, str]:
    """Stop every daemon of the local consortium at `root` (also after a crash), side by side."""
    hs = homes(Path(root).expanduser().resolve())
    with ThreadPoolExecutor(max_workers=len(hs)) as pool:
        whats = list(pool.map(lambda h: stop_daemon(h, timeout=timeout), hs))
    return {h.root.name: what for h, what in zip(hs, whats)}
