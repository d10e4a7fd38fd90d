"""One contract suite, run against both transports (in-memory and real py-libp2p).

Every wait has a deadline (trio.fail_after); nothing sleeps for a fixed time.
"""
from __future__ import annotations

import pytest
import trio
import trio.testing

from atdnode.transport import (MAX_FRAME, MAX_GOSSIP, FrameError, LinkConditions, MemoryNetwork, StreamClosed,
                               Transport, TransportError)
from atdnode.transport.framing import HEADER
from atdnode.transport.memory import peer_id_from_seed
from tests.factories import KINDS, run, seed, wait_for
from tests.factories import transports as nodes

TOPIC = "atd/test/1"
ECHO = "/atd/test-echo/1.0.0"


async def star(ts: list[Transport], topic: str | None = TOPIC) -> None:
    """Connect nodes 1.. to node 0 (and chain, so relaying matters) and wait for subscriptions to propagate."""
    for i in range(1, len(ts)):
        await ts[i].connect(ts[0].addrs()[0])
    if topic is not None:
        for i in range(1, len(ts)):
            await wait_for(lambda i=i: ts[0].peer_id in ts[i].topic_peers(topic) and ts[i].peer_id in ts[0].topic_peers(topic))


def test_memory_peer_id_matches_libp2p() -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    for i in range(3):
        assert peer_id_from_seed(seed(i)) == ID.from_pubkey(create_new_key_pair(seed(i)).public_key).to_base58()


@pytest.mark.parametrize("kind", KINDS)
def test_connect_and_peer_listener(kind: str) -> None:
    async def body() -> None:
        async with nodes(kind, 2) as (a, b):
            seen_a: list[str] = []
            seen_b: list[str] = []
            dialled: dict[str, bool | None] = {}  # each end's `dialled` when the connection is announced

            async def la(p: str) -> None:
                seen_a.append(p)
                dialled["a"] = a.dialled(p)

            async def lb(p: str) -> None:
                seen_b.append(p)
                dialled["b"] = b.dialled(p)

            a.on_peer_connected(la)
            b.on_peer_connected(lb)
            assert a.addrs()[0].endswith(f"/p2p/{a.peer_id}")
            assert a.peer_id == peer_id_from_seed(seed(0))
            got = await b.connect(a.addrs()[0])
            assert got == a.peer_id
            await wait_for(lambda: seen_a == [b.peer_id] and seen_b == [a.peer_id])
            assert a.peers() == [b.peer_id] and b.peers() == [a.peer_id]
            await b.connect(a.addrs()[0])  # idempotent; listeners fire once per peer
            assert seen_b == [a.peer_id]
            assert dialled == {"a": False, "b": True}  # b dialled a (atdnode.replication.sync_connect: b pulls at once)
            assert b.dialled(a.peer_id) is True and a.dialled(b.peer_id) is False
            assert a.dialled(peer_id_from_seed(seed(5))) is None  # not connected: unknown

    run(body)


@pytest.mark.parametrize("kind", KINDS)
def test_peer_that_returns_is_announced_again(kind: str) -> None:
    async def body() -> None:
        net = MemoryNetwork(seed=1)
        async with nodes(kind, 1, net=net) as (a,):
            seen: list[str] = []

            async def listener(p: str) -> None:
                seen.append(p)

            a.on_peer_connected(listener)
            for round_ in (1, 2):  # the same node (same key) goes away and comes back
                async with nodes(kind, 1, net=net, first=1) as (b,):
                    await b.connect(a.addrs()[0])
                    await wait_for(lambda: len(seen) == round_)
                await wait_for(lambda: a.peers() == [])
            assert seen == [peer_id_from_seed(seed(1))] * 2

    run(body)


@pytest.mark.parametrize("kind", KINDS)
def test_connect_failure_is_transport_error(kind: str) -> None:
    async def body() -> None:
        async with nodes(kind, 1) as (a,):
            bad = a.addrs()[0].rsplit("/p2p/", 1)[0] + "/p2p/" + peer_id_from_seed(seed(9))
            with pytest.raises(TransportError):
                await a.connect(bad)
            with pytest.raises(TransportError):
                await a.connect("/not/an/addr")

    run(body)


