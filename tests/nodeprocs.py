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


def atd(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run one `atd` command to completion; return the completed process (text mode)."""
    proc = subprocess.run([*ATD, *args], capture_output=True, text=True, timeout=timeout, env=_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"atd {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def atd_json(*args: str) -> object:
    return json.loads(atd(*args).stdout)


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
