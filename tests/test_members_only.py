"""Members only, both ways: sync (serve and pull), blobs, split accept, gossip relay, merge.

Real `NodeDaemon`s (ledgers, blob stores) on the in-memory transport; the outsiders are
bare transports that speak the protocols directly, as an attacker's node would.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio
import trio.testing

from atdnode.replication.access import AccessRefused, is_refusal
from atdnode.blobs import PROTOCOL as BLOB_PROTOCOL, BlobStore, pack
from atdnode.node import NodeConfig, NodeHome, NodeIdentity
from atdnode.errors import ConfigError
from atdnode.replication import SYNC_PROTOCOL, LedgerAccess, pull
from atdnode.split.service import SPLIT_PROTOCOL, SplitService
from atdnode.split import RemoteError
from atdnode.split.session import ByteCounter, SplitChannel
from atdnode.blobs.wire import read_header, unpack
from atdnode.transport import MemoryNetwork, MemoryTransport
from ledger import Ledger
from tests.factories import append, cli, daemon_on, ids, make_consortium, wait_for, weights_body


class AcceptOnly(SplitService):
    """The split server's accept path only: its campaign is not started."""

    async def run(self, daemon) -> None:
        await trio.sleep_forever()


def _genesis(home: NodeHome) -> str:
    with Ledger.open(home.ledger_db) as led:
        return led.query(kind="genesis")[0].id.hex()


def _outsider(root: Path, home: NodeHome) -> NodeHome:
    cli("init", "--home", str(root / "outsider"), "--join", _genesis(home))  # never admitted
    return NodeHome.at(root / "outsider")


def _revoke(founder: NodeHome, member: NodeHome) -> None:
    with Ledger.open(founder.ledger_db) as led:
        led.revoke(NodeIdentity.load(founder).signer, NodeIdentity.load(member).public_key)


def _publish_blob(d, home: NodeHome, data: bytes, **extra) -> str:
    h = d.store.put_bytes(data)
    append(home, "weights", weights_body(h, d.store.manifest(h).hash, len(data), **extra))
    return h


def _transport(net: MemoryNetwork, home: NodeHome) -> MemoryTransport:
    return MemoryTransport(net, NodeIdentity.load(home).signer.seed)


async def _refused_on(t: MemoryTransport, peer: str, protocol: str, request: bytes | None) -> dict:
    """Open a stream, optionally send a request; return the first frame decoded."""
    s = await t.open_stream(peer, protocol)
    if request is not None:
        await s.write_frame(request)
    with trio.fail_after(10):
        msg = unpack(await s.read_frame())
    await s.close()
    return msg


