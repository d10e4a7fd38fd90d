"""`Ledger.query` by author or kind reads only the matching rows through an index, never the
whole log, and returns what a filter of the whole log returns, in log order."""
from __future__ import annotations

from pathlib import Path

from ledger import Ledger, Signer

F, A, B = (Signer.from_seed(bytes([i]) * 32) for i in (1, 2, 3))


def test_query_by_author_or_kind_uses_an_index_and_agrees_with_a_filter(tmp_path: Path) -> None:
    led = Ledger.open(tmp_path / "l.db")
    led.create_genesis(F, "c", members=[(A.public_key, False), (B.public_key, False)])
    for i in range(5):
        led.append(A if i % 2 else B, "hello" if i < 2 else "metrics", {"i": i})
    plans: list[str] = []
    conn = led._store.conn
    conn.set_trace_callback(lambda sql: plans.append(sql) if sql.lstrip().startswith("SELECT payload") else None)
    every = led.all_entries()
    for kind in (None, "hello", "metrics", "weights"):
        for author in (None, A.public_key, B.public_key):
            want = [e.id for e in every if kind in (None, e.kind) and author in (None, e.author)]
            assert [e.id for e in led.query(kind=kind, author=author)] == want
    conn.set_trace_callback(None)
    for sql in plans:
        if "kind=" in sql or "author=" in sql:
            plan = " ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql))
            assert "entries_chain" in plan or "entries_kind" in plan, plan
    led.close()


def test_an_entry_id_is_taken_as_bytes_or_as_hex(tmp_path: Path) -> None:
    import pytest

    from ledger import LedgerError, MalformedId

    led = Ledger.open(tmp_path / "l.db")
    led.create_genesis(F, "c", members=[(A.public_key, False)])
    e = led.append(A, "metrics", {"i": 1})
    assert led.get(e.id.hex()) == led.get(e.id) == e and led.state(e.id.hex()) == "log"
    assert led.get("00" * 32) is None and led.get(e.id.hex()[:8]) is None  # hex that names nothing
    for bad in ("zz" * 32, ["x"], 5):
        with pytest.raises(MalformedId) as err:
            led.get(bad)
        assert isinstance(err.value, LedgerError) and isinstance(err.value, ValueError)
    led.close()
