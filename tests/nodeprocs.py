"""Helpers for tests that run real `atd` daemons and commands as separate OS processes on 127.0.0.1.

Daemons are `atdnode.node.DaemonProcess`es (the library's, as `atd local` and netsim start
them): `start_daemon` starts one with the tests' defaults and returns once it announced
itself. Readiness is a signal, never a sleep; `wait_until` polls a condition with a
deadline (for state that has no push signal, such as "this ledger now holds X").
"""
from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from atdnode.node import DaemonProcess, NodeHome, atd_argv, atd_env, control
from ledger import Ledger

ATD = atd_argv()


def atd(*args: str, check: bool = True, timeout: float = 300, prefix: list[str] = ATD) -> subprocess.CompletedProcess:
    """Run one `atd` command to completion; return the completed process (text mode).
    `prefix`: the argv prefix of an `atd` (default a plain interpreter; a fork server's client,
    tests/atd_forkserver.py)."""
    proc = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=timeout, env=_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"atd {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def atd_json(*args: str, prefix: list[str] = ATD) -> object:
    return json.loads(atd(*args, prefix=prefix).stdout)


class WarmAtd:
    """`atd` and `atd_json` with the argv prefix of a fork server's client: each command a
    process forked from an interpreter that imported the CLI once (tests/atd_forkserver.py)."""

    def __init__(self, prefix: list[str]) -> None:
        self.prefix = prefix

    def __call__(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        return atd(*args, check=check, timeout=timeout, prefix=self.prefix)

    def json(self, *args: str) -> object:
        return atd_json(*args, prefix=self.prefix)


def _env() -> dict[str, str]:
    return atd_env(one_thread=True)


def spawn_daemon(home: Path | NodeHome, *args: str) -> DaemonProcess:
    """`atd node start --home HOME ARGS` as a child process, not yet ready (`wait_ready`);
    its output goes to HOME/test-daemon.stderr."""
    h = home if isinstance(home, NodeHome) else NodeHome.at(home)
    return DaemonProcess.start(h, *args, out=h.root / "test-daemon.stderr", one_thread=True)


def start_daemon(home: Path | NodeHome, *args: str, timeout: float = 60) -> DaemonProcess:
    """A daemon on 127.0.0.1 syncing every 2 s, returned once it announced itself."""
    d = spawn_daemon(home, "--listen", "/ip4/127.0.0.1/tcp/0", "--sync-interval", "2", *args)
    d.wait_ready(timeout)
    return d


def start_daemons(homes: list[Path] | list[NodeHome], *args: str, timeout: float = 60,
                  first: DaemonProcess | None = None) -> list[DaemonProcess]:
    """`start_daemon` for every home: the first alone, then the others side by side, each
    bootstrapping from the first (their start-ups overlap instead of queueing); returned once
    all announced themselves, in the order of `homes`. `first`: the first home's daemon,
    already running (only the others start)."""
    mine = [] if first else [first := start_daemon(homes[0], *args, timeout=timeout)]
    rest = [spawn_daemon(h, "--listen", "/ip4/127.0.0.1/tcp/0", "--sync-interval", "2", *args, "--bootstrap",
                         first.addrs[0]) for h in homes[1:]]
    try:
        for d in rest:
            d.wait_ready(timeout)
    except BaseException:  # none is left running: the caller never got them
        for d in [*mine, *rest]:
            if d.alive():
                d.kill()
        raise
    return [first, *rest]


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


def atd_all(*commands: list[str], timeout: float = 600, prefix: list[str] = ATD) -> list[subprocess.CompletedProcess]:
    """Run several `atd` commands at once (e.g. each node trains on its own data); all must succeed.
    `prefix`: the argv prefix of an `atd` (default a plain interpreter; a fork server's client)."""
    procs = [subprocess.Popen([*prefix, *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for c in commands]
    done = []
    for c, p in zip(commands, procs):
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise AssertionError(f"atd {' '.join(c)} failed ({p.returncode}):\n{out}\n{err}")
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done