@pytest.mark.parametrize("kind", KINDS)
def test_gossip_delivery_and_validator_rejection_not_relayed(kind: str) -> None:
    async def body() -> None:
        # chain a - b - c: c only hears what b relays
        async with nodes(kind, 3) as (a, b, c):
            got: dict[str, list[tuple[bytes, str]]] = {t.peer_id: [] for t in (a, b, c)}
            calls: dict[str, int] = {t.peer_id: 0 for t in (a, b, c)}
            for t in (a, b, c):

                async def handler(data: bytes, frm: str, t=t) -> None:
                    got[t.peer_id].append((data, frm))

                def validator(data: bytes, frm: str, t=t) -> bool:
                    calls[t.peer_id] += 1
                    return not data.startswith(b"bad")

                await t.subscribe(TOPIC, handler, validator)
            await b.connect(a.addrs()[0])
            await c.connect(b.addrs()[0])
            for x, y in ((a, b), (b, c)):
                await wait_for(lambda x=x, y=y: y.peer_id in x.topic_peers(TOPIC) and x.peer_id in y.topic_peers(TOPIC))
            await a.publish(TOPIC, b"bad entry")
            await a.publish(TOPIC, b"good entry")
            await wait_for(lambda: len(got[c.peer_id]) == 1)
            assert got[b.peer_id] == [(b"good entry", a.peer_id)]
            assert got[c.peer_id] == [(b"good entry", b.peer_id)]  # from_peer is the forwarder
            assert got[a.peer_id] == []  # own messages are not delivered back
            # b saw the bad one and rejected it; c never saw it (not relayed)
            assert calls[b.peer_id] == 2
            assert calls[c.peer_id] == 1
            with pytest.raises(TransportError):
                await a.publish(TOPIC, b"x" * (MAX_GOSSIP + 1))

    run(body)


@pytest.mark.parametrize("kind", KINDS)
def test_stream_frames_round_trip(kind: str) -> None:
    async def body() -> None:
        async with nodes(kind, 2) as (a, b):
            async def echo(stream) -> None:
                assert stream.remote_peer == b.peer_id
                while True:
                    try:
                        frame = await stream.read_frame()
                    except StreamClosed:
                        return
                    await stream.write_frame(frame)

            a.set_stream_handler(ECHO, echo)
            await b.connect(a.addrs()[0])
            s = await b.open_stream(a.peer_id, ECHO)
            assert s.remote_peer == a.peer_id
            payloads = [b"", b"x", bytes(range(256)) * 300, b"\x00" * (4 << 20)]
            for p in payloads:
                await s.write_frame(p)
                assert await s.read_frame() == p
            await s.close()
            with pytest.raises(StreamClosed):
                await s.read_frame()
            assert b.bytes_counters()["sent"] >= sum(map(len, payloads))
            with pytest.raises(TransportError):
                await b.open_stream(a.peer_id, "/atd/nope/1.0.0")

    run(body)


@pytest.mark.parametrize("kind", KINDS)
def test_oversize_and_truncated_frames(kind: str) -> None:
    async def body() -> None:
        async with nodes(kind, 2) as (a, b):
            outcomes: list[object] = []
            served = trio.Event()

            async def strict(stream) -> None:
                try:
                    outcomes.append(await stream.read_frame(max_size=1024))
                except TransportError as e:
                    outcomes.append(e)
                served.set()

            a.set_stream_handler(ECHO, strict)
            await b.connect(a.addrs()[0])
            s = await b.open_stream(a.peer_id, ECHO)
            await s.write_frame(b"y" * 2048)  # above the reader's limit
            with trio.fail_after(10):
                await served.wait()
            assert isinstance(outcomes[0], FrameError) and "exceeds" in str(outcomes[0])
            with pytest.raises(TransportError):  # reader reset the stream
                with trio.fail_after(10):
                    await s.read_frame()

            served = trio.Event()
            s2 = await b.open_stream(a.peer_id, ECHO)
            await s2.raw.send_all(HEADER.pack(100) + b"short")  # header promises 100 bytes
            await s2.close()
            with trio.fail_after(10):
                await served.wait()
            assert isinstance(outcomes[1], FrameError) and "ended inside" in str(outcomes[1])
            # the connection survives: a fresh stream still works
            served = trio.Event()
            s3 = await b.open_stream(a.peer_id, ECHO)
            await s3.write_frame(b"fine")
            await s3.close()
            with trio.fail_after(10):
                await served.wait()
            assert outcomes[2] == b"fine"
            assert a.peers() == [b.peer_id]
            assert MAX_FRAME >= 4 << 20

    run(body)