def test_outsider_and_revoked_member_are_refused_on_every_protocol(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 3)
    _revoke(homes[0], homes[2])
    outsider = _outsider(tmp_path, homes[0])
    net = MemoryNetwork(seed=21)
    data = random.Random(1).randbytes(300_000)

    async def main() -> None:
        d0, d1 = daemon_on(net, homes[0]), daemon_on(net, homes[1])
        d0.services.append(AcceptOnly(homes[0], "festa", settings=object()))  # type: ignore[arg-type]
        h = _publish_blob(d0, homes[0], data)
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            await wait_for(lambda: d1.store.has(h), "the member fetches the blob as before")
            rows_before = await d0.ledger.run(lambda led: led.stats())
            for home in (outsider, homes[2]):
                rogue = _transport(net, home)
                served: list[str] = []

                async def record(stream, served=served) -> None:
                    served.append(stream.protocol)
                    await stream.close()

                rogue.set_stream_handler(SYNC_PROTOCOL, record)
                rogue.set_stream_handler(BLOB_PROTOCOL, record)
                async with rogue.run([]):
                    # sync, outsider pulling: refused, gets the genesis entry and nothing else
                    led = LedgerAccess(Ledger.open(home.ledger_db))
                    with pytest.raises(AccessRefused), trio.fail_after(10):
                        await pull(await rogue.open_stream(d0.transport.peer_id, SYNC_PROTOCOL), led)
                    assert {e.kind for e in await led.run(lambda led: led.all_entries())} == {"genesis"}
                    await led.run(lambda led: led.close())
                    # blobs: manifest and chunk requests refused before any is read
                    for req in (pack({"op": "manifest", "blob": h}),
                                pack({"op": "get", "blob": h, "chunk_size": 1 << 20, "chunks": [0]}), None):
                        assert is_refusal(await _refused_on(rogue, d0.transport.peer_id, BLOB_PROTOCOL, req))
                    # split-learning sessions: refused before the first frame, in the split protocol's words
                    ch = SplitChannel(await rogue.open_stream(d0.transport.peer_id, SPLIT_PROTOCOL), ByteCounter(),
                                      rogue.peer_id, side="client", max_frame=1 << 20)
                    with pytest.raises(RemoteError, match="not a member"), trio.fail_after(10):
                        await ch.recv()
                    # pulling: the member neither syncs from it nor fetches from it
                    assert await d0.sync_with(rogue.peer_id) == 0
                    assert rogue.peer_id in d0.gate.refused and served == []
                    # gossip relay: a genuine member entry forwarded by the outsider is dropped
                    fresh = append(homes[1], "metrics", {"relay": home.root.name})
                    assert not d0.replica.validate(fresh.to_bytes(), rogue.peer_id)
                    assert d0.replica.validate(fresh.to_bytes(), d1.transport.peer_id)
            # the outsiders' traffic stored nothing
            rows_after = await d0.ledger.run(lambda led: led.stats())
            assert rows_after["held"] == rows_before["held"] == 0 and rows_after["evidence"] == 0
            # the member still syncs as before
            late = append(homes[0], "metrics", {"late": 1})
            await wait_for(lambda: late.id in ids(homes[1]), "the member keeps syncing")
            d0.stop()
            d1.stop()

    trio.run(main)


def test_outsider_entries_are_never_stored(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 2)
    outsider = _outsider(tmp_path, homes[0])
    spam = [append(outsider, "metrics", {"spam": i, "pad": os.urandom(2000)}) for i in range(50)]  # held at home
    with Ledger.open(homes[0].ledger_db) as led:
        before = os.path.getsize(homes[0].ledger_db)
        res = led.merge([e.to_bytes() for e in spam], members_only=True)
        assert len(res.rejected) == 50 and not res.added and not res.pending
        assert all(led.state(e.id) is None for e in spam)
        assert led.stats()["held"] == 0
    assert os.path.getsize(homes[0].ledger_db) <= before
    # a member's entry still gets in (n1 was admitted at setup)
    own = append(homes[1], "metrics", {"mine": 1})
    with Ledger.open(homes[0].ledger_db) as led:
        assert led.merge([own.to_bytes()], members_only=True).added == [own.id]


def test_revocation_mid_session_cuts_access_on_the_next_request(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 2)
    net = MemoryNetwork(seed=22)

    async def main() -> None:
        d0, d1 = daemon_on(net, homes[0]), daemon_on(net, homes[1])
        h = _publish_blob(d0, homes[0], random.Random(2).randbytes(50_000))
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            await wait_for(lambda: d1.gate.allows(d0.transport.peer_id), "membership known")
            s = await d1.transport.open_stream(d0.transport.peer_id, BLOB_PROTOCOL)
            await s.write_frame(pack({"op": "manifest", "blob": h}))
            with trio.fail_after(10):
                assert (await read_header(s))["ok"] is True
                await s.read_frame()
            pk1 = NodeIdentity.load(homes[1]).public_key
            await d0.ledger.run(lambda led: led.revoke(d0.identity.signer, pk1))
            await wait_for(lambda: not d0.gate.allows(d1.transport.peer_id), "the revocation takes effect")
            await s.write_frame(pack({"op": "manifest", "blob": h}))  # same stream, next request
            with trio.fail_after(10):
                assert is_refusal(await read_header(s))
            # generous: under a loaded suite the pull's ledger work waits for worker threads
            with pytest.raises(AccessRefused), trio.fail_after(60):
                await pull(await d1.transport.open_stream(d0.transport.peer_id, SYNC_PROTOCOL), d1.ledger)
            # and the revoked member is disconnected: no more gossip reaches it
            await wait_for(lambda: d1.transport.peer_id not in d0.transport.peers(), "the revoked peer dropped")
            d0.stop()
            d1.stop()

    trio.run(main)


