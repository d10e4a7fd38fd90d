"""`atdnode.peers.dialer` in running daemons (in-memory transport): a member that goes away is
reported once as unreachable (log line and status), and once back, reachable again."""
from __future__ import annotations

import logging
from pathlib import Path

import trio

from atdnode.transport import MemoryNetwork
from ledger import Ledger
from tests.factories import daemon_on, make_consortium, wait_for


def _has_hello(home, peer: str) -> bool:
    from ledger.keys import peer_id_from_public_key

    with Ledger.open(home.ledger_db) as led:
        return any(peer_id_from_public_key(e.author) == peer for e in led.query(kind="hello"))


def test_unreachable_member_is_one_warning_and_in_status(tmp_path: Path, caplog) -> None:
    from atdnode.node import NodeConfig

    homes = make_consortium(tmp_path, 2)
    cfg = NodeConfig.load(homes[0])
    cfg.extra["peers"] = {"redial_after_s": 0.0}  # d0 dials d1 again as soon as it is gone (default: 30 s later)
    cfg.save(homes[0])
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


def test_a_member_whose_port_changes_is_reached_at_its_new_address() -> None:
    """Real py-libp2p hosts on 127.0.0.1: B restarts with the same key on a new port.
    A's dial of B's old address fails (py-libp2p then caches the failure for 60 s for B's peer
    id: "recently failed all addresses (negative cache)"); A's next dial, to B's new address,
    must reach B at once. Fails without `libp2p_host.forget_dial_state` (libp2p_transport.connect)."""
    import pytest

    from atdnode.transport import Libp2pTransport, TransportError

    listen = ["/ip4/127.0.0.1/tcp/0"]
    key_b = bytes([62]) * 32

    async def main() -> None:
        a = Libp2pTransport(bytes([61]) * 32)
        async with a.run(listen):
            b = Libp2pTransport(key_b)
            async with b.run(listen):
                old = b.addrs()[0]
                assert await a.connect(old) == b.peer_id
            await wait_for(lambda: b.peer_id not in a.peers(), "A to see B's connection close")
            with pytest.raises(TransportError):
                await a.connect(old)  # B is gone from there
            b = Libp2pTransport(key_b)
            async with b.run(listen):
                new = b.addrs()[0]
                assert new != old and new.endswith(b.peer_id)
                with trio.fail_after(10):
                    assert await a.connect(new) == b.peer_id
                assert b.peer_id in a.peers()

    trio.run(main)


def _pace_dialer(members: frozenset[str]):
    """The parts of a PeerDialer that RotationPace reads: stats, member set, config, failing dials."""
    from types import SimpleNamespace

    from atdnode.peers import PeerSetConfig

    d = SimpleNamespace(stats={"sync_added": 0}, gate=SimpleNamespace(members=members),
                        peerset=SimpleNamespace(cfg=PeerSetConfig(rotate_s=60.0, rotate_idle_s=600.0)))
    return SimpleNamespace(d=d, hellos_seen=0, policy=SimpleNamespace(failing=lambda: []))


def test_rotation_pace_ignores_connect_pulls_and_new_hellos_but_not_periodic_pulls_or_members() -> None:
    """Entries a new connection's pull brought (start-up, a node back from away) and
    new hellos (members starting) kept every node of a starting consortium rotating every
    rotate_s; entries only periodic sync found, or a changed member set, still do."""
    from atdnode.peers.dialer import RotationPace

    dialer = _pace_dialer(frozenset({"a", "b"}))
    pace = RotationPace(dialer, 0.0)
    assert pace.due() == 120.0  # quiet since the start: the interval after rotate_s
    dialer.d.stats["sync_added"] += 40  # connect pulls at start-up
    dialer.hellos_seen += 5  # members said hello
    dialer.d.gate.members = frozenset({"a", "b"})  # re-read, unchanged
    assert pace.due() == 120.0
    pace.rotated(120.0)
    assert pace.due() == 120.0 + 240.0  # still quiet: spaced out further
    dialer.d.stats["anti_entropy_added"] = 1  # a periodic pull found what gossip had not
    assert pace.due() == 120.0 + 60.0
    pace.rotated(180.0)
    assert pace.due() == 180.0 + 120.0
    dialer.d.gate.members = frozenset({"a", "b", "c"})  # admitted a member
    assert pace.due() == 180.0 + 60.0
    # what made each rotation due, in the daemon's stats (`atd node status`)
    assert dialer.d.stats.get("rotations_quiet") == 1 and dialer.d.stats.get("rotations_learned") == 1


def test_a_settled_daemon_dials_a_member_as_soon_as_its_first_hello_arrives(tmp_path: Path) -> None:
    """d1 holds every member it has an address for (d0; d2 has said no hello yet), so its
    peer-set loop idles for IDLE_TICK_S. d2 starts, bootstrapping from d0 only, and dials
    nobody itself (`[peers] target = 1`): d1 must dial d2 once d2's hello reaches it, not at
    its next idle tick (`atd local up` waits for every daemon to reach every other)."""
    from atdnode.node import NodeConfig
    from atdnode.peers.dialer import IDLE_TICK_S

    homes = make_consortium(tmp_path, 3)
    cfg = NodeConfig.load(homes[2])
    cfg.extra["peers"] = {"target": 1}
    cfg.save(homes[2])
    net = MemoryNetwork(seed=27)

    async def main() -> None:
        d0, d1, d2 = (daemon_on(net, h) for h in homes)
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            peer0, peer2 = d0.transport.peer_id, d2.transport.peer_id
            await wait_for(lambda: set(d1.transport.peers()) == {peer0} and d1.replica.head_confirmed.is_set(),
                           "d1 connected to d0")
            await nursery.start(d2.run, [], [a0[0]])
            await wait_for(lambda: _has_hello(homes[1], peer2), "d2's hello reaches d1", interval=0.01)
            heard = trio.current_time()
            await wait_for(lambda: peer2 in d1.transport.peers(), "d1 dials d2", interval=0.01)
            assert trio.current_time() - heard < IDLE_TICK_S / 2
            assert d1.transport.dialled(peer2) is True  # d1 dialled d2, not d2 d1
            for d in (d0, d1, d2):
                d.stop()

    trio.run(main)


def test_a_flood_of_hellos_runs_at_most_one_peer_set_round_per_gap(tmp_path: Path) -> None:
    """Every merged hello wakes the peer-set loop, but a member that floods hellos buys no more
    than one round per MIN_ROUND_GAP_S: a second of wake-ups every millisecond runs a handful
    of rounds, not hundreds."""
    from atdnode.peers.dialer import MIN_ROUND_GAP_S

    homes = make_consortium(tmp_path, 2)
    net = MemoryNetwork(seed=31)

    async def main() -> None:
        d0, d1 = (daemon_on(net, h) for h in homes)
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            await wait_for(lambda: d0.transport.peer_id in d1.transport.peers(), "d1 connected to d0")
            rounds: list[float] = []
            tick = d1.dialer._tick  # called once at the end of every peer-set round

            def counted(*args: object) -> float:
                rounds.append(trio.current_time())
                return tick(*args)

            d1.dialer._tick = counted
            start = trio.current_time()
            while trio.current_time() - start < 1.0:
                d1.dialer.hellos_changed()
                await trio.sleep(0.001)
            assert 1 <= len(rounds) <= 1.0 / MIN_ROUND_GAP_S + 2, len(rounds)
            for d in (d0, d1):
                d.stop()

    trio.run(main)
