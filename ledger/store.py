"""SQLite persistence of the ledger: schema, rows, and the store's own hash chain.

Every stored entry is one row of `entries`, appended at position `pos` = 1, 2, ... and never
deleted, except held entries of unknown authors that expire (`remove_rows`, which re-links
the chain after them; `seen` records when a row was stored); `payload` and `sig` are the exact signed bytes, the other entry columns are
indexes that verification cross-checks against the payload. `state` is the derived
placement (log / held / evidence, see membership.py). `link` chains the rows in insertion
order — link_i = sha256(LINK_DOMAIN + link_{i-1} + id_i) — and `meta` keeps the row count
and last link, so a deleted, inserted or reordered row is detectable.

`members` and `frozen` cache derived membership and fork points; verify recomputes them.
`seen` records when this node stored each entry (local wall clock, not signed: shown by
`atd ledger show`, never used to decide anything).
All writes happen inside `Store.transaction()` (BEGIN IMMEDIATE ... COMMIT).
"""
from __future__ import annotations

import hashlib
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ledger.errors import LedgerError, TamperedStore
from ledger.membership import HELD, LOG, MemberStatus, Row

SCHEMA_VERSION = 1
LINK_DOMAIN = b"atd-ledger-store-v1\0"
ZERO = b"\0" * 32

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value NOT NULL);
CREATE TABLE IF NOT EXISTS entries(
    pos     INTEGER PRIMARY KEY,
    id      BLOB NOT NULL UNIQUE,
    author  BLOB NOT NULL,
    seq     INTEGER NOT NULL,
    prev    BLOB NOT NULL,
    lamport INTEGER NOT NULL,
    kind    TEXT NOT NULL,
    payload BLOB NOT NULL,
    sig     BLOB NOT NULL,
    state   INTEGER NOT NULL,
    link    BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_chain ON entries(author, seq);
CREATE INDEX IF NOT EXISTS entries_log ON entries(state, lamport, author, seq);
CREATE INDEX IF NOT EXISTS entries_kind ON entries(kind, state);
CREATE TABLE IF NOT EXISTS members(
    key BLOB PRIMARY KEY, admin INTEGER NOT NULL, revoked INTEGER NOT NULL, upto INTEGER, name TEXT
);
CREATE TABLE IF NOT EXISTS frozen(author BLOB PRIMARY KEY, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS seen(id BLOB PRIMARY KEY, at REAL NOT NULL);
"""

ROW_COLUMNS = "id, author, seq, prev, lamport, kind"

_commits: dict[str, int] = {}  # database path -> transactions committed to it by this process's stores


def commits_to(path: str) -> int:
    """How many `Store.transaction`s of this process (any connection) committed to `path`."""
    return _commits.get(path, 0)


def next_link(prev_link: bytes, entry_id: bytes) -> bytes:
    h = hashlib.sha256(LINK_DOMAIN)
    h.update(prev_link)
    h.update(entry_id)
    return h.digest()


class Store:
    """Thin SQL layer; no ledger rules live here."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
            self.conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL for merges (a merged entry lost to a power cut is fetched again from its
            # peers); own appends switch to FULL per transaction (see `transaction(durable=True)`).
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.execute("PRAGMA busy_timeout=30000")
            self.conn.executescript(_SCHEMA)
            with self.transaction():
                version = self.meta("schema")
                if version is None:
                    self.set_meta("schema", SCHEMA_VERSION)
                    self.set_meta("count", 0)
                    self.set_meta("tip", ZERO)
                elif version != SCHEMA_VERSION:
                    raise LedgerError(f"ledger schema {version!r} is not supported (expected {SCHEMA_VERSION})")
        except sqlite3.OperationalError as exc:
            raise LedgerError(f"cannot open ledger database {self.path}: {exc}") from None
        except sqlite3.DatabaseError as exc:  # not a database / corrupt file
            raise TamperedStore(f"cannot open ledger database {self.path}: {exc}") from None
        self._count = 0
        self._tip = ZERO
        # while a caller tracks them (a list, set inside a transaction): (author, seq, entered)
        # of every row that entered (True) or left (False) the log -- what `Ledger` keeps its
        # heads current with, instead of re-reading every head after each write
        self.log_moves: list[tuple[bytes, int, bool]] | None = None
        self.commit_token: tuple[int, int] | None = None  # `change_token()` of the last commit, read before it

    # --- transactions ------------------------------------------------------------------
    @contextmanager
    def transaction(self, *, durable: bool = False) -> Iterator[None]:
        """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error); the row count / tip header is
        read once at the start and written once at the end.

        durable=True (the node's own appends): the commit returns only once the WAL is
        fsynced (synchronous=FULL), so an entry that may be gossiped is never lost to a
        crash or power cut -- losing it would make the node re-sign that seq.
        """
        if durable:
            self.conn.execute("PRAGMA synchronous=FULL")
            try:
                with self.transaction():
                    yield
            finally:
                self.conn.execute("PRAGMA synchronous=NORMAL")
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            header = dict(self.conn.execute("SELECT key, value FROM meta WHERE key IN ('count', 'tip')"))
            self._count = header.get("count") or 0
            self._tip = header.get("tip") or ZERO
            start = self._count
            yield
            if self._count != start:
                self.conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('count', ?), ('tip', ?)",
                                  (self._count, self._tip))
            # read under the write lock: no other connection can commit before our COMMIT, and
            # COMMIT changes neither value, so this is the token the database has right after it
            token = self.change_token()
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        else:
            self.conn.execute("COMMIT")
            self.commit_token = token
            _commits[self.path] = _commits.get(self.path, 0) + 1

    def change_token(self) -> tuple[int, int]:
        """Moves whenever any connection may have written the database: SQLite's
        `data_version` (moves when another connection commits) and this connection's
        `total_changes` (moves on its own writes)."""
        return self.conn.execute("PRAGMA data_version").fetchone()[0], self.conn.total_changes

    def close(self) -> None:
        self.conn.close()

    # --- meta --------------------------------------------------------------------------
    def meta(self, key: str):
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value) -> None:
        self.conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    def genesis_pin(self) -> bytes | None:
        return self.meta("genesis")

    # --- rows --------------------------------------------------------------------------
    def insert(self, row: Row, payload: bytes, sig: bytes, state: int) -> None:
        """Append a row at the end of the store chain (inside a transaction)."""
        link = next_link(self._tip, row.id)
        self._count += 1
        self.conn.execute(
            "INSERT INTO entries(pos, id, author, seq, prev, lamport, kind, payload, sig, state, link)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (self._count, row.id, row.author, row.seq, row.prev, row.lamport, row.kind, payload, sig, state, link),
        )
        self._tip = link
        if state == LOG and self.log_moves is not None:
            self.log_moves.append((row.author, row.seq, True))
        # when this node stored it (unsigned local fact, for display: `atd ledger show`; held rows expire by it)
        self.conn.execute("INSERT OR IGNORE INTO seen(id, at) VALUES (?, ?)", (row.id, time.time()))

    def stored_at(self, ids: list[bytes]) -> dict[bytes, float]:
        """{entry id: Unix time this node stored it} for the ids it recorded a time for."""
        out: dict[bytes, float] = {}
        for i in range(0, len(ids), 500):
            part = ids[i:i + 500]
            q = f"SELECT id, at FROM seen WHERE id IN ({','.join('?' * len(part))})"
            out.update(dict(self.conn.execute(q, part)))
        return out

    def remove_rows(self, ids: set[bytes]) -> None:
        """Delete the rows `ids` and renumber / re-link every row after the first of them
        (inside a transaction). Used only to expire held entries of unknown authors."""
        if not ids:
            return
        q = ",".join("?" * len(ids))
        if self.log_moves is not None:  # (by contract held rows only; a log row would still be tracked)
            self.log_moves.extend((a, n, False) for a, n in self.conn.execute(
                f"SELECT author, seq FROM entries WHERE id IN ({q}) AND state=?", [*ids, LOG]))
        first = self.conn.execute(f"SELECT MIN(pos) FROM entries WHERE id IN ({q})", list(ids)).fetchone()[0]
        if first is None:
            return
        r = self.conn.execute("SELECT link FROM entries WHERE pos=?", (first - 1,)).fetchone()
        link = r[0] if r else ZERO
        self.conn.execute(f"DELETE FROM entries WHERE id IN ({q})", list(ids))
        self.conn.execute(f"DELETE FROM seen WHERE id IN ({q})", list(ids))
        keep = self.conn.execute("SELECT pos, id FROM entries WHERE pos>=? ORDER BY pos", (first,)).fetchall()
        self.conn.execute("UPDATE entries SET pos=-pos WHERE pos>=?", (first,))
        n = first - 1
        for pos, eid in keep:
            n += 1
            link = next_link(link, eid)
            self.conn.execute("UPDATE entries SET pos=?, link=? WHERE pos=?", (n, link, -pos))
        self._count, self._tip = n, link

    def has(self, entry_id: bytes) -> bool:
        return self.conn.execute("SELECT 1 FROM entries WHERE id=?", (entry_id,)).fetchone() is not None

    def state_of(self, entry_id: bytes) -> int | None:
        row = self.conn.execute("SELECT state FROM entries WHERE id=?", (entry_id,)).fetchone()
        return None if row is None else row[0]

    def set_state(self, row: Row, old: int, new: int) -> None:
        """Move the stored `row` from state `old` (what it holds now) to `new`."""
        self.conn.execute("UPDATE entries SET state=? WHERE id=?", (new, row.id))
        if self.log_moves is not None and (old == LOG) != (new == LOG):
            self.log_moves.append((row.author, row.seq, new == LOG))

    def rows_at(self, author: bytes, lo: int, hi: int) -> list[tuple[Row, int]]:
        """(row, state) of `author` with lo <= seq <= hi."""
        cur = self.conn.execute(
            f"SELECT {ROW_COLUMNS}, state FROM entries WHERE author=? AND seq BETWEEN ? AND ?", (author, lo, hi)
        )
        return [(Row(*r[:6]), r[6]) for r in cur]

    def log_head(self, author: bytes) -> tuple[int, bytes, int]:
        """(seq, id, lamport) of the author's last log entry, or (0, ZERO, 0)."""
        r = self.conn.execute(
            "SELECT seq, id, lamport FROM entries WHERE author=? AND state=? ORDER BY seq DESC LIMIT 1",
            (author, LOG),
        ).fetchone()
        return (r[0], r[1], r[2]) if r else (0, ZERO, 0)

    def top_row(self, author: bytes) -> tuple[Row, int] | None:
        """(row, state) of the author's highest-seq row that is not fork evidence."""
        r = self.conn.execute(
            f"SELECT {ROW_COLUMNS}, state FROM entries WHERE author=? AND state!=2 ORDER BY seq DESC LIMIT 1",
            (author,),
        ).fetchone()
        return None if r is None else (Row(*r[:6]), r[6])

    def count_waiting(self, author: bytes | None = None) -> int:
        if author is None:
            return self.conn.execute("SELECT COUNT(*) FROM entries WHERE state=?", (HELD,)).fetchone()[0]
        return self.conn.execute(
            "SELECT COUNT(*) FROM entries WHERE author=? AND state!=?", (author, LOG)
        ).fetchone()[0]

    def waiting_bytes(self, author: bytes | None = None) -> int:
        """Bytes of held rows in total, or of an author's non-log rows (held + evidence)."""
        if author is None:
            q, args = "SELECT SUM(LENGTH(payload) + LENGTH(sig)) FROM entries WHERE state=?", (HELD,)
        else:
            q, args = "SELECT SUM(LENGTH(payload) + LENGTH(sig)) FROM entries WHERE author=? AND state!=?", (author, LOG)
        return self.conn.execute(q, args).fetchone()[0] or 0

    def max_log_lamport(self) -> int:
        r = self.conn.execute("SELECT MAX(lamport) FROM entries WHERE state=?", (LOG,)).fetchone()
        return r[0] or 0

    def all_rows(self) -> list[tuple[Row, int]]:
        return [(Row(*r[:6]), r[6]) for r in self.conn.execute(f"SELECT {ROW_COLUMNS}, state FROM entries ORDER BY pos")]

    def payloads_of_kinds(self, kinds: tuple[str, ...]) -> list[tuple[bytes, bytes]]:
        q = ",".join("?" * len(kinds))
        return list(self.conn.execute(f"SELECT id, payload FROM entries WHERE kind IN ({q})", kinds))

    # --- derived caches ----------------------------------------------------------------
    def frozen_seq(self, author: bytes) -> int | None:
        r = self.conn.execute("SELECT seq FROM frozen WHERE author=?", (author,)).fetchone()
        return None if r is None else r[0]

    def set_frozen(self, author: bytes, seq: int) -> None:
        self.conn.execute("INSERT OR REPLACE INTO frozen(author, seq) VALUES (?, ?)", (author, seq))

    def all_frozen(self) -> dict[bytes, int]:
        return dict(self.conn.execute("SELECT author, seq FROM frozen"))

    def member_status(self, key: bytes) -> MemberStatus | None:
        r = self.conn.execute("SELECT admin, revoked, upto, name FROM members WHERE key=?", (key,)).fetchone()
        return None if r is None else MemberStatus(bool(r[0]), bool(r[1]), r[2], r[3])

    def all_members(self) -> dict[bytes, MemberStatus]:
        return {k: MemberStatus(bool(a), bool(rv), u, n)
                for k, a, rv, u, n in self.conn.execute("SELECT key, admin, revoked, upto, name FROM members")}

    def replace_members(self, members: dict[bytes, MemberStatus]) -> None:
        self.conn.execute("DELETE FROM members")
        self.conn.executemany(
            "INSERT INTO members(key, admin, revoked, upto, name) VALUES (?,?,?,?,?)",
            [(k, int(s.admin), int(s.revoked), s.upto, s.name) for k, s in members.items()],
        )

    def replace_frozen(self, freeze: dict[bytes, int]) -> None:
        self.conn.execute("DELETE FROM frozen")
        self.conn.executemany("INSERT INTO frozen(author, seq) VALUES (?, ?)", list(freeze.items()))
