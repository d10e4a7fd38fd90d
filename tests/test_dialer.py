"""`atdnode.dialer` in running daemons (in-memory transport): a member that goes away is
reported once as unreachable (log line and status), and once back, reachable again."""
from __future__ import annotations

import logging
from pathlib import Path

import trio

from atdnode.transport.memory import MemoryNetwork
from ledger import Ledger
from tests.factories import daemon_on, make_consortium, wait_for


def _has_hello(home, peer: str) -> bool:
    from ledger.keys import peer_id_from_public_key

    with Ledger.open(home.ledger_db) as led:
        return any(peer_id_from_public_key(e.author) == peer for e in led.query(kind="hello"))


def test_unreachable_member_is_one_warning_and_in_status(tmp_path: Path, caplog) -> None:
    homes = make_consortium(tmp_path, 2)
    net = MemoryNetwork(seed=26)

    async def main() -> None:
        d0 = daemon_on(net, homes[0])
        d0.dialer.policy.unreachable_after_s = 1.0
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            d1 = daemon_on(net, homes[1])
            peer1 = d1.transport.peer_id
            async with trio.open_nursery() as inner:
                await inner.start(d1.run, [], [a0[0]])
                await wait_for(lambda: _has_hello(homes[0], peer1), "d1's hello reaches d0")
                d1.stop()
            await wait_for(lambda: peer1 in d0.dialer.status()["unreachable"], "d1 reported unreachable")
            status = await d0.status()
            assert status["unreachable"][peer1] >= 1.0 and status["members"] == 1 and status["peers"] == []
            await trio.sleep(2.0)  # several more failed dials and discovery ticks: still one line
            d1 = daemon_on(net, homes[1])
            await nursery.start(d1.run, [], [])  # back, without dialling d0 itself: d0 must find it
            await wait_for(lambda: peer1 in d0.transport.peers(), "d0 reconnects to d1")
            await wait_for(lambda: not d0.dialer.status()["unreachable"], "no longer unreachable")
            d0.stop()
            d1.stop()

    with caplog.at_level(logging.INFO, logger="atd.daemon"):
        trio.run(main)
    said = [r for r in caplog.records if "unreachable for" in r.getMessage()]
    assert len(said) == 1 and said[0].getMessage().startswith("member ") and said[0].levelno == logging.WARNING
    assert sum("reachable again" in r.getMessage() for r in caplog.records) == 1
