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
    return {e["id"] for e in atd_json("ledger", "show", "--home", str(home), "--json")}


def consortium(root: Path, n: int) -> list[Path]:
    """Homes `root/n1 .. n{n}` made with `atd init` / `atd member add` as OS processes: n1
    founds consortium "demo" and admits the others."""
    homes = [root / f"n{i + 1}" for i in range(n)]
    atd("init", "--home", str(homes[0]), "--genesis", "--consortium", "demo")
    genesis = atd_json("ledger", "show", "--home", str(homes[0]), "--kind", "genesis", "--json")[0]["id"]
    for h in homes[1:]:
        atd("init", "--home", str(h), "--join", genesis)
        atd("member", "add", "--home", str(homes[0]), atd("id", "--home", str(h)).stdout.strip())
    return homes


def status(home: Path) -> dict:
    """`atd node status --json` of `home` (the running daemon's, or the offline state)."""
    return json.loads(atd("node", "status", "--home", str(home), "--json").stdout)
