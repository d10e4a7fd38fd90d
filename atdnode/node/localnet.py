"""A local consortium of N nodes on this machine (`atd local up|status|down`).

Layout::

    DIR/
      local.json        the consortium: node names, genesis id, listen host
      node1/ ... nodeN  ordinary node homes (node1 founded the consortium)
        daemon.pid      pid of the detached `atd node start` process (written here)
        logs/daemon.log the daemon's rotating log; logs/daemon.out its stdout/stderr

`up` makes the homes with the library calls behind `atd init` (`init_home`) and
`atd member add` (`Ledger.admit`), then starts each daemon as a detached OS process
(`atd node start --quiet`, its own session, so it outlives the command) listening on
127.0.0.1, all at once; once they answer, each new one is told to connect to the founder
(the founder, when it alone restarted, to the running members) over its control socket. It returns only when
every daemon has announced itself (HOME/daemon.json with its pid), answers on its control
socket and is connected to every other one — readiness read from the daemons, never a
sleep — or raises LocalNetError with a deadline message naming the node and its log. A
daemon counts as exited at start only by its exit status (the wait status of the child
`up` started), reported with what that start wrote to logs/daemon.out. Running `up` again
on the same DIR restarts the daemons that are not running and keeps the homes.

`down` stops each daemon: the control socket's `stop` first, SIGTERM by pid when it does
not answer, SIGKILL after a deadline; it also cleans up after a crash (a pidfile whose
process is gone, a stale socket). A pid is only signalled when that process is an
`atd node start` for this very home, so a recycled pid is never hit.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from atdnode.node import control
from atdnode.errors import AtdError
from atdnode.node.home import NodeHome

MANIFEST = "local.json"
PIDFILE = "daemon.pid"
READY_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0


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


def _atd_argv() -> list[str]:
    return [sys.executable, "-m", "cli.app"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(__file__).resolve().parents[2])  # so `-m cli.app` finds this very copy of atd
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("ATD_HOME", None)  # each daemon gets --home explicitly
    return env


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
    from atdnode.node.identity import NodeIdentity, init_home
    from ledger import Ledger

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
    founder = init_home(hs[0], name=names[0], consortium=consortium)
    with Ledger.open(hs[0].ledger_db) as led:
        genesis = led.query(kind="genesis")[0]
        joiners = [init_home(h, name=name, join=genesis.id.hex()) for h, name in zip(hs[1:], names[1:])]
        for name, ident in zip(names[1:], joiners):
            led.admit(founder.signer, ident.public_key, admin=False, name=name)
        known = [e.to_bytes() for e in led.query()]
    for h in hs[1:]:
        with Ledger.open(h.ledger_db) as led:
            led.merge(known)
    manifest = {"nodes": names, "genesis": genesis.id.hex(), "consortium": consortium,
                "founder": NodeIdentity.load(hs[0]).peer_id, "created": time.time()}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(root / MANIFEST)
    return hs


# ---------------------------------------------------------------- processes


def _read_pid(home: NodeHome) -> int | None:
    try:
        return int((home.root / PIDFILE).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _is_our_daemon(pid: int, home: NodeHome) -> bool:
    """True when `pid` is alive and is `atd node start` for this home (not a recycled pid)."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        cmd = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return "node" in cmd and "start" in cmd and str(home.root) in cmd


def _clear_stale(home: NodeHome) -> None:
    for name in (PIDFILE, "daemon.json"):
        (home.root / name).unlink(missing_ok=True)
    if home.control_socket.exists() and not control.daemon_running(home.control_socket):
        home.control_socket.unlink(missing_ok=True)


@dataclass
class Started:
    """A daemon this process started: its process handle and where its output begins."""

    proc: subprocess.Popen
    out: Path  # logs/daemon.out (appended to across starts)
    offset: int  # the size of `out` before this start: what follows is this start's output

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_status(self) -> int | None:
        """The exit status once the process has ended (negative: killed by that signal), else None.
        From the kernel's wait status of our own child: never inferred from /proc."""
        return self.proc.poll()

    def output(self) -> str:
        """The last non-empty line this start wrote to daemon.out ("" if none)."""
        try:
            with open(self.out, "rb") as f:
                f.seek(self.offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return lines[-1][-300:] if lines else ""


def start_daemon(home: NodeHome, *, bootstrap: list[str] = (), listen_host: str = "127.0.0.1",
                 extra_args: list[str] = ()) -> Started:
    """Start `atd node start` for `home` as a detached process; returns its handle (not yet ready)."""
    home.logs_dir.mkdir(parents=True, exist_ok=True)
    argv = [*_atd_argv(), "node", "start", "--home", str(home.root), "--quiet",
            "--listen", f"/ip4/{listen_host}/tcp/0", *extra_args]
    for b in bootstrap:
        argv += ["--bootstrap", b]
    out = home.logs_dir / "daemon.out"
    with open(out, "ab") as fh:
        offset = fh.tell()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, env=_env(),
                                start_new_session=True, close_fds=True)
    (home.root / PIDFILE).write_text(f"{proc.pid}\n")
    return Started(proc=proc, out=out, offset=offset)


