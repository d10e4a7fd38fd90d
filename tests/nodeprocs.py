"""Helpers for tests that run real `atd` daemons as separate OS processes on 127.0.0.1.

Readiness is a signal, never a sleep: `start_daemon` returns once the daemon printed its
listen address (it prints only when it is ready), and `wait_until` polls a condition
with a deadline (for state that has no push signal, such as "this ledger now holds X").
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from atdnode.node import control
from atdnode.node import NodeHome
from ledger import Ledger

ATD = [sys.executable, "-m", "cli.app"]


def atd(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run one `atd` command to completion; return the completed process (text mode)."""
    proc = subprocess.run([*ATD, *args], capture_output=True, text=True, timeout=timeout, env=_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"atd {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def atd_json(*args: str) -> object:
    return json.loads(atd(*args).stdout)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Daemon:
    """A running `atd node start` process whose stdout lines are collected in the background."""

    def __init__(self, home: Path, args: list[str]) -> None:
        self.home = home
        self.log = open(home / "test-daemon.stderr", "ab")
        self.proc = subprocess.Popen(
            [*ATD, "node", "start", "--home", str(home), *args],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=_env(),
        )
        self.lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.addrs: list[str] = []

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def wait_ready(self, timeout: float = 60) -> list[str]:
        try:
            first = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"daemon at {self.home} printed no address within {timeout}s: {self.stderr()}")
        self.addrs = [first]
        return self.addrs

    def stderr(self) -> str:
        try:
            return (self.home / "test-daemon.stderr").read_text()[-4000:]
        except OSError:
            return ""

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"daemon at {self.home} ignored SIGTERM")
        self.log.close()
        return self.proc.returncode


def start_daemon(home: Path, *args: str, timeout: float = 60) -> Daemon:
    d = Daemon(home, ["--listen", "/ip4/127.0.0.1/tcp/0", "--sync-interval", "2", *args])
    d.wait_ready(timeout)
    return d


def wait_until(cond: Callable[[], object], timeout: float, what: str, interval: float = 0.25) -> object:
    """Poll `cond` until it returns something truthy, or fail naming `what`."""
    end = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < end:
        try:
            value = cond()
            if value:
                return value
        except Exception as exc:  # the state may be mid-write; try again until the deadline
            last_exc = exc
        threading.Event().wait(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


def entry_ids(home: Path) -> set[str]:
    """Ids (hex) of every entry in `home`'s ledger, read in-process."""
    return {r["id"] for r in ledger_rows(home)}


def consortium(root: Path, n: int) -> list[Path]:
    """Home folders `root/n0 .. n{n-1}`: n0 founded the consortium and admitted the others
    (`tests.factories.make_consortium`: the same `atd` commands, run in-process)."""
    from tests.factories import make_consortium

    return [h.root for h in make_consortium(root, n)]


def status(home: Path) -> dict:
    """`atd node status --json` of `home` as an OS process (the daemon's, or the offline state)."""
    return json.loads(atd("node", "status", "--home", str(home), "--json").stdout)


def live_status(home: Path | NodeHome) -> dict:
    """The running daemon's status over its control socket, in-process (what `atd node status`
    prints, without starting a process: cheap enough to poll)."""
    h = home if isinstance(home, NodeHome) else NodeHome.at(home)
    return control.call(h.control_socket, "status", timeout=60)


def ledger_rows(home: Path | NodeHome, kind: str | None = None) -> list[dict]:
    """What `atd ledger show --json [--kind K]` prints (less `stored_at`), read in-process:
    cheap enough to poll while the daemon writes (SQLite readers do not block the writer)."""
    h = home if isinstance(home, NodeHome) else NodeHome.at(home)
    with Ledger.open(h.ledger_db) as led:
        return [e.to_json() for e in led.query(kind=kind)]


def atd_all(*commands: list[str], timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Run several `atd` commands at once (e.g. each node trains on its own data); all must succeed."""
    procs = [subprocess.Popen([*ATD, *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for c in commands]
    done = []
    for c, p in zip(commands, procs):
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise AssertionError(f"atd {' '.join(c)} failed ({p.returncode}):\n{out}\n{err}")
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done
