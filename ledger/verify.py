"""Full re-verification of a ledger store from its raw rows.

First SQLite's `PRAGMA integrity_check` (pages, indexes). Then it reads rows in insertion order in batches and, for each: the position is the next one,
the Ed25519 signature verifies over DOMAIN + stored payload, the stored id is the SHA-256
of those same bytes (hashed directly, never re-encoded), the indexed columns equal the
signed fields, and the store's hash chain link is right. Then it re-derives log placement,
membership and fork points from the rows and compares them with what is stored. The first
problem raises a typed LedgerError naming the entry; success returns a `VerifyReport`.
"""
from __future__ import annotations

import hashlib
import sqlite3
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ledger.encoding import DOMAIN, decode_payload
from ledger.errors import BadSignature, LedgerError, MalformedEntry, TamperedStore
from ledger.membership import LOG, STATE_NAMES, Row, derive, why_not_logged
from ledger.store import LINK_DOMAIN, ZERO, Store

BATCH = 4096
_COLS = "pos, id, author, seq, prev, lamport, kind, payload, sig, state, link"


@dataclass(frozen=True)
class VerifyReport:
    entries: int
    log: int
    held: int
    evidence: int
    authors: int
    consortium: str | None
    equivocators: int

    def summary(self) -> str:
        return (f"ok: {self.entries} entries ({self.log} in log, {self.held} held, {self.evidence} evidence), "
                f"{self.authors} authors, consortium {self.consortium or '(none yet)'}"
                + (f", {self.equivocators} equivocating author(s)" if self.equivocators else ""))


def verify_store(store: Store) -> VerifyReport:
    """Raise the first LedgerError found in the store; return a report when it is intact."""
    try:
        _integrity(store)
        store.conn.execute("BEGIN")  # one read snapshot, even while another process appends
        try:
            return _verify(store)
        finally:
            store.conn.execute("ROLLBACK")
    except sqlite3.DatabaseError as exc:
        raise TamperedStore(f"ledger database is unreadable: {exc}") from None


def _integrity(store: Store) -> None:
    """SQLite's own page-level check: catches bit flips that leave rows readable but wrong
    (an index that disagrees with its table answers heads and queries wrongly)."""
    problems = [r[0] for r in store.conn.execute("PRAGMA integrity_check(20)")]
    if problems != ["ok"]:
        raise TamperedStore(f"ledger database failed SQLite's integrity check: {'; '.join(problems)[:300]}")


def _verify(store: Store) -> VerifyReport:
    conn = store.conn
    keys: dict[bytes, Ed25519PublicKey] = {}
    rows: list[Row] = []
    stored_state: list[int] = []
    bodies: dict[bytes, dict] = {}
    link = ZERO
    expect = 1
    sha256 = hashlib.sha256
    last: tuple = ()
    cur = conn.execute(f"SELECT {_COLS} FROM entries ORDER BY pos")
    while batch := cur.fetchmany(BATCH):
        for pos, eid, author, seq, prev, lamport, kind, payload, sig, state, link_col in batch:
            where = dict(author=author if isinstance(author, bytes) and len(author) == 32 else None,
                         seq=seq if isinstance(seq, int) else None,
                         entry_id=eid if isinstance(eid, bytes) else None)
            if pos != expect:
                raise TamperedStore(f"store row {expect} is missing or rows were reordered (found row {pos})", **where)
            if not (isinstance(eid, bytes) and isinstance(author, bytes) and isinstance(prev, bytes)
                    and isinstance(payload, bytes) and isinstance(sig, bytes) and isinstance(link_col, bytes)
                    and type(seq) is int and type(lamport) is int and isinstance(kind, str)
                    and state in STATE_NAMES):
                raise TamperedStore(f"store row {pos} has a column of the wrong type or value", **where)
            signed = DOMAIN + payload
            pk = keys.get(author)
            try:
                if pk is None:
                    pk = keys[author] = Ed25519PublicKey.from_public_bytes(author)
                pk.verify(sig, signed)
            except (InvalidSignature, ValueError):
                raise BadSignature("signature does not verify over the stored entry", **where) from None
            if sha256(signed).digest() != eid:
                raise TamperedStore("stored id is not the hash of the stored entry", **where)
            try:
                fields = decode_payload(payload, check_canonical=False)
            except LedgerError as exc:
                raise MalformedEntry(f"stored entry does not decode ({exc.reason})", **where) from None
            if fields[0] != author or fields[1] != seq or fields[2] != prev or fields[3] != lamport or fields[4] != kind:
                raise TamperedStore("stored columns disagree with the signed entry", **where)
            h = sha256(LINK_DOMAIN)
            h.update(link)
            h.update(eid)
            link = h.digest()
            if link != link_col:
                raise TamperedStore("store hash chain is broken (a row was edited, inserted or reordered)", **where)
            if kind == "genesis" or kind == "member":
                bodies[eid] = fields[5]
            rows.append(Row(eid, author, seq, prev, lamport, kind))
            stored_state.append(state)
            last = (author, seq, eid)
            expect += 1

    count = expect - 1
    tail = dict(zip(("author", "seq", "entry_id"), last)) if last else {}
    if store.meta("count") != count or store.meta("tip") != link:
        raise TamperedStore(f"store holds {count} rows but its header records {store.meta('count')} "
                            "(rows were deleted or the header edited); last intact row", **tail)

    pin = store.genesis_pin()
    try:
        d = derive(rows, bodies, pin)
    except (KeyError, TypeError, ValueError) as exc:
        raise TamperedStore(f"membership entries cannot be interpreted ({exc})") from None
    for row, state in zip(rows, stored_state):
        want = d.states[row.id]
        if want == state:
            continue
        if state == LOG:
            raise why_not_logged(row, d.freeze.get(row.author), d.membership)
        raise TamperedStore(f"entry is marked {STATE_NAMES[state]} but belongs to the "
                            f"{STATE_NAMES[want]}", author=row.author, seq=row.seq, entry_id=row.id)
    if store.all_members() != d.membership.members:
        raise TamperedStore("stored member table disagrees with the membership entries")
    from ledger.merge import stored_rotations

    if stored_rotations(store) != d.membership.rotations:
        raise TamperedStore("stored key-rotation table disagrees with the membership entries")
    if store.all_frozen() != d.freeze:
        raise TamperedStore("stored fork table disagrees with the entries")
    m = d.membership
    if store.meta("consortium") != m.consortium or store.meta("founder") != m.founder:
        raise TamperedStore("stored consortium header disagrees with the genesis entry")
    states = list(d.states.values())
    return VerifyReport(
        entries=count, log=states.count(LOG), held=states.count(1), evidence=states.count(2),
        authors=len({r.author for r in rows}), consortium=m.consortium, equivocators=len(d.freeze),
    )


__all__ = ["VerifyReport", "verify_store", "LedgerError"]
