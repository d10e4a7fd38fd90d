"""Group commit of own appends (`LedgerAccess.append` -> `Ledger.append_many`).

Concurrent appends share one durable (synchronous=FULL) commit, and an appender gets its
entry -- which is what the daemon gossips -- only after that commit: a process killed between
signing and committing, or a group whose transaction fails, loses no entry anyone was shown,
and the node never signs again at a seq it gossiped.
"""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from atdnode.replication import LedgerAccess
from ledger import Ledger, Signer
from ledger.encoding import decode_payload
from ledger.store import Store

F = Signer.from_seed(b"G" * 32)


def _ledger(path: Path) -> Ledger:
    led = Ledger.open(path)
    led.create_genesis(F, "gc")
    return led


def test_concurrent_appends_share_durable_commits(tmp_path: Path) -> None:
    led = _ledger(tmp_path / "l.db")
    access = LedgerAccess(led, own=F.public_key)
    trace: list[str] = []
    led._store.conn.set_trace_callback(trace.append)
    got: list = []

    async def one(i: int) -> None:
        got.append(await access.append(F, "metrics", {"i": i}))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(one, i)

    trio.run(main)
    assert sorted(e.seq for e in got) == list(range(2, 42))  # every append stored, one seq each
    commits = [i for i, q in enumerate(trace) if q.upper() == "COMMIT"]
    assert access.commits == len(commits)
    assert len(commits) <= 40 // 4, f"{len(commits)} commits (fsyncs) for 40 appends"  # one each without grouping
    syncs = [q.upper() for q in trace if q.upper().startswith("PRAGMA SYNCHRONOUS")]
    assert syncs == ["PRAGMA SYNCHRONOUS=FULL", "PRAGMA SYNCHRONOUS=NORMAL"] * len(commits)  # every group durable
    assert led.heads()[F.public_key] == 41
    led.verify()
    led.close()


def _states(led: Ledger, author: bytes) -> list[tuple[str, int, int]]:
    return [(e.id.hex(), e.seq, e.lamport) for e in led.entries_after(author, 0, include_held=True)]


@pytest.mark.parametrize("writer", ["member", "outsider"])
def test_append_many_stores_exactly_what_appends_one_by_one_store(tmp_path: Path, writer: str) -> None:
    """Ed25519 signatures are deterministic: the group path (including its shortcut after a
    logged entry) must sign and place byte-identical entries, membership changes included."""
    a, x = Signer.from_seed(b"a" * 32), Signer.from_seed(b"x" * 32)
    me = F if writer == "member" else x
    items = [("metrics", {"i": 0}), ("metrics", {"i": 1}), ("member", {"action": "admit", "member": a.public_key,
             "admin": False}), ("metrics", {"i": 2}), ("hello", {"addrs": []}), ("metrics", {"i": 3})]
    one, many = _ledger(tmp_path / "one.db"), _ledger(tmp_path / "many.db")
    expect = []
    for kind, body in items:
        try:
            expect.append(one.append(me, kind, body).id)
        except Exception as exc:  # an outsider may not admit: the same refusal both ways
            expect.append(type(exc))
    got = [r.id if not isinstance(r, Exception) else type(r) for r in many.append_many(me, items)]
    assert got == expect
    assert _states(many, me.public_key) == _states(one, me.public_key)
    assert [e.id for e in many.all_entries()] == [e.id for e in one.all_entries()]
    assert many.membership().members == one.membership().members
    many.verify()
    one.close()
    many.close()


def test_a_failed_group_gossips_nothing_and_its_seqs_are_reused_safely(monkeypatch, tmp_path: Path) -> None:
    """The group's transaction fails after its entries were signed (disk error, connection
    lost before COMMIT): every appender of the group gets the error, nothing was stored,
    and the next append takes the first of those seqs (no one saw the signed ones)."""
    led = _ledger(tmp_path / "l.db")
    access = LedgerAccess(led, own=F.public_key)
    signed: list[int] = []
    real = Store.insert

    def failing(self, row, payload, sig, state):  # every own entry is stored through here, signed
        real(self, row, payload, sig, state)
        signed.append(row.seq)
        if decode_payload(payload, check_canonical=False)[5].get("i") == 2:
            raise sqlite3.OperationalError("disk I/O error")

    gossiped: list = []
    errors: list[BaseException] = []

    async def one(i: int) -> None:
        try:
            gossiped.append(await access.append(F, "metrics", {"i": i}))
        except sqlite3.OperationalError as exc:
            errors.append(exc)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(one, i)

    monkeypatch.setattr(Store, "insert", failing)
    trio.run(main)
    monkeypatch.setattr(Store, "insert", real)
    assert errors, "the failing group must report its error"
    assert len(signed) > len(gossiped)  # entries were signed that nobody was shown
    assert len(gossiped) + len(errors) == 5
    assert {e.id for e in gossiped} == {e.id for e in led.entries_after(F.public_key, 1)}  # stored == gossiped
    nxt = led.append(F, "metrics", {"i": 99})
    assert nxt.seq == led.heads()[F.public_key] and nxt.seq not in {e.seq for e in gossiped}
    led.verify()
    led.close()


CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import trio
    from atdnode.replication.ledger_access import LedgerAccess
    from ledger import Ledger, Signer
    from ledger.encoding import decode_payload
    from ledger.store import Store

    F = Signer.from_seed(b"G" * 32)
    led = Ledger.open(sys.argv[1])
    access = LedgerAccess(led, own=F.public_key)
    real = Store.insert

    def hooked(self, row, payload, sig, state):  # every own entry is stored through here, signed
        real(self, row, payload, sig, state)
        print(json.dumps({"signed": row.id.hex(), "seq": row.seq}), flush=True)
        if decode_payload(payload, check_canonical=False)[5]["i"] == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)  # signed and inserted, its group not committed yet

    Store.insert = hooked

    async def one(i):
        e = await access.append(F, "metrics", {"i": i})
        print(json.dumps({"gossiped": e.id.hex(), "seq": e.seq}), flush=True)  # what the daemon publishes

    async def main():
        async with trio.open_nursery() as nursery:
            for i in range(30):
                nursery.start_soon(one, i)

    trio.run(main)
""")


@pytest.mark.parametrize("kill_at", [0, 17])
@pytest.mark.slow  # daemons as OS processes, one killed
def test_a_process_killed_between_sign_and_commit_loses_nothing_gossiped(tmp_path: Path, kill_at: int) -> None:
    db = tmp_path / "l.db"
    _ledger(db).close()
    p = subprocess.run([sys.executable, "-c", CHILD, str(db), str(kill_at)], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    gossiped = {x["gossiped"]: x["seq"] for x in lines if "gossiped" in x}
    signed = {x["signed"]: x["seq"] for x in lines if "signed" in x}
    led = Ledger.open(db)
    led.verify()
    stored = {e.id.hex() for e in led.entries_after(F.public_key, 1)}
    assert set(gossiped) <= stored  # everything shown to anyone survived the kill
    assert set(signed) - stored, "the kill must hit a signed, uncommitted entry"
    assert not (set(signed) - stored) & set(gossiped)
    nxt = led.append(F, "metrics", {"i": 1000})  # the restarted node signs on ...
    assert nxt.seq not in gossiped.values()  # ... never at a seq it gossiped
    assert nxt.seq == max([1, *(signed[s] for s in stored if s in signed)]) + 1
    led.close()
