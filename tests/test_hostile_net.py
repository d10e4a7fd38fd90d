"""Hostile peers cost a node nothing lasting: refused dials and members that come and go give
back their inbound connection slots, and a peer writing past the yamux receive window it was
granted is disconnected with its bytes dropped. Real py-libp2p hosts on 127.0.0.1, in this
process (`netsim.hostile` speaks the wire: Noise, yamux, raw DATA frames)."""
from __future__ import annotations

import importlib
import importlib.metadata

import pytest
import trio
from libp2p.stream_muxer.yamux.yamux import Yamux

from atdnode.transport._libp2p.yamux import TunedYamux
from atdnode.transport.base import Libp2pVersionError
from atdnode.transport import Libp2pTransport
from netsim.hostile import MiB, dial_cycles, flood_stream, members_only
from tests.factories import run, wait_for

LISTEN = ["/ip4/127.0.0.1/tcp/0"]
NODE, MEMBER, OUTSIDER, FRESH = bytes([71]) * 32, bytes([72]) * 32, bytes([73]) * 32, bytes([74]) * 32
STOCK_SLOTS = 250  # py-libp2p's inbound slots (max_connections 300 - min_connections 50)


ROUND, MAX_ROUNDS = 1000, 10  # refused dials per round; rounds before the test gives up


async def _member_connect_s() -> float:
    """Seconds a member takes to connect to a fresh node of its own (the baseline the later
    bound is relative to: the same machine under the same load)."""
    fresh = members_only(FRESH, [MEMBER])
    member = Libp2pTransport(MEMBER)
    async with fresh.run(LISTEN), member.run(LISTEN):
        t0 = trio.current_time()
        assert await member.connect(fresh.addrs()[0]) == fresh.peer_id
        return trio.current_time() - t0


async def _member_connects(node: Libp2pTransport, baseline: float) -> None:
    """A member connects within 10x the `baseline` connect (at least 2 s): a member locked out
    never connects at all. Its connection holds the node's only slot."""
    member = Libp2pTransport(MEMBER)
    async with member.run(LISTEN):
        with trio.fail_after(max(2.0, 10 * baseline)):
            assert await member.connect(node.addrs()[0]) == node.peer_id
        await wait_for(lambda: member.peer_id in node.peers(), "the node to list the member")
        assert node.inbound_slots() == 1


@pytest.mark.slow
def test_a_member_connects_after_a_thousand_refused_dials() -> None:
    """An outsider dials in rounds of 1,000 (8 at a time), each dial a full Noise + yamux upgrade
    the node then closes, until the membership gate alone has refused more connections than
    py-libp2p has inbound slots (most dials are refused before the gate, by py-libp2p's
    resource manager or its per-peer limit, and how many depends on the machine's load: the
    gate's count is the readiness signal, the rounds are bounded). A member then still
    connects within 10x its connect time to a fresh node, holding the only slot."""

    async def body() -> None:
        baseline = await _member_connect_s()
        node = members_only(NODE, [MEMBER])
        async with node.run(LISTEN):
            t0 = trio.current_time()
            for _ in range(MAX_ROUNDS):
                dials = await dial_cycles(node.addrs()[0], OUTSIDER, ROUND, concurrency=8)
                assert dials.upgraded == dials.closed_by_node == ROUND, dials  # every one admitted, then refused
                if node.gated_connections > STOCK_SLOTS:  # more refusals than slots: no-op would lock out
                    break
            assert node.gated_connections > STOCK_SLOTS, f"the gate refused {node.gated_connections} in {MAX_ROUNDS} rounds"
            await wait_for(lambda: node.inbound_slots() == 0, "the refused dials' slots back",
                           timeout=max(10.0, trio.current_time() - t0))
            await _member_connects(node, baseline)

    run(body, timeout=600)


@pytest.mark.slow
def test_two_hundred_member_connections_that_come_and_go_give_their_slots_back() -> None:
    """A member connects and leaves 200 times, one connection at a time (it waits for the
    node's pubsub stream, then closes): no slot stays taken, and the member
    connects within 10x its connect time to a fresh node."""

    async def body() -> None:
        baseline = await _member_connect_s()
        node = members_only(NODE, [MEMBER])
        async with node.run(LISTEN):
            churn = await dial_cycles(node.addrs()[0], MEMBER, 200, concurrency=1, leave=True)
            # the node took each one, then we left (after its first stream) or it closed it (a
            # new connection while the member's last one is still being torn down)
            assert churn.upgraded == churn.left + churn.closed_by_node == 200 and churn.left > 0, churn
            await wait_for(lambda: node.inbound_slots() == 0 and not node.peers(), "every slot back", timeout=10)
            await _member_connects(node, baseline)

    run(body, timeout=300)


@pytest.mark.parametrize("muxer", [Yamux, TunedYamux], ids=["stock", "tuned"])
def test_a_peer_writing_past_its_receive_window_is_cut_off_and_costs_no_memory(muxer: type) -> None:
    """A member writes 512 MiB in 1 MiB DATA frames, ignoring the window, on the pubsub stream
    the node opened to it and never reads: the node disconnects it at the first frame past the
    window and its RSS grows by < 16 MB (without the check: by every byte sent). A member that
    fills the same window exactly, and no more, stays connected."""
    total = 512 * MiB

    async def body() -> None:
        node = members_only(NODE, [MEMBER], muxer=muxer)
        async with node.run(LISTEN):
            addr = node.addrs()[0]
            honest = await flood_stream(addr, MEMBER, total=total, within_window=True, stall=0.3)
            assert honest.sent == honest.granted > 0 and not honest.closed_by_node, honest
            await wait_for(lambda: not node.peers(), "the honest member to leave")
            hostile = await flood_stream(addr, MEMBER, total=total)
            assert hostile.closed_by_node and hostile.sent < total // 16, hostile  # stopped early
            assert hostile.rss_growth < 16 * MiB, hostile
            await wait_for(lambda: not node.peers(), "the node to drop the member")

    run(body, timeout=120)


def test_the_libp2p_patches_refuse_any_other_libp2p_version(monkeypatch) -> None:
    """The py-libp2p patches load only on the py-libp2p version they were written for: on any
    other, importing them raises one typed error naming both versions."""
    import atdnode.transport._libp2p as patches

    assert importlib.metadata.version("libp2p") == patches.WRITTEN_FOR
    patches.check_version(patches.WRITTEN_FOR)  # the installed one passes
    for other in ("0.8.2", "0.9.0", None):
        with pytest.raises(Libp2pVersionError, match=f"written for py-libp2p {patches.WRITTEN_FOR}"):
            patches.check_version(other)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.8.0")
    try:
        with pytest.raises(Libp2pVersionError, match="found 0.8.0"):
            importlib.reload(patches)
    finally:
        monkeypatch.undo()
        importlib.reload(patches)
