"""The daemon on the in-memory transport: replication, validation, sync after absence, blob fetch.

These run several real `NodeDaemon`s (real ledgers, blob stores, control sockets) in one
trio run; only the network is simulated. Waits are on conditions with deadlines.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import trio

from atdnode.node import control
from atdnode.blobs import BlobStore
from atdnode.node import NodeDaemon, NodeHome, NodeIdentity
from atdnode.transport import MemoryNetwork, MemoryTransport
from ledger import Entry, Ledger
from tests.factories import append, cli, daemon_on, ids, make_consortium, wait_for, weights_body


def test_entries_replicate_and_late_node_catches_up(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 3)
    net = MemoryNetwork(seed=1)

    async def main() -> None:
        d = [daemon_on(net, h) for h in homes]
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d[0].run, [], [])
            await nursery.start(d[1].run, [], [a0[0]])
            # node 1 publishes while node 2 is still offline
            e1 = append(homes[1], "metrics", {"acc": 0.5})
            await wait_for(lambda: e1.id in ids(homes[0]), "entry from node 1 at node 0")
            await nursery.start(d[2].run, [], [a0[0]])
            e2 = append(homes[2], "metrics", {"acc": 0.7})
            await wait_for(lambda: ids(homes[0]) == ids(homes[1]) == ids(homes[2]) and e2.id in ids(homes[1]),
                           "all three ledgers to hold the same entries")
            st = await trio.to_thread.run_sync(control_status, homes[2])
            assert st["peer_id"] == NodeIdentity.load(homes[2]).peer_id
            for x in d:
                x.stop()
        for h in homes:
            Ledger.open(h.ledger_db).verify()

    trio.run(main)


def control_status(home: NodeHome) -> dict:
    # the CLI side of the control socket is blocking; from inside trio run it in a thread
    return control.call(home.control_socket, "status")


def test_non_member_entries_never_enter(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 2)
    outsider = tmp_path / "outsider"
    led = Ledger.open(homes[0].ledger_db)
    genesis = led.query(kind="genesis")[0].id.hex()
    led.close()
    cli("init", "--home", str(outsider), "--join", genesis)  # never admitted
    out_home = NodeHome.at(outsider)
    net = MemoryNetwork(seed=2)

    async def main() -> None:
        d0, d1 = daemon_on(net, homes[0]), daemon_on(net, homes[1])
        rogue = MemoryTransport(net, NodeIdentity.load(out_home).signer.seed)
        bad = append(out_home, "metrics", {"spam": True})
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            async with rogue.run([]):
                await rogue.connect(a0[0])
                await rogue.subscribe(d0.topic, _ignore, lambda data, peer: True)
                await wait_for(lambda: d0.topic and d0.transport.peers(), "rogue connected")
                await rogue.publish(d0.topic, bad.to_bytes())
                good = append(homes[1], "metrics", {"ok": 1})
                await wait_for(lambda: good.id in ids(homes[0]), "a member's entry after the rogue one")
            assert bad.id not in ids(homes[0]) and bad.id not in ids(homes[1])
            # members only: the outsider was refused and disconnected, its gossip never got in
            assert rogue.peer_id in d0.gate.refused and rogue.peer_id not in d0.transport.peers()
            d0.stop()
            d1.stop()

    trio.run(main)


async def _ignore(data: bytes, peer: str) -> None:
    return None


def test_blob_announced_by_weights_entry_is_fetched(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 2)
    payload = bytes(range(256)) * 20_000  # 5 MB, several chunks
    store0 = BlobStore(homes[0].blobs_dir)
    blob = store0.put_bytes(payload)
    manifest = store0.manifest(blob)
    net = MemoryNetwork(seed=3)

    async def main() -> None:
        d0, d1 = daemon_on(net, homes[0]), daemon_on(net, homes[1])
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            append(homes[0], "weights", weights_body(blob, manifest.hash, len(payload), part="extractor"))
            store1 = BlobStore(homes[1].blobs_dir)
            await wait_for(lambda: store1.has(blob), "node 1 to auto-fetch the announced blob", timeout=60)
            assert store1.get_bytes(blob) == payload
            d0.stop()
            d1.stop()

    trio.run(main)


def test_second_daemon_on_same_home_is_refused(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 1)
    net = MemoryNetwork(seed=4)

    async def main() -> None:
        d0 = daemon_on(net, homes[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(d0.run, [], [])
            twin = daemon_on(MemoryNetwork(seed=5), homes[0])
            with pytest.raises(Exception, match="already runs"):
                await twin.run([], [])
            d0.stop()

    trio.run(main)


def test_restart_mid_fetch_resumes_instead_of_starting_over(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 2)
    store0 = BlobStore(homes[0].blobs_dir)
    payload = bytes(range(256)) * (4 * 4096 * 8)  # 8 MiB = 8 chunks
    blob = store0.put_bytes(payload)
    total_chunks = store0.manifest(blob).num_chunks
    append(homes[0], "weights", weights_body(blob, store0.manifest(blob).hash, len(payload)))
    net = MemoryNetwork(seed=6)
    from atdnode.transport import LinkConditions

    async def first_run() -> None:
        d0, d1 = daemon_on(net, homes[0]), daemon_on(net, homes[1])
        d1.auto_fetch = False
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            await wait_for(lambda: d1.transport.peers(), "connection")
            # a slow link: ~1 chunk per 0.2 s, so the fetch is still running when node 1 stops
            net.set_link(d0.transport.peer_id, d1.transport.peer_id, LinkConditions(bandwidth_Bps=5 << 20))
            fetch_scope = trio.CancelScope()

            async def fetch_until_cancelled() -> None:
                with fetch_scope:
                    await d1.fetch(blob)

            nursery.start_soon(fetch_until_cancelled)
            await wait_for(lambda: _chunks_fetched(d1, blob) >= 2, "some chunks fetched", timeout=30)
            fetch_scope.cancel()  # node 1 shuts down mid-fetch
            d1.stop()
            d0.stop()

    trio.run(first_run)
    store1 = BlobStore(homes[1].blobs_dir)
    assert not store1.has(blob)
    net2 = MemoryNetwork(seed=7)

    async def second_run() -> dict:
        d0, d1 = daemon_on(net2, homes[0]), daemon_on(net2, homes[1])
        d1.auto_fetch = False
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            await wait_for(lambda: d1.transport.peers(), "connection")
            await d1.fetch(blob)
            report = d1.fetch_report(blob)
            d1.stop()
            d0.stop()
        return report

    report = trio.run(second_run)
    assert BlobStore(homes[1].blobs_dir).get_bytes(blob) == payload
    assert report["resumed_chunks"] >= 2
    chunk = store0.manifest(blob).chunk_size
    assert report["resumed_chunks"] < total_chunks
    assert report["bytes"] <= (total_chunks - report["resumed_chunks"]) * chunk


def _chunks_fetched(d: NodeDaemon, blob: str) -> int:
    rep = d.blobs.fetcher.reports.get(blob)
    return sum(rep.chunks_from.values()) if rep else 0


def test_gossiped_entry_with_bad_signature_is_dropped(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 2)
    net = MemoryNetwork(seed=8)

    async def main() -> None:
        d0, d1 = daemon_on(net, homes[0]), daemon_on(net, homes[1])
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            await wait_for(lambda: d1.transport.peers(), "connection")
            # a member's genuine entry, signature flipped in transit (never stored by its author)
            ident = NodeIdentity.load(homes[1])
            forged = Entry.create(ident.signer, seq=99, prev=b"\x01" * 32, lamport=99, kind="metrics", body={"x": 1})
            raw = bytearray(forged.to_bytes())
            raw[-1] ^= 0x01
            await d1.transport.publish(d1.topic, bytes(raw))
            good = append(homes[1], "metrics", {"ok": 2})
            await wait_for(lambda: good.id in ids(homes[0]), "the member's next genuine entry")
            assert forged.id not in ids(homes[0])
            assert d0.stats["gossip_rejected"] >= 1
            d0.stop()
            d1.stop()

    trio.run(main)
