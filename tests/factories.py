"""Shared test factories: a consortium of N homes, in-process daemons, transports, one wait.

`tests/conftest.py` offers these as fixtures; test modules may also import them directly
(never from another test module). Daemons as OS processes: `tests/nodeprocs.py`;
trained VGS-ATD homes in `tests/vgs_homes.py`.

Waiting is on a condition with a deadline, never a fixed sleep: `wait_for` inside a trio run,
`tests.nodeprocs.wait_until` in plain (blocking) code.
"""
from __future__ import annotations

import hashlib
import json
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Callable

import trio
from typer.testing import CliRunner

from atdnode.node import NodeDaemon, NodeHome, NodeIdentity, found_consortium
from atdnode.transport import MemoryNetwork, MemoryTransport, Transport
from cli.app import app
from ledger import Entry, Ledger

KINDS = ["memory", "libp2p"]  # the two transports every contract test runs against
_runner = CliRunner()


# ---------------------------------------------------------------- waiting

async def wait_for(cond: Callable[[], object], what: str = "condition", timeout: float = 20.0,
                   interval: float = 0.02) -> None:
    """Inside a trio run: poll `cond` until truthy; fail after `timeout` s naming `what`."""
    with trio.move_on_after(timeout) as scope:
        while not cond():
            await trio.sleep(interval)
    if scope.cancelled_caught:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def run(fn, *args, timeout: float = 90.0) -> None:
    """`trio.run(fn(*args))` under a deadline."""
    async def main() -> None:
        with trio.fail_after(timeout):
            await fn(*args)

    trio.run(main)


# ---------------------------------------------------------------- homes

def cli(*args: str) -> str:
    """Run `atd ARGS` in-process (typer's runner); assert success; return its output."""
    res = _runner.invoke(app, list(args))
    assert res.exit_code == 0, f"atd {' '.join(args)}: {res.output} {res.exception!r}"
    return res.output


def cli_json(*args: str) -> dict:
    """Run `atd ARGS --json` in-process; assert success; return its last output line, parsed."""
    res = _runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(res.stdout.strip().splitlines()[-1])


def make_consortium(root: Path, n: int) -> list[NodeHome]:
    """Homes `root/n0 .. n{n-1}`: n0 founds consortium "test" and admits the others
    (`found_consortium`: what `atd init` and `atd member add` do). Nothing runs; no entry
    beyond genesis and admissions, and the joiners' ledgers are empty."""
    homes = [NodeHome.at(root / f"n{i}") for i in range(n)]
    found_consortium(homes, "test")
    return homes


def ids(home: NodeHome) -> set[bytes]:
    """Ids of every entry in `home`'s ledger."""
    with Ledger.open(home.ledger_db) as led:
        return {e.id for e in led.all_entries()}


def weights_body(blob: str, manifest: str, size: int, **extra) -> dict:
    """A `weights` body naming `blob` that fits the entry spec (`atdnode.bodies`), with `extra` fields."""
    return {"blob": blob, "manifest": manifest, "size": size, "part": "full", "model": {}, "labels": [],
            "label_fp": "", "samples": 0, "metrics": {}, "provenance": [], **extra}


def append(home: NodeHome, kind: str, body: dict) -> Entry:
    """What a CLI command does while the daemon runs: sign and append to the ledger file."""
    ident = NodeIdentity.load(home)
    with Ledger.open(home.ledger_db) as led:
        return led.append(ident.signer, kind, body)


# ---------------------------------------------------------------- in-process daemons

def daemon_on(net: MemoryNetwork, home: NodeHome) -> NodeDaemon:
    """A real `NodeDaemon` for `home` on the in-memory network `net` (fast intervals)."""
    seed = NodeIdentity.load(home).signer.seed
    return NodeDaemon(home, transport=MemoryTransport(net, seed), sync_interval=0.5, poll_interval=0.05)


# ---------------------------------------------------------------- bare transports

def seed(i: int) -> bytes:
    """Deterministic key seed of contract-test node `i`."""
    return hashlib.sha256(f"node-{i}".encode()).digest()


@asynccontextmanager
async def transports(kind: str, n: int, *, net: MemoryNetwork | None = None,
                     first: int = 0) -> AsyncIterator[list[Transport]]:
    """n running transports of one kind (not yet connected), keys seed(first) ... seed(first + n - 1)."""
    if kind == "memory":
        net = net or MemoryNetwork(seed=7)
        ts: list[Transport] = [MemoryTransport(net, seed(i)) for i in range(first, first + n)]
    else:
        from atdnode.transport import Libp2pTransport

        ts = [Libp2pTransport(seed(i)) for i in range(first, first + n)]
    async with AsyncExitStack() as stack:
        for t in ts:
            await stack.enter_async_context(t.run(["/ip4/127.0.0.1/tcp/0"]))
        yield ts


async def serve_subscribed(t: Transport, topic: str, got: dict[str, list[bytes]], stop: trio.Event,
                           task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run `t` on loopback subscribed to `topic` (what arrives is appended to got[peer id])
    until `stop` is set; started once subscribed."""
    async with t.run(["/ip4/127.0.0.1/tcp/0"]):
        async def handler(data: bytes, _frm: str) -> None:
            got[t.peer_id].append(data)

        await t.subscribe(topic, handler, lambda d, p: True)
        task_status.started()
        await stop.wait()
