"""LedgerAccess: calls off the event loop, serialised; after close() every call ends with
NodeStopping, and a stream handler that meets it during shutdown ends quietly on both
transports (it logged a SQLite "closed database" traceback before)."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import trio
import trio.testing

from atdnode.replication import LedgerAccess
from atdnode.replication.ledger_access import NodeStopping
from ledger import Ledger
from ledger.keys import Signer
from tests.factories import KINDS, run
from tests.factories import transports as nodes

PROTO = "/atd/test-stopping/1.0.0"


def test_calls_after_close_and_queued_behind_it_raise_node_stopping(tmp_path: Path) -> None:
    led = Ledger.open(tmp_path / "l.db")
    led.create_genesis(Signer.generate(), consortium="t")
    access = LedgerAccess(led)
    release = threading.Event()
    results: dict[str, object] = {}

    def slow(ledger: Ledger) -> int:
        release.wait(10)
        return len(ledger.all_entries())

    async def call(name: str, fn) -> None:
        try:
            results[name] = await access.run(fn)
        except NodeStopping as exc:
            results[name] = exc

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "first", slow)  # holds the one-call limiter
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(access.close)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(call, "queued", lambda ledger: len(ledger.all_entries()))
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        with pytest.raises(NodeStopping, match="shutting down"):
            await access.run(lambda ledger: ledger.all_entries())
        await access.close()  # twice is harmless

    trio.run(main)
    assert results["first"] == 1  # the call in progress finished on the open ledger
    assert isinstance(results["queued"], NodeStopping)


@pytest.mark.parametrize("kind", KINDS)
def test_a_handler_meeting_a_closed_ledger_ends_its_stream_quietly(kind: str, tmp_path: Path, caplog) -> None:
    led = Ledger.open(tmp_path / "l.db")
    access = LedgerAccess(led)
    served = trio.Event()

    async def handler(stream) -> None:
        try:
            await access.run(lambda ledger: ledger.all_entries())
        finally:
            served.set()

    async def body() -> None:
        await access.close()
        async with nodes(kind, 2) as (a, b):
            a.set_stream_handler(PROTO, handler)
            await b.connect(a.addrs()[0])
            s = await b.open_stream(a.peer_id, PROTO)
            await s.write_frame(b"x")
            with trio.fail_after(30):
                await served.wait()
            await s.close()

    with caplog.at_level(logging.DEBUG, logger="atdnode"):
        run(body)
    failed = [r for r in caplog.records if "stream handler" in r.getMessage() and r.levelno >= logging.ERROR]
    assert not failed, failed[0].getMessage()
    assert any("shutting down" in r.getMessage() for r in caplog.records)  # logged, at debug level
