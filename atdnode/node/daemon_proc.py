"""A node daemon as an OS process: `atd node start` started, awaited, stopped or killed.

The one way `atd local`, netsim's process back-end, the benchmarks and the tests run a
daemon process. A `DaemonProcess` is either a child this process started (`start`) or a
detached daemon found running by its pidfile (`find_running`, e.g. by `atd local down`).

* Ready is the daemon's own signal: HOME/daemon.json names its pid and its addresses (the
  daemon writes it once its control socket serves and its transport listens). `ready()`
  reads it; `wait_ready` waits on it under a deadline — never a fixed sleep.
* Exited is the kernel's: the wait status of the child this process started (for a daemon
  found running, its pid no longer existing) — never a guess from /proc, whose command
  line is empty for a moment after `Popen` returns (exec has closed the close-on-exec
  pipe but not yet set up the new image's arguments). A start that exits raises
  `DaemonExited` naming its exit status and the last line this start wrote.
* Everything the process writes (stdout: its addresses; stderr: its log unless `--quiet`,
  and any crash) is appended to one file, `out`; `output()` is what this start wrote.
* Stopped: SIGTERM (the daemon's clean shutdown), SIGKILL after a deadline. A found
  daemon's pid is only signalled while that process is `atd node start` for this very
  home, so a recycled pid is never hit.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from atdnode.errors import AtdError, DaemonError
from atdnode.node import control
from atdnode.node.home import NodeHome

PIDFILE = "daemon.pid"  # written for a detached start, so a later command finds the daemon
STATE_FILE = "daemon.json"  # the daemon's own: {pid, peer_id, addrs, started, dashboard}
STOP_TIMEOUT = 30.0
POLL_S = 0.05


class DaemonExited(DaemonError):
    """A daemon process ended while it was expected to start or run."""


def atd_argv() -> list[str]:
    """The argv prefix of an `atd` command run by this interpreter from this copy of atd."""
    return [sys.executable, "-m", "cli.app"]


def atd_env(*, one_thread: bool = False) -> dict[str, str]:
    """The environment of an `atd` process started from here: unbuffered output, this copy of
    atd first on PYTHONPATH, no ATD_HOME (each command gets --home); `one_thread`: one
    compute thread unless the caller's environment says otherwise (processes sharing cores)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if one_thread:
        env.setdefault("OMP_NUM_THREADS", "1")
    root = str(Path(__file__).resolve().parents[2])  # so `-m cli.app` finds this very copy of atd
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("ATD_HOME", None)
    return env