def _announced_pid(home: NodeHome) -> int | None:
    """The pid in HOME/daemon.json: the daemon writes it once it serves its control socket."""
    try:
        return int(json.loads((home.root / "daemon.json").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _status_of(home: NodeHome) -> dict | None:
    try:
        return control.call(home.control_socket, "status", timeout=10.0)
    except AtdError:
        return None


def _wait(cond, deadline: float, what: str, interval: float = 0.2):
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise LocalNetError(f"timed out waiting for {what}")
        time.sleep(interval)


def _ready_status(home: NodeHome, started: Started | int) -> dict | None:
    """The daemon's status once it is ready, None while it starts; LocalNetError if it exited.

    Ready is the daemon's own signal: HOME/daemon.json names its pid (written once its
    control socket serves) and the control socket answers `status` with its addresses.
    Exited is the kernel's: the wait status of the process this `up` started (or, for a
    daemon found running, its pid no longer existing) — never a guess from /proc. (The old
    guess read /proc/PID/cmdline right after `Popen` returned; `Popen` returns once exec has
    closed the close-on-exec pipe, a moment before the kernel sets up the new image's
    arguments, and a read in that window gets an empty command line: 12 of 179 reads right
    after `Popen` on a loaded 2-core host. The live daemon was then reported "exited at start".)"""
    pid = started.pid if isinstance(started, Started) else started
    if isinstance(started, Started):
        rc = started.exit_status()
        if rc is not None:
            how = f"signal {-rc}" if rc < 0 else f"status {rc}"
            tail = started.output()
            raise LocalNetError(f"{home.root.name}: the daemon exited at start ({how}; see {started.out})"
                                + (f": {tail}" if tail else ""))
    elif not _pid_alive(pid):
        raise LocalNetError(f"{home.root.name}: the daemon (pid {pid}) is no longer running "
                            f"(see {home.logs_dir / 'daemon.out'})")
    if _announced_pid(home) != pid:
        return None
    st = _status_of(home)
    return st if st and st.get("addrs") else None


def _wait_all_ready(handles: dict[str, tuple[NodeHome, Started | int]], deadline: float) -> dict[str, dict]:
    """Every daemon's status once all are ready (they start side by side: a daemon's start is
    mostly importing py-libp2p, ~3 s of one core, so N starts overlap instead of queueing)."""
    ready: dict[str, dict] = {}

    def all_ready():
        for name, (home, started) in handles.items():
            if name not in ready:
                st = _ready_status(home, started)
                if st:
                    ready[name] = st
        return len(ready) == len(handles)

    waiting = lambda: ", ".join(f"{n}'s daemon" for n in handles if n not in ready)  # noqa: E731
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


def _pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
    handles: dict[str, tuple[NodeHome, Started | int]] = {}
    fresh: set[str] = set()
    for h in hs:  # start every stopped daemon at once; none needs another's address to start
        pid = _read_pid(h)
        if pid is not None and _is_our_daemon(pid, h):
            handles[h.root.name] = (h, pid)
            continue
        _clear_stale(h)
        started = start_daemon(h, extra_args=extra_args)
        handles[h.root.name] = (h, started)
        fresh.add(h.root.name)
        log(f"started {h.root.name} (pid {started.pid})")
    ready = _wait_all_ready(handles, deadline)
    founder = hs[0].root.name
    meet: list[tuple[str, str]] = []  # (a daemon just started, whom it is introduced to)
    for name in sorted(fresh):  # a new start knows no current address: introduce it as --bootstrap would
        if name != founder:
            meet.append((name, founder))
        else:  # the founder restarted beside running members: it meets them at their addresses
            meet += [(name, other) for other in sorted(set(handles) - fresh)]
    if meet:  # side by side: one slow handshake does not hold up the others
        with ThreadPoolExecutor(max_workers=len(meet)) as pool:
            list(pool.map(lambda m: _introduce(handles[m[0]][0], ready[m[1]]["addrs"][0], deadline), meet))
    ids = {h.root.name: _status_of(h)["peer_id"] for h in hs}

    def converged():
        heads = []
        for h in hs:
            st = _status_of(h)
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
        pid = _read_pid(h)
        cfg = NodeConfig.load(h)
        if cfg.role != role and pid is not None and _is_our_daemon(pid, h):
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
        pid = _read_pid(h)
        alive = pid is not None and _is_our_daemon(pid, h)
        st = _status_of(h) if alive else None
        peer_id = st["peer_id"] if st else NodeIdentity.load(h).peer_id
        out.append(NodeState(name=h.root.name, home=h.root, peer_id=peer_id, founder=peer_id == founder,
                             pid=pid if alive else None, running=st is not None,
                             addrs=list(st.get("addrs", [])) if st else [],
                             peers=list(st.get("peers", [])) if st else [],
                             dashboard=st.get("dashboard") if st else None))
    return out


def stop_daemon(home: NodeHome, timeout: float = STOP_TIMEOUT) -> str:
    """Stop `home`'s daemon and clean up; returns what happened ("stopped", "killed", "not running")."""
    pid = _read_pid(home)
    alive = pid is not None and _is_our_daemon(pid, home)
    what = "not running" if pid is None else "had exited (stale pidfile removed)"
    if alive:
        try:
            control.call(home.control_socket, "stop", timeout=10.0)
        except AtdError:
            os.kill(pid, signal.SIGTERM)  # the control socket is gone or hung: the signal path
        what = "stopped"
        end = time.monotonic() + timeout
        while _is_our_daemon(pid, home) and time.monotonic() < end:
            time.sleep(0.1)
        if _is_our_daemon(pid, home):
            os.kill(pid, signal.SIGKILL)
            what = "killed"
            end = time.monotonic() + 10
            while _is_our_daemon(pid, home) and time.monotonic() < end:
                time.sleep(0.1)
    _clear_stale(home)
    return what


def down(root: Path, *, timeout: float = STOP_TIMEOUT) -> dict[str, str]:
    """Stop every daemon of the local consortium at `root` (also after a crash), side by side."""
    hs = homes(Path(root).expanduser().resolve())
    with ThreadPoolExecutor(max_workers=len(hs)) as pool:
        whats = list(pool.map(lambda h: stop_daemon(h, timeout=timeout), hs))
    return {h.root.name: what for h, what in zip(hs, whats)}