def test_reader_list_restricts_who_may_fetch_a_blob(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 3)
    net = MemoryNetwork(seed=23)

    async def main() -> None:
        d = [daemon_on(net, h) for h in homes]
        reader = NodeIdentity.load(homes[1]).peer_id
        h = _publish_blob(d[0], homes[0], random.Random(3).randbytes(40_000), readers=[reader])
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d[0].run, [], [])
            for x in d[1:]:
                await nursery.start(x.run, [], [a0[0]])
            await wait_for(lambda: d[1].store.has(h), "the named reader fetches it")
            await wait_for(lambda: d[2].gate.allows(d[0].transport.peer_id), "membership known")
            pk0 = d[0].identity.public_key  # d2 holds the entry naming the blob: it could want it
            await wait_for(lambda: d[2].ledger.ledger.head_of(pk0) == d[0].ledger.ledger.head_of(pk0),
                           "the blob's entry merged at d2")
            await d[2].fetcher.queue_wanted_blobs()  # what d2 wants now that it holds the entry
            assert h not in d[2].snapshot().wanted  # not for us: not even tried
            msg = await _refused_on(d[2].transport, d[0].transport.peer_id, BLOB_PROTOCOL,
                                    pack({"op": "manifest", "blob": h}))
            assert msg == {"ok": False, "error": "not a reader"}
            assert not d[2].store.has(h)
            for x in d:
                x.stop()

    trio.run(main)


def test_new_home_is_private(tmp_path: Path) -> None:
    root = tmp_path / "home"
    cli("init", "--home", str(root), "--genesis", "--consortium", "modes")
    home = NodeHome.at(root)
    with Ledger.open(home.ledger_db) as led:  # creates ledger.db-wal / -shm
        led.append(NodeIdentity.load(home).signer, "metrics", {"x": 1})
        BlobStore(home.blobs_dir).put_bytes(b"weights" * 1000)
        for p in [root, *root.rglob("*")]:
            mode = p.stat().st_mode & 0o777
            assert mode == (0o700 if p.is_dir() else 0o600), f"{p} has mode {mode:o}"
    # a home an older version left readable is tightened when it is next used
    os.chmod(root, 0o755)
    os.chmod(home.config_file, 0o644)
    home.require()
    assert root.stat().st_mode & 0o777 == 0o700 and home.config_file.stat().st_mode & 0o777 == 0o600


def test_bulk_config() -> None:
    assert NodeConfig().bulk_options() == {"bulk": True, "bulk_port": 0}
    assert NodeConfig(extra={"bulk": {"enabled": False, "port": 4100}}).bulk_options() == {
        "bulk": False, "bulk_port": 4100}
    for bad in ({"port": 70000}, {"enabled": "yes"}, {"port": "x"}):
        with pytest.raises(ConfigError):
            NodeConfig(extra={"bulk": bad}).bulk_options()


def test_members_only_merge_applies_admissions_of_the_same_batch(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 2)
    own = append(homes[1], "metrics", {"mine": 1})  # n1 was admitted by the founder at setup
    with Ledger.open(homes[0].ledger_db) as led:
        log = [e.to_bytes() for e in led.all_entries()]
    with Ledger.open(tmp_path / "fresh.db", genesis_id=bytes.fromhex(_genesis(homes[0]))) as led:
        res = led.merge([own.to_bytes(), *reversed(log)], members_only=True)  # admission after the entry
        assert not res.rejected and own.id in res.added and len(res.added) == len(log) + 1


def _count_traffic(monkeypatch, member) -> dict[str, int]:
    """Count sync pulls aimed at `member` and the refusals `member` serves (any protocol)."""
    import atdnode.replication.replicator as daemon_mod

    seen = {"pulls": 0, "refusals": 0}
    real_pull, real_refuse = daemon_mod.pull, member.gate.refuse

    async def counting_pull(stream, ledger):
        if stream.remote_peer == member.transport.peer_id:
            seen["pulls"] += 1
        return await real_pull(stream, ledger)

    def counting_refuse(peer, what):
        seen["refusals"] += 1
        return real_refuse(peer, what)

    monkeypatch.setattr(daemon_mod, "pull", counting_pull)
    member.gate.refuse = counting_refuse
    return seen


