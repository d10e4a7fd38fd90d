"""The in-memory back-end at scale: the gossip mesh bounds fan-out and still
delivers; a restarted daemon gossips only what it never announced; a sync between peers
in step sends nothing, a malformed heads map is still refused."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from atdnode.replication import SyncProtocolError
from atdnode.replication.sync import _missing_raw
from atdnode.transport import LinkConditions, MemoryNetwork, MemoryTransport
from ledger import Ledger, Signer
from netsim.memnet import MemCluster, simulate
from netsim.scenario import NetworkSpec

TOPIC = "/t"
N, DEGREE, MSGS = 40, 8, 12


def _seed(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def _gossip_run(mesh: tuple[int, int, int] | None) -> tuple[list[int], list[int], int]:
    """N nodes, each dialling DEGREE random others; MSGS messages from different nodes.
    Returns (messages each node delivered, each node's mesh size, gossip copies sent)."""
    net = MemoryNetwork(seed=3, default=LinkConditions(latency_s=0.01))
    ts = [MemoryTransport(net, _seed(i), mesh=mesh) for i in range(N)]
    got = [0] * N
    sizes: list[int] = []
    rng = random.Random(5)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await _start_counting(nursery, ts, got)
            for i, t in enumerate(ts):
                for j in rng.sample([j for j in range(N) if j != i], DEGREE // 2):
                    await t.connect(ts[j].addrs()[0])
            for k in range(MSGS):
                await ts[(7 * k) % N].publish(TOPIC, b"m%d" % k)
                await trio.sleep(0.5)
            sizes.extend(len(t.mesh_peers(TOPIC)) for t in ts)
            nursery.cancel_scope.cancel()

    simulate(main, seed=1)
    copies = sum(s["messages"] for s in net.link_stats().values())
    return got, sizes, copies


async def _start_counting(nursery: trio.Nursery, ts: list[MemoryTransport], got: list[int]) -> None:
    """Subscribe each transport to TOPIC (counting deliveries in `got`) and run it."""
    for i, t in enumerate(ts):
        async def on_msg(_data: bytes, _frm: str, i: int = i) -> None:
            got[i] += 1

        await t.subscribe(TOPIC, on_msg, lambda _d, _f: True)
        await nursery.start(_serve, t)


async def _serve(t: MemoryTransport, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with t.run([]):
        task_status.started()
        await trio.sleep_forever()


def test_mesh_bounds_fan_out_and_still_delivers_everything() -> None:
    flood_got, _, flood_copies = _gossip_run(None)
    got, sizes, copies = _gossip_run((3, 2, 6))
    publishers = {(7 * k) % N for k in range(MSGS)}
    everything = [MSGS - (i in publishers) for i in range(N)]  # a publisher delivers none to itself
    assert flood_got == everything
    assert got == everything  # over the mesh alone (no sync here)
    assert all(2 <= s <= 6 for s in sizes), sizes  # D_low <= mesh <= D_high
    # a connection degree of about 8 floods each message over ~8 links per node; the mesh over <= 6
    assert copies <= MSGS * N * 6 and copies < 0.75 * flood_copies, (copies, flood_copies)


def test_mesh_degrees_are_checked() -> None:
    with pytest.raises(ValueError):
        MemoryTransport(MemoryNetwork(), _seed(1), mesh=(3, 4, 6))


def test_restart_gossips_only_entries_never_announced(tmp_path: Path) -> None:
    """A daemon restarted after a clean stop gossips the entry written while it was down
    (as a CLI would), not its older entries (the home's `announced` file)."""
    names = ["n0", "n1", "n2"]
    c = MemCluster(tmp_path, names, seed=4, network=NetworkSpec(latency_ms=5), sync_interval=30.0,
                   poll_interval=0.1, established=True)
    out: dict = {}

    async def main() -> None:
        async with c.running():
            await c.start("n0")
            for n in names[1:]:
                await c.start(n, bootstrap=["n0"])
            pid = c.peer_ids["n1"]
            for k in range(3):
                last = await c.append("n1", "metrics", {"k": k})
            with trio.fail_after(20):
                while (await c.heads("n2")).get(pid, 0) < last:  # gossiped
                    await trio.sleep(0.05)
            await c.stop("n1")
            seq = await c.append("n1", "metrics", {"k": 3})  # written while down
            await c.restart("n1", bootstrap=["n0"])
            with trio.fail_after(20):
                for n in ("n0", "n2"):
                    while (await c.heads(n)).get(pid, 0) < seq:
                        await trio.sleep(0.05)
            await trio.sleep(1.0)  # the announce loop had time to re-gossip anything it would
            out["published"] = c.daemons["n1"].transport._seqno
            out["sync_pulls"] = c.daemons["n1"].stats["sync_pulls"]

    simulate(main, seed=4)
    assert out["published"] == 1  # only the entry written while it was down (not hello + 3 older)


def test_sync_in_step_sends_nothing_and_malformed_heads_are_refused(tmp_path: Path) -> None:
    signer = Signer.from_seed(_seed(9))
    with Ledger.open(tmp_path / "a.db") as led:
        g = led.create_genesis(signer, "c", [])
        for k in range(3):
            led.append(signer, "metrics", {"k": k})
        heads = led.heads()
        assert _missing_raw(led, dict(heads)) == []  # in step: nothing to send
        behind = {a: s - 2 for a, s in heads.items()}
        assert len(_missing_raw(led, behind)) == 2  # exactly the two it lacks
        assert len(_missing_raw(led, {})) == 4  # genesis + 3
        with pytest.raises(SyncProtocolError):
            _missing_raw(led, {b"short": 1})
        with pytest.raises(SyncProtocolError):
            _missing_raw(led, {g.author: "1"})


def test_mesh_drops_peers_behind_a_partition_and_refills_inside_it() -> None:
    """A mesh link found down (partition) leaves both meshes; the mesh refills from the
    node's own side, so gossip keeps reaching that side over the mesh alone."""
    net = MemoryNetwork(seed=8, default=LinkConditions(latency_s=0.01))
    ts = [MemoryTransport(net, _seed(100 + i), mesh=(3, 2, 6)) for i in range(16)]
    left = {t.peer_id for t in ts[:8]}
    got = [0] * 16
    out: dict = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await _start_counting(nursery, ts, got)
            for i, t in enumerate(ts):  # a ring plus chords: every node has neighbours on both sides
                for j in (i + 1, i + 5):
                    await t.connect(ts[j % 16].addrs()[0])
            await ts[0].publish(TOPIC, b"before")
            await trio.sleep(1.0)
            out["crossing_before"] = sum(1 for t in ts for p in t.mesh_peers(TOPIC) if (t.peer_id in left) != (p in left))
            net.partition(left, {t.peer_id for t in ts[8:]})
            for k in range(4):  # the first messages find the dead mesh links; later ones go round them
                await ts[k].publish(TOPIC, b"during%d" % k)
                await trio.sleep(1.0)
            out["crossing_after"] = sum(1 for t in ts for p in t.mesh_peers(TOPIC) if (t.peer_id in left) != (p in left))
            out["sizes"] = [len(t.mesh_peers(TOPIC)) for t in ts[:8]]
            got[:] = [0] * 16
            await ts[5].publish(TOPIC, b"last")
            await trio.sleep(1.0)
            nursery.cancel_scope.cancel()

    simulate(main, seed=2)
    assert out["crossing_before"] > 0  # the mesh did span the future cut
    assert out["crossing_after"] == 0, out
    assert all(s >= 2 for s in out["sizes"]), out["sizes"]  # refilled to at least D_low inside the side
    assert got[:5] + got[6:8] == [1] * 7 and sum(got[8:]) == 0  # the whole left side, nothing across the cut


def test_same_bytes_from_two_publishers_are_one_message() -> None:
    """Message ids are content ids (as on libp2p): an entry re-published by another node,
    or by a restarted one, is a duplicate everywhere; different bytes are not."""
    net = MemoryNetwork(seed=9)
    ts = [MemoryTransport(net, _seed(200 + i), mesh=(3, 2, 6)) for i in range(6)]
    got = [0] * 6

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await _start_counting(nursery, ts, got)
            for i in range(6):
                await ts[i].connect(ts[(i + 1) % 6].addrs()[0])
            await ts[0].publish(TOPIC, b"entry")
            await trio.sleep(0.5)
            await ts[3].publish(TOPIC, b"entry")  # the same bytes from elsewhere
            await ts[3].publish(TOPIC, b"other")
            await trio.sleep(0.5)
            nursery.cancel_scope.cancel()

    simulate(main, seed=3)
    assert got == [1, 2, 2, 1, 2, 2]  # "entry" once each (not at 0, its publisher), "other" everywhere but 3