@pytest.mark.parametrize("kind", KINDS)
def test_burst_500_entries_5_nodes_all_delivered(kind: str) -> None:
    async def body() -> None:
        async with nodes(kind, 5) as ts:
            got: dict[str, set[bytes]] = {t.peer_id: set() for t in ts}
            for t in ts:

                async def handler(data: bytes, frm: str, t=t) -> None:
                    got[t.peer_id].add(data)

                await t.subscribe(TOPIC, handler, lambda d, f: True)
            # a line 0-1-2-3-4 plus one chord: messages must be relayed through several hops
            for i in range(1, 5):
                await ts[i].connect(ts[i - 1].addrs()[0])
            await ts[4].connect(ts[0].addrs()[0])
            for i in range(1, 5):
                for j in (i - 1,):
                    await wait_for(lambda i=i, j=j: ts[j].peer_id in ts[i].topic_peers(TOPIC) and ts[i].peer_id in ts[j].topic_peers(TOPIC))
            sent: dict[str, set[bytes]] = {t.peer_id: set() for t in ts}
            # 500 entries of 1 KB, in bursts of 50 from rotating publishers, no pauses inside a burst
            for burst in range(10):
                pub = ts[burst % 5]
                for k in range(50):
                    data = f"{burst}:{k}:".encode() + b"e" * 1000
                    await pub.publish(TOPIC, data)
                    sent[pub.peer_id].add(data)
            everything = set().union(*sent.values())
            assert len(everything) == 500
            await wait_for(lambda: all(got[t.peer_id] == everything - sent[t.peer_id] for t in ts), timeout=60)

    run(body, timeout=120)


def test_memory_link_latency_loss_partition_counters() -> None:
    async def body() -> None:
        net = MemoryNetwork(seed=3)
        events: list[tuple] = []
        net.add_observer(lambda *e: events.append(e))
        async with nodes("memory", 2, net=net) as (a, b):
            got: list[bytes] = []

            async def handler(data: bytes, frm: str) -> None:
                got.append(data)

            await b.subscribe(TOPIC, handler, lambda d, f: True)
            await a.connect(b.addrs()[0])
            net.set_link(a.peer_id, b.peer_id, LinkConditions(latency_s=0.05, bandwidth_Bps=1e6))
            t0 = trio.current_time()
            await a.publish(TOPIC, b"z" * 10_000)  # 10 ms serialization + 50 ms latency
            await wait_for(lambda: len(got) == 1)
            assert trio.current_time() - t0 >= 0.06
            # loss = 1 drops gossip but counts it
            net.set_link(a.peer_id, b.peer_id, LinkConditions(loss=1.0))
            await a.publish(TOPIC, b"lost")
            assert net.link_stats()[(a.peer_id, b.peer_id)]["dropped"] == 1
            # partition: streams stall, then flow after heal
            net.set_link(a.peer_id, b.peer_id, LinkConditions())

            async def echo(stream) -> None:
                await stream.write_frame(await stream.read_frame())

            b.set_stream_handler(ECHO, echo)
            s = await a.open_stream(b.peer_id, ECHO)
            net.partition({a.peer_id}, {b.peer_id})
            await a.publish(TOPIC, b"during partition")
            answered = trio.Event()

            async def talk() -> None:
                await s.write_frame(b"hello")
                assert await s.read_frame() == b"hello"
                answered.set()

            async with trio.open_nursery() as n:
                n.start_soon(talk)
                with trio.move_on_after(0.2):
                    await answered.wait()
                assert not answered.is_set()
                net.heal()
                with trio.fail_after(5):
                    await answered.wait()
            assert got == [b"z" * 10_000]
            stats = net.node_stats(a.peer_id)
            assert stats["sent"] >= 10_000 and any(e[2] == "stream" for e in events)
            assert a.bytes_counters()["sent"] > 10_000

    trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0))


def test_memory_loss_is_deterministic_with_seed() -> None:
    def once(s: int) -> list[bool]:
        out: list[bool] = []

        async def body() -> None:
            net = MemoryNetwork(seed=s)
            async with nodes("memory", 2, net=net) as (a, b):
                await b.subscribe(TOPIC, lambda d, f: trio.lowlevel.checkpoint(), lambda d, f: True)
                await a.connect(b.addrs()[0])
                net.set_link(a.peer_id, b.peer_id, LinkConditions(loss=0.5))
                for i in range(40):
                    before = net.link_stats()[(a.peer_id, b.peer_id)]["dropped"]
                    await a.publish(TOPIC, b"m%d" % i)
                    out.append(net.link_stats()[(a.peer_id, b.peer_id)]["dropped"] > before)

        trio.run(body)
        return out

    assert once(1) == once(1)
    assert once(1) != once(2)
    assert 5 < sum(once(1)) < 35