@pytest.mark.parametrize("learns", [True, False], ids=["revoked-mid-session", "revoked-while-away"])
def test_a_revoked_member_pulls_a_handful_of_times_not_thousands(tmp_path: Path, monkeypatch, caplog,
                                                                 learns: bool) -> None:
    """A revoked daemon must not pull in a loop, each refusal a ledger-thread job on both
    sides: a node that learns it was revoked stops (and says so
    once); one that cannot learn it backs off exponentially; a refusal costs the member no
    ledger job (the genesis bytes are cached)."""
    homes = make_consortium(tmp_path, 2)
    if not learns:  # revoked while its daemon was down: the revocation never reaches it
        _revoke(homes[0], homes[1])
    net = MemoryNetwork(seed=24)
    window = 60.0

    async def main() -> None:
        d0, d1 = daemon_on(net, homes[0]), daemon_on(net, homes[1])
        seen = _count_traffic(monkeypatch, d0)
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            if learns:
                # mid-session: d1 knows it is a member and holds d0's chain (a node revoked
                # before that rejects the revocation's gossip as a non-member, or holds it back
                # for a missing predecessor, and is refused by every member from then on: it
                # cannot learn it, like one revoked while away)
                pk0 = d0.identity.public_key
                await wait_for(lambda: d1.transport.peer_id in d0.transport.peers() and d1.gate.self_is_member
                               and d1.ledger.ledger.head_of(pk0) == d0.ledger.ledger.head_of(pk0),
                               "connected, d1 a member in its own ledger and in step with d0")
                pk1 = NodeIdentity.load(homes[1]).public_key
                await d0.ledger.run(lambda led: led.revoke(d0.identity.signer, pk1))
            peer1 = d1.transport.peer_id
            await wait_for(lambda: not d0.gate.allows(peer1) and peer1 in d0.gate.refused, "the revocation takes effect")
            await wait_for(lambda: d1.dialer.policy.revoked if learns else d1.dialer.policy.refused_count,
                           "the revoked node learns it, or is refused")
            jobs = {"n": 0}
            real_run = d0.ledger.run

            async def counting_run(fn):
                jobs["n"] += 1
                return await real_run(fn)

            d0.ledger.run = counting_run
            start = dict(seen)
            await trio.sleep(window)  # a measurement window (simulated time): what the revoked node does in it
            pulls, refusals = seen["pulls"] - start["pulls"], seen["refusals"] - start["refusals"]
            # back-off 1, 2, 4 s ... from the first refusal, capped at refusal_cap_joining (5 s) while the
            # node is not a member in its own ledger: at most window / 5 + 2 pulls (none once revoked is
            # known; without the back-off the sync pace gives ~30). Refusals: those pulls, each with its
            # (memory transport) re-connection, and a bootstrap re-dial every 2 s while not a member
            most = window / d1.dialer.policy.refusal_cap_joining + 2
            assert pulls <= most and refusals <= 2 * most + window / 2, (pulls, refusals)
            if not learns:  # it keeps trying, backing off: the counts see its pulls
                assert pulls >= 1 and refusals >= pulls, (pulls, refusals)
            assert d1.transport.peer_id not in d0.transport.peers()
            assert d1.transport.peer_id not in d0.transport.topic_peers(d0.topic)
            if learns:
                assert d1.dialer.policy.revoked and pulls == 0
            # d0's ledger thread: its own loops only (announce recheck, periodic sync: a few a minute),
            # never one per refusal (the not-learning case serves dozens in the window)
            assert jobs["n"] <= window / 10 + 2, jobs
            d0.stop()
            d1.stop()

    with caplog.at_level("WARNING", logger="atd.daemon"):  # simulated clock: the window's counts do not
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.01))  # depend on the machine's speed
    said = [r for r in caplog.records if "this node was revoked" in r.getMessage()]
    assert len(said) == (1 if learns else 0)