class DaemonProcess:
    """One `atd node start` process for `home`. Use `start` or `find_running`."""

    def __init__(self, *, home: NodeHome, pid: int, proc: subprocess.Popen | None = None,
                 out: Path | None = None, offset: int = 0) -> None:
        self.home = home
        self.pid = pid
        self.proc = proc  # the child, when this process started it
        self.out = out or home.logs_dir / "daemon.out"
        self.offset = offset  # the size of `out` before this start: what follows is this start's
        self.addrs: list[str] = []  # what others dial, once ready

    @classmethod
    def start(cls, home: NodeHome, *args: str, out: Path | None = None, detach: bool = False,
              wrap: Sequence[str] = (), one_thread: bool = False) -> "DaemonProcess":
        """Start `atd node start --home HOME ARGS` (prefixed by `wrap`, e.g. `ip netns exec NS`);
        returns at once (not yet ready). Output is appended to `out` (default
        HOME/logs/daemon.out). `detach`: its own session (it outlives this process) and a
        pidfile (HOME/daemon.pid) for `find_running`."""
        out = out or home.logs_dir / "daemon.out"
        out.parent.mkdir(parents=True, exist_ok=True)
        argv = [*wrap, *atd_argv(), "node", "start", "--home", str(home.root), *args]
        with open(out, "ab") as fh:
            offset = fh.tell()
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, close_fds=True,
                                    env=atd_env(one_thread=one_thread), start_new_session=detach)
        if detach:
            (home.root / PIDFILE).write_text(f"{proc.pid}\n")
        return cls(home=home, pid=proc.pid, proc=proc, out=out, offset=offset)

    @classmethod
    def find_running(cls, home: NodeHome) -> "DaemonProcess | None":
        """The detached daemon HOME/daemon.pid names, if it is alive and is `atd node start`
        for this home; None otherwise."""
        try:
            pid = int((home.root / PIDFILE).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        d = cls(home=home, pid=pid)
        return d if d.alive() else None

    # -- state --------------------------------------------------------------------------

    @property
    def returncode(self) -> int | None:
        """The exit status of a child once it has ended (negative: killed by that signal)."""
        return self.proc.poll() if self.proc is not None else None

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return _is_daemon_of(self.pid, self.home)

    def ready(self) -> list[str] | None:
        """Its addresses once the daemon announced itself (HOME/daemon.json names its pid),
        None while it starts; `DaemonExited` once it has ended."""
        if not self.alive():
            raise DaemonExited(self._exit_message())
        try:
            state = json.loads((self.home.root / STATE_FILE).read_text())
            if int(state["pid"]) != self.pid:
                return None
            self.addrs = [str(a) for a in state["addrs"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None  # not written yet, or being replaced
        return self.addrs

    def wait_ready(self, timeout: float) -> list[str]:
        """Block until `ready()`; DaemonError after `timeout` s (the process is left running)."""
        end = time.monotonic() + timeout
        while (addrs := self.ready()) is None:
            if time.monotonic() > end:
                raise DaemonError(f"{self.home.root.name}: the daemon did not announce itself within {timeout:g} s "
                                  f"(see {self.out})" + _tail(self.last_line()))
            time.sleep(POLL_S)
        return addrs

    def status(self, timeout: float = 10.0) -> dict | None:
        """The running daemon's `status` over its control socket; None if it does not answer."""
        try:
            return control.call(self.home.control_socket, "status", timeout=timeout)
        except AtdError:
            return None

    def output(self) -> str:
        """What this start wrote to `out` so far."""
        try:
            with open(self.out, "rb") as f:
                f.seek(self.offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def last_line(self) -> str:
        """The last non-empty line this start wrote ("" if none), at most 300 characters."""
        lines = [ln for ln in self.output().splitlines() if ln.strip()]
        return lines[-1][-300:] if lines else ""

    def _exit_message(self) -> str:
        rc = self.returncode
        if rc is None:  # a daemon found running: only its pid is known
            return f"{self.home.root.name}: the daemon (pid {self.pid}) is no longer running (see {self.out})"
        how = f"signal {-rc}" if rc < 0 else f"status {rc}"
        return f"{self.home.root.name}: the daemon exited at start ({how}; see {self.out})" + _tail(self.last_line())

    # -- ending -------------------------------------------------------------------------

    def _signal(self, sig: int) -> None:
        if self.alive():  # a found daemon: only while the pid is still this home's daemon
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def wait_exit(self, timeout: float) -> bool:
        """Block until the process has ended (a child is reaped); False after `timeout` s."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        end = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() > end:
                return False
            time.sleep(POLL_S)
        return True

    def stop(self, timeout: float = STOP_TIMEOUT) -> str:
        """SIGTERM and wait for the clean shutdown, SIGKILL after `timeout` s; returns what
        happened: "stopped", "killed" or "not running"."""
        if not self.alive():
            return "not running"
        self._signal(signal.SIGTERM)
        if self.wait_exit(timeout):
            return "stopped"
        self.kill()
        return "killed"

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL: the process dies at once (waited for up to `timeout` s)."""
        self._signal(signal.SIGKILL)
        self.wait_exit(timeout)


def clear_stale(home: NodeHome) -> None:
    """Remove what a daemon that is gone left behind: its pidfile, daemon.json, a control
    socket nothing answers on."""
    for name in (PIDFILE, STATE_FILE):
        (home.root / name).unlink(missing_ok=True)
    if home.control_socket.exists() and not control.daemon_running(home.control_socket):
        home.control_socket.unlink(missing_ok=True)


def _tail(line: str) -> str:
    return f": {line}" if line else ""


def _is_daemon_of(pid: int, home: NodeHome) -> bool:
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
