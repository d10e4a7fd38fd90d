"""A durable, verifiable ledger and a node that cannot freeze itself on restart.

Ledger level: own appends are fsynced (synchronous=FULL around their commit), verify runs
SQLite's integrity check, held entries have byte quotas, and a revocation deleted from one
node's database by a tamperer who also recomputes the store chain comes back by sync.
Daemon level (real daemons on the in-memory network): a home restored from an older copy
recovers its own entries from a member before it signs anything, and `verify_peers`
reports exactly what a truncated ledger lacked.
"""
from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
import trio

from atdnode.node import NodeHome, NodeIdentity
from atdnode.replication import SYNC_PROTOCOL, LedgerAccess, pull, serve_sync
from atdnode.transport import MemoryNetwork, MemoryTransport
from ledger import Entry, Ledger, Signer, TamperedStore
from ledger import merge as merge_mod
from ledger.merge import Batch
from ledger.store import ZERO, next_link
from tests.factories import daemon_on, ids, make_consortium, wait_for

F = Signer.from_seed(b"F" * 32)
A = Signer.from_seed(b"A" * 32)
X = Signer.from_seed(b"X" * 32)


def test_own_appends_are_fsynced_merges_are_not(tmp_path: Path) -> None:
    led = Ledger.open(tmp_path / "l.db")
    led.create_genesis(F, "d", members=[(A.public_key, False)])
    other = Ledger.open(tmp_path / "o.db")
    seen: list[str] = []
    led._store.conn.set_trace_callback(seen.append)
    led.append(F, "metrics", {"i": 1})
    full = [i for i, q in enumerate(seen) if q.upper().startswith("PRAGMA SYNCHRONOUS=FULL")]
    commit = [i for i, q in enumerate(seen) if q.upper() == "COMMIT"]
    assert full and commit and full[0] < commit[0], seen
    assert led._store.conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # back to NORMAL after
    seen.clear()
    led.merge([Entry.create(A, seq=1, prev=ZERO, lamport=10, kind="metrics", body={})])
    assert not any("SYNCHRONOUS=FULL" in q.upper() for q in seen)
    other.close()
    led.close()


