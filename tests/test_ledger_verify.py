"""`Ledger.verify`: every kind of tampering with the stored rows is detected and named."""
from __future__ import annotations

import hashlib
import shutil
import sqlite3

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ledger import (
    BadSignature, Entry, Ledger, LedgerError, SeqGap, Signer, TamperedStore, UnknownAuthor, ZERO_HASH,
)
from ledger.store import LINK_DOMAIN, ZERO

F = Signer.from_seed(b"f" * 32)
A = Signer.from_seed(b"a" * 32)
X = Signer.from_seed(b"x" * 32)
COLUMNS = ["id", "author", "seq", "prev", "lamport", "kind", "payload", "sig", "state", "link"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A ledger with log, held (non-member) and evidence (fork) rows; verified intact."""
    path = tmp_path_factory.mktemp("pristine") / "l.db"
    led = Ledger.open(path)
    led.create_genesis(F, "demo")
    led.admit(F, A.public_key)
    for i in range(4):
        led.append(A, "metrics", {"i": i})
        led.append(F, "hello", {"i": i})
    a = led.query(author=A.public_key)
    led.merge([Entry.create(A, seq=4, prev=a[2].id, lamport=999, kind="metrics", body={"fork": 1})])
    led.merge([Entry.create(X, seq=1, prev=ZERO_HASH, lamport=5, kind="hello", body={})])
    assert led.stats() == {"log": 9, "held": 1, "evidence": 2}
    led.verify()
    led.close()
    return path


@pytest.fixture
def db(pristine, tmp_path):
    path = tmp_path / "l.db"
    shutil.copy(pristine, path)
    return path


def sql(path, statement, args=()):
    conn = sqlite3.connect(path)
    conn.execute(statement, args)
    conn.commit()
    conn.close()


def verify(path) -> None:
    led = Ledger.open(path)
    try:
        led.verify()
    finally:
        led.close()


def rows(path) -> list[tuple]:
    conn = sqlite3.connect(path)
    out = conn.execute("SELECT pos, id, author, seq FROM entries ORDER BY pos").fetchall()
    conn.close()
    return out


def flip(value, byte: int = 0, bit: int = 1):
    if isinstance(value, bytes):
        b = bytearray(value)
        b[byte % len(b)] ^= bit
        return bytes(b)
    if isinstance(value, int):
        return value ^ bit
    return value[:-1] + chr(ord(value[-1]) ^ bit)


@pytest.mark.parametrize("column", COLUMNS)
@pytest.mark.parametrize("pos", [1, 4, 10, 12])
def test_flipped_byte_in_any_column_is_detected(db, column, pos):
    conn = sqlite3.connect(db)
    (value,) = conn.execute(f"SELECT {column} FROM entries WHERE pos=?", (pos,)).fetchone()
    conn.close()
    sql(db, f"UPDATE entries SET {column}=? WHERE pos=?", (flip(value, byte=7), pos))
    with pytest.raises(LedgerError) as info:
        verify(db)
    assert "entry 12D3KooW" in str(info.value)


def test_tampered_body_is_a_bad_signature(db):
    conn = sqlite3.connect(db)
    (payload,) = conn.execute("SELECT payload FROM entries WHERE pos=3").fetchone()
    conn.close()
    sql(db, "UPDATE entries SET payload=? WHERE pos=3", (payload.replace(b"\xa1i\x00", b"\xa1i\x07"),))
    with pytest.raises(BadSignature):
        verify(db)


@pytest.mark.parametrize("pos", [1, 5, 12])
def test_deleted_row_is_detected(db, pos):
    sql(db, "DELETE FROM entries WHERE pos=?", (pos,))
    with pytest.raises(TamperedStore) as info:
        verify(db)
    assert "entry 12D3KooW" in str(info.value)


def test_reordered_rows_are_detected(db):
    conn = sqlite3.connect(db)
    r3 = conn.execute("SELECT * FROM entries WHERE pos=3").fetchone()
    r6 = conn.execute("SELECT * FROM entries WHERE pos=6").fetchone()
    conn.execute("DELETE FROM entries WHERE pos IN (3, 6)")
    conn.execute(f"INSERT INTO entries VALUES ({','.join('?' * 11)})", (3, *r6[1:]))
    conn.execute(f"INSERT INTO entries VALUES ({','.join('?' * 11)})", (6, *r3[1:]))
    conn.commit()
    conn.close()
    with pytest.raises(TamperedStore, match="chain") as info:
        verify(db)
    assert r6[1].hex() in str(info.value)  # names the first displaced entry


def test_header_and_derived_tables_are_checked(db):
    sql(db, "UPDATE members SET admin=1 WHERE admin=0")
    with pytest.raises(TamperedStore, match="member"):
        verify(db)


def test_count_header_is_checked(db):
    sql(db, "UPDATE meta SET value=value+1 WHERE key='count'")
    with pytest.raises(TamperedStore, match="header"):
        verify(db)


def test_unreadable_database_file(db):
    data = bytearray(db.read_bytes())
    data[100:4096] = b"\xff" * (4096 - 100)
    db.write_bytes(bytes(data))
    with pytest.raises(TamperedStore):
        verify(db)


def _relink(conn) -> None:
    """What a careful forger does after deleting rows: renumber and recompute the store chain."""
    link, pos = ZERO, 0
    for (old_pos, eid) in conn.execute("SELECT pos, id FROM entries ORDER BY pos").fetchall():
        pos += 1
        link = hashlib.sha256(LINK_DOMAIN + link + eid).digest()
        conn.execute("UPDATE entries SET pos=?, link=? WHERE pos=?", (pos, link, old_pos))
    conn.execute("UPDATE meta SET value=? WHERE key='count'", (pos,))
    conn.execute("UPDATE meta SET value=? WHERE key='tip'", (link,))


def test_consistent_forgery_of_a_gap_is_a_seq_gap(db):
    conn = sqlite3.connect(db)
    conn.execute("DELETE FROM entries WHERE author=? AND seq=1", (A.public_key,))
    _relink(conn)
    conn.commit()
    conn.close()
    with pytest.raises(SeqGap) as info:
        verify(db)
    assert A.peer_id in str(info.value) and "seq 2" in str(info.value)


def test_consistent_forgery_of_a_non_member_entry_is_unknown_author(db):
    sql(db, "UPDATE entries SET state=0 WHERE author=?", (X.public_key,))
    with pytest.raises(UnknownAuthor) as info:
        verify(db)
    assert X.peer_id in str(info.value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pos=st.integers(1, 12), column=st.sampled_from(COLUMNS), byte=st.integers(0, 10_000), bit=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]))
def test_any_single_byte_corruption_is_detected(pristine, tmp_path_factory, pos, column, byte, bit):
    db = tmp_path_factory.mktemp("corrupt") / "l.db"
    shutil.copy(pristine, db)
    conn = sqlite3.connect(db)
    (value,) = conn.execute(f"SELECT {column} FROM entries WHERE pos=?", (pos,)).fetchone()
    conn.close()
    if isinstance(value, int):
        new = value ^ (bit << (8 * (byte % 4)))
    else:
        new = flip(value, byte, bit)
    sql(db, f"UPDATE entries SET {column}=? WHERE pos=?", (new, pos))
    with pytest.raises(LedgerError):
        verify(db)