def _corrupt_index(path: Path) -> None:
    """Flip one key byte inside the entries_chain index (table rows stay intact)."""
    con = sqlite3.connect(path)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    root = con.execute("SELECT rootpage FROM sqlite_master WHERE name='entries_chain'").fetchone()[0]
    page = con.execute("PRAGMA page_size").fetchone()[0]
    con.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * page)
        data = bytearray(f.read(page))
        hdr = 8 if data[0] in (10, 13) else 12
        ncells = int.from_bytes(data[3:5], "big")
        cell = int.from_bytes(data[hdr + 2 * (ncells // 2): hdr + 2 * (ncells // 2) + 2], "big")
        data[cell + 10] ^= 0x55  # inside the author key of a middle cell
        f.seek((root - 1) * page)
        f.write(data)


def test_verify_runs_sqlite_integrity_check(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    led = Ledger.open(path)
    led.create_genesis(F, "d")
    for i in range(40):
        led.append(F, "metrics", {"i": i})
    led.close()
    _corrupt_index(path)
    with Ledger.open(path) as led, pytest.raises(TamperedStore, match="integrity check"):
        led.verify()


def test_held_entries_have_a_byte_quota(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(merge_mod, "MAX_WAITING_BYTES_PER_AUTHOR", 3000)
    led = Ledger.open(tmp_path / "l.db")
    led.create_genesis(F, "d")
    chain, prev = [], ZERO
    for s in range(1, 6):  # ~1 KB each, from a key never admitted
        e = Entry.create(X, seq=s, prev=prev, lamport=10 + s, kind="metrics", body={"pad": "x" * 900})
        chain.append(e)
        prev = e.id
    res = led.merge(chain)
    assert len(res.pending) == 2 and len(res.rejected) == 3
    assert led._store.waiting_bytes(X.public_key) <= 3000
    led.verify()
    led.close()


def _tamper_delete(path: Path, entry_id: bytes) -> None:
    """What someone with write access to one node's files can do: delete a row, renumber and
    re-link the store chain (it uses no secret), re-derive every cached table."""
    con = sqlite3.connect(path)
    con.execute("DELETE FROM entries WHERE id=?", (entry_id,))
    link = ZERO
    rows = con.execute("SELECT pos, id FROM entries ORDER BY pos").fetchall()
    con.execute("UPDATE entries SET pos = -pos")
    for n, (pos, eid) in enumerate(rows, start=1):
        link = next_link(link, eid)
        con.execute("UPDATE entries SET pos=?, link=? WHERE pos=?", (n, link, -pos))
    con.execute("UPDATE meta SET value=? WHERE key='count'", (len(rows),))
    con.execute("UPDATE meta SET value=? WHERE key='tip'", (link,))
    con.commit()
    con.close()
    led = Ledger.open(path)
    with led._store.transaction():
        b = Batch(led._store)
        b.recompute = True
        b.finish()
    led.close()


def test_deleted_revocation_comes_back_by_sync(tmp_path: Path) -> None:
    founder = Ledger.open(tmp_path / "f.db")
    founder.create_genesis(F, "d")
    founder.admit(F, A.public_key)
    founder.append(A, "hello", {})
    rev = founder.revoke(F, A.public_key)
    victim_path = tmp_path / "v.db"
    victim = Ledger.open(victim_path)
    victim.merge(founder.raw_rows())
    assert victim.membership().members[A.public_key].revoked
    victim.close()

    _tamper_delete(victim_path, rev.id)
    victim = Ledger.open(victim_path)
    victim.verify()  # nothing local shows it ...
    assert not victim.membership().members[A.public_key].revoked  # ... and A is a member again

    net = MemoryNetwork(seed=5)
    server, client = MemoryTransport(net, b"s" * 32), MemoryTransport(net, b"c" * 32)
    fa, va = LedgerAccess(founder), LedgerAccess(victim)
    server.set_stream_handler(SYNC_PROTOCOL, lambda s: serve_sync(s, fa))

    async def main():
        async with server.run([]), client.run([]):
            await client.connect(server.addrs()[0])
            return await pull(await client.open_stream(server.peer_id, SYNC_PROTOCOL), va)

    res = trio.run(main)
    assert rev.id in res.added_ids  # what `verify --peers` reports
    assert victim.membership().members[A.public_key].revoked
    victim.verify()
    victim.close()
    founder.close()


def _copy_home(src: Path, dst: Path) -> None:
    """A consistent backup of a home (the ledger through SQLite's backup API)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("ledger.db*", "control.sock", "daemon.json"))
    s, d = sqlite3.connect(src / "ledger.db"), sqlite3.connect(dst / "ledger.db")
    s.backup(d)
    s.close()
    d.close()


def test_restored_home_recovers_its_chain_before_signing(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 2)
    backup = tmp_path / "backup"
    net = MemoryNetwork(seed=6)

    async def main() -> None:
        d0, d1 = daemon_on(net, homes[0]), daemon_on(net, homes[1])
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            await d1.append("metrics", {"i": 0})
            await trio.to_thread.run_sync(_copy_home, homes[1].root, backup)
            later = [await d1.append("metrics", {"i": i}) for i in range(1, 4)]
            await wait_for(lambda: {e.id for e in later} <= ids(homes[0]), "node 0 to hold node 1's entries")
            d1.stop()
            d0.stop()
            await wait_for(lambda: not homes[1].control_socket.exists() and not homes[0].control_socket.exists(),
                           "both nodes to stop")
            shutil.rmtree(homes[1].root)
            shutil.copytree(backup, homes[1].root)  # the home restored from the older copy
            d1b = daemon_on(net, homes[1])
            a1 = await nursery.start(d1b.run, [], [])
            signing = trio.Event()
            got: list[Entry] = []

            async def sign() -> None:
                got.append(await d1b.append("metrics", {"after": "restore"}))
                signing.set()

            nursery.start_soon(sign)
            with trio.move_on_after(0.5):  # no member reachable: it must not sign
                await signing.wait()
            assert not got, "signed before checking its chain head with a member"
            d0b = daemon_on(net, homes[0])
            await nursery.start(d0b.run, [], [a1[0]])
            with trio.fail_after(20):
                await signing.wait()
            assert got[0].seq > later[-1].seq  # after the entries it had lost, not over them
            assert d1b.stats.get("own_recovered", 0) >= len(later)
            await wait_for(lambda: got[0].id in ids(homes[0]), "node 0 to accept the new entry")
            d0b.stop()
            d1b.stop()
        for h in homes:
            with Ledger.open(h.ledger_db) as led:
                led.verify()
                assert led._store.all_frozen() == {}  # nobody recorded an equivocation

    trio.run(main)


def test_verify_peers_reports_what_a_truncated_ledger_lacked(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 2)
    backup = tmp_path / "backup"
    net = MemoryNetwork(seed=7)

    async def main() -> None:
        d0, d1 = daemon_on(net, homes[0]), daemon_on(net, homes[1])
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            d1_done = trio.Event()

            async def run_d1(task_status=trio.TASK_STATUS_IGNORED) -> None:
                await d1.run([], [a0[0]], task_status=task_status)
                d1_done.set()

            await nursery.start(run_d1)
            await trio.to_thread.run_sync(_copy_home, homes[1].root, backup)
            new = [await d0.append("metrics", {"i": i}) for i in range(3)]
            await wait_for(lambda: {e.id for e in new} <= ids(homes[1]), "node 1 to hold node 0's entries")
            d1.stop()
            with trio.fail_after(30):
                await d1_done.wait()  # run() returned: ledger closed, home lock released
            shutil.copy(backup / "ledger.db", homes[1].ledger_db)  # rolled back
            for suffix in ("-wal", "-shm"):
                Path(str(homes[1].ledger_db) + suffix).unlink(missing_ok=True)
            d1b = daemon_on(net, homes[1])
            d1b.sync_interval = 3600  # no periodic pulls: verify_peers is the one that finds the gap

            async def no_sync_on_connect(peer: str) -> None:
                return None

            d1b._on_peer = no_sync_on_connect
            await nursery.start(d1b.run, [], [])
            rep = await d1b.verify_peers()
            assert rep["peers"] == [] and rep["missing"] == []  # nobody to compare with (the CLI fails then)
            await d1b.transport.connect(a0[0])
            rep = await d1b.verify_peers()
            assert rep["peers"] == [d0.transport.peer_id]
            missing = {bytes.fromhex(m["id"]) for m in rep["missing"]}
            assert {e.id for e in new} <= missing <= ids(homes[0])  # all it lacked (the backup may predate more)
            rep = await d1b.verify_peers()
            assert rep["missing"] == []  # the pull merged them: clean now
            d0.stop()
            d1b.stop()
        with Ledger.open(homes[1].ledger_db) as led:
            assert {e.id for e in new} <= {e.id for e in led.all_entries()}

    trio.run(main)


def test_disk_full_is_one_line_with_back_off(tmp_path: Path, caplog) -> None:
    """A fetch that hits ENOSPC is logged once and retried after a back-off, not every second.
    The daemon's clock is trio's: a MockClock at 20x real time gives a 29 s window (just under
    the 30 s back-off) in 1.5 s; with a 1 s back-off the window would see ~6 tries."""
    import errno
    import logging

    from trio.testing import MockClock

    homes = make_consortium(tmp_path, 1)
    net = MemoryNetwork(seed=8)
    calls: list[float] = []

    async def main() -> None:
        d = daemon_on(net, homes[0])

        async def full_disk(blob: str, timeout: float = 600.0) -> str:
            calls.append(trio.current_time())
            raise OSError(errno.ENOSPC, "No space left on device")

        d.fetcher.fetch = full_disk
        d.fetcher.wanted = {"ab" * 32, "cd" * 32}
        async with trio.open_nursery() as nursery:
            await nursery.start(d.run, [], [])
            await trio.sleep(29)  # virtual seconds: a measurement window, not synchronisation
            d.stop()

    with caplog.at_level(logging.INFO, logger="atd.daemon"):
        trio.run(main, clock=MockClock(rate=20))
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "disk full" in errors[0].getMessage(), [r.getMessage() for r in errors]
    assert not any(r.exc_info for r in caplog.records)
    assert len(calls) == 2, calls  # two blobs, each tried once in 29 s (back-off >= 30 s), not every second


def test_verify_peers_without_a_daemon_is_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.app import app

    homes = make_consortium(tmp_path, 1)
    r = CliRunner().invoke(app, ["ledger", "verify", "--peers", "--home", str(homes[0].root)])
    from atdnode.errors import DaemonError

    assert r.exit_code != 0  # cli.app.main prints typed errors as one line
    assert isinstance(r.exception, DaemonError) and "no running daemon" in str(r.exception)
    assert r.output.startswith("ok: ")  # the local verification ran (and passed) first
    alone = CliRunner().invoke(app, ["ledger", "verify", "--home", str(homes[0].root)])
    assert alone.exit_code == 0 and "only detectable against peers" in alone.output  # says what it misses
    assert "only detectable" not in r.output


def test_held_entries_expire(tmp_path: Path) -> None:
    import time

    led = Ledger.open(tmp_path / "l.db")
    led.create_genesis(F, "d", members=[(A.public_key, False)])
    prev, xs = ZERO, []
    for s in range(1, 4):
        e = Entry.create(X, seq=s, prev=prev, lamport=10 + s, kind="metrics", body={"s": s})
        xs.append(e)
        prev = e.id
    gap = Entry.create(A, seq=2, prev=b"\1" * 32, lamport=20, kind="metrics", body={})  # a member's, held (seq gap)
    led.merge(xs + [gap])
    mine = led.append(F, "metrics", {"after": True})
    assert led.stats()["held"] == 4
    assert led.expire_held(3600) == 0  # too young
    assert led.expire_held(3600, now=time.time() + 7200, keep=[X.public_key, A.public_key]) == 0  # own: kept
    assert led.expire_held(3600, now=time.time() + 7200, keep=[A.public_key]) == 3  # X's three
    assert led.stats()["held"] == 1 and led.state(gap.id) == "held"
    assert led.expire_held(3600, now=time.time() + 7200) == 1  # a member's chain gap expires too
    assert led.stats()["held"] == 0 and led.state(gap.id) is None
    led.verify()  # the store chain was re-linked consistently
    assert led.get(mine.id) == mine
    res = led.merge(xs)  # sent again later: held again
    assert len(res.pending) == 3
    led.verify()
    led.close()


def _fresh_home_with_keys_of(home: NodeHome, dst: Path) -> NodeHome:
    """The state after `atd key import` into a fresh home and `atd init --join`: the node's
    keys and the consortium's genesis id, no entries of its own."""
    from atdnode.node import export_keys, import_keys, init_home

    backup = dst.parent / f"{dst.name}.keys"
    export_keys(home, backup, b"a long passphrase", kdf_cost={"n": 1 << 14, "r": 8, "p": 1})
    fresh = NodeHome.at(dst)
    import_keys(fresh, backup, b"a long passphrase")
    with Ledger.open(home.ledger_db) as led:
        genesis = led.genesis_id.hex()
    init_home(fresh, join=genesis)
    return fresh


def test_a_large_own_chain_restored_into_a_fresh_home_recovers_in_full(monkeypatch, tmp_path: Path) -> None:
    """Node 1 signed its chain (40 entries, ~160 KB) before its admission
    reached it, so in log order its entries come before the admission, and a pull into a
    fresh home delivers them in frames (16 KiB here, 512 KiB in a deployment) before it
    knows it is a member. Restored into a fresh home it takes back every own entry before
    signing, signs after them, and no node freezes it. (A deployed chain can be 100 MB against
    the 64 MiB waiting quota; the quota and frames are scaled down so the chain stays small.)"""
    from atdnode.replication import sync
    from tests.factories import cli

    monkeypatch.setattr(merge_mod, "MAX_WAITING_BYTES_PER_AUTHOR", 32 << 10)
    monkeypatch.setattr(sync, "BATCH_BYTES", 16 << 10)
    (h0,) = make_consortium(tmp_path, 1)
    with Ledger.open(h0.ledger_db) as led:
        genesis = led.genesis_id.hex()
    cli("init", "--home", str(tmp_path / "n1"), "--join", genesis)
    h1 = NodeHome.at(tmp_path / "n1")
    signer = NodeIdentity.load(h1).signer
    with Ledger.open(h1.ledger_db) as led:  # `atd publish` before the admission arrived: held, signed
        chain = [led.append(signer, "metrics", {"i": i, "pad": b"x" * 4000}) for i in range(40)]
    with Ledger.open(h0.ledger_db) as led:  # the founder's clock runs ahead: its admission sorts after the chain
        founder = NodeIdentity.load(h0).signer
        for i in range(45):
            led.append(founder, "metrics", {"i": i})
    cli("member", "add", "--home", str(h0.root), NodeIdentity.load(h1).peer_id)
    net = MemoryNetwork(seed=24)

    async def main() -> None:
        d0, d1 = daemon_on(net, h0), daemon_on(net, h1)
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            await wait_for(lambda: {e.id for e in chain} <= ids(h0), "node 0 to hold node 1's chain", 60)
            d1.stop()
            await wait_for(lambda: not h1.control_socket.exists(), "node 1 to stop")
            fresh = await trio.to_thread.run_sync(_fresh_home_with_keys_of, h1, tmp_path / "restored")
            d1b = daemon_on(net, fresh)
            d1b.sync_interval = 3600  # only the pull on connect (and the confirm loop's, if it needed more)
            await nursery.start(d1b.run, [], [a0[0]])
            with trio.fail_after(60):
                after = await d1b.append("metrics", {"after": "restore"})
            assert d1b.stats["sync_pulls"] == 1  # one pull brought the whole chain back, admission last
            own = await d1b.ledger.run(lambda led: led.head_of(after.author))
            assert after.seq == own and after.seq > chain[-1].seq  # after its whole chain, not over it
            await wait_for(lambda: after.id in ids(h0), "node 0 to accept the entry signed after restore")
            d0.stop()
            d1b.stop()
        for h in (h0, fresh):
            with Ledger.open(h.ledger_db) as led:
                led.verify()
                assert led._store.all_frozen() == {} and led.stats()["evidence"] == 0  # nothing conflicting
                assert {e.id for e in chain} <= {e.id for e in led.all_entries()}

    trio.run(main)


def test_fork_evidence_is_served_by_sync(tmp_path: Path) -> None:
    """Node S saw A sign two entries at seq 3 and froze A; node C took one
    side into its log (and more after it). One pull from S hands C the evidence: C freezes
    A at seq 3 too, so no node keeps a diverged view; a pull between nodes that agree carries
    no evidence; the end marker tells the requester its own head on the server."""
    from atdnode.replication.own_chain import confirms, fork_evidence

    lf = Ledger.open(tmp_path / "f.db")
    lf.create_genesis(F, "d", members=[(A.public_key, False)])
    la = Ledger.open(tmp_path / "a.db", genesis_id=lf.genesis_id)
    la.merge(lf.raw_rows())
    e1, e2 = la.append(A, "metrics", {"i": 1}), la.append(A, "metrics", {"i": 2})
    side = [la.append(A, "metrics", {"i": 3}), la.append(A, "metrics", {"i": 4})]
    other = Entry.create(A, seq=3, prev=e2.id, lamport=side[0].lamport, kind="metrics", body={"i": "other"})
    srv = Ledger.open(tmp_path / "s.db", genesis_id=lf.genesis_id)
    srv.merge(lf.raw_rows() + [e1.to_bytes(), e2.to_bytes(), other.to_bytes()] + [e.to_bytes() for e in side])
    assert srv.forks() == {A.public_key: 3}
    cli_led = Ledger.open(tmp_path / "c.db", genesis_id=lf.genesis_id)
    cli_led.merge(la.raw_rows())
    assert cli_led.head_of(A.public_key) == 4 and cli_led.forks() == {}
    assert fork_evidence(srv, {A.public_key: 2}) == []  # stopped before the fork: nothing to prove

    net = MemoryNetwork(seed=8)
    server, client = MemoryTransport(net, b"s" * 32), MemoryTransport(net, A.seed)
    sa, ca = LedgerAccess(srv), LedgerAccess(cli_led)
    server.set_stream_handler(SYNC_PROTOCOL, lambda s: serve_sync(s, sa))

    async def main():
        async with server.run([]), client.run([]):
            await client.connect(server.addrs()[0])
            first = await pull(await client.open_stream(server.peer_id, SYNC_PROTOCOL), ca)
            second = await pull(await client.open_stream(server.peer_id, SYNC_PROTOCOL), ca)
            return first, second

    first, second = trio.run(main)
    assert cli_led.forks() == {A.public_key: 3} and cli_led.head_of(A.public_key) == 2
    assert first.received >= 2 and second.received == 0  # once it agrees, the evidence is not sent again
    assert first.yours == 2 and confirms(2, first.yours) and not confirms(1, first.yours)
    cli_led.verify()
    for led in (lf, la, srv, cli_led):
        led.close()


def test_a_killed_aggregate_leaves_no_model_without_its_entry(tmp_path: Path) -> None:
    """A global model is registered only once its aggregate entry is in the
    ledger; a record whose entry never made it (a `kill -9` between the two, simulated by
    writing the record of an entry that was signed but never stored) is removed when the node
    starts, and the records of stored entries stay."""
    from atdnode.errors import ConfigError
    from atdnode.models import ModelRecord, ModelRegistry

    (home,) = make_consortium(tmp_path, 1)
    signer = NodeIdentity.load(home).signer
    reg = ModelRegistry(home)

    def record(entry: Entry) -> ModelRecord:
        return ModelRecord(model={}, labels=["a"], label_fp="fp", samples=1, metrics={}, blobs={"full": "00" * 32},
                           provenance={"kind": "global-horizontal", "aggregate": entry.id.hex()})

    with Ledger.open(home.ledger_db) as led:
        kept = led.append(signer, "aggregate", {"i": 1})
        lost = Entry.create(signer, seq=kept.seq + 1, prev=kept.id, lamport=kept.lamport + 1, kind="aggregate",
                            body={"i": 2})  # signed, never stored: what a crash before the append leaves
        good = reg.add_recorded(record(kept), kept.id, led)
        with pytest.raises(ConfigError, match="not in the ledger"):
            reg.add_recorded(record(lost), lost.id, led)
    assert [r.id for r in reg.list()] == [good]
    orphan = reg.add(record(lost))  # the crash as an older version left it: record first, no entry
    trained = reg.add(ModelRecord(model={}, labels=["a"], label_fp="fp", samples=1, metrics={}, blobs={}))
    net = MemoryNetwork(seed=9)

    async def main() -> None:
        d = daemon_on(net, home)
        async with trio.open_nursery() as nursery:
            await nursery.start(d.run, [], [])
            d.stop()

    trio.run(main)
    assert {r.id for r in reg.list()} == {good, trained} and orphan not in {r.id for r in reg.list()}
