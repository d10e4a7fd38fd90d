"""`Ledger`: the public face of the replicated, signed, hash-chained log (SQLite-backed).

    led = Ledger.open(path)                         # creates tables; WAL
    e = led.append(signer, "hello", {...})          # seq / prev / lamport filled in, signed, stored
    res = led.merge(entries_or_wire_bytes)          # idempotent, order independent
    led.verify()                                    # raises the first LedgerError, or returns a report

Log order is (lamport, author, seq). Only entries in the log are returned by `query`,
`all_entries`, `heads` and (by default) `get` / `entries_after`; held entries (waiting for a
predecessor or an admission) and fork evidence stay in the store. See membership.py for
the rules. A Ledger object is safe to share between threads (one lock); several
processes may open the same file (SQLite locking, one transaction per append / merge).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ledger.encoding import decode_payload
from ledger.entry import Entry
from ledger.errors import (
    Equivocation, LedgerError, MalformedEntry, MalformedId, NotAdmin, RefusedBody, RevokedAuthor, UnknownAuthor,
    WrongConsortium,
)
from ledger.heads import Heads
from ledger.keys import Signer
from ledger.membership import EVIDENCE, HELD, LOG, STATE_NAMES, Membership, Row
from ledger.keys import intern_key, peer_id_from_public_key
from ledger.merge import Batch, MergeResult, store_membership, stored_rotations
from ledger.quota import AuthorQuota, QuotaTracker
from ledger.store import ZERO, Store, commits_to
from ledger.verify import VerifyReport, verify_store

log = logging.getLogger(__name__)

BodyCheck = Callable[[Entry], "str | None"]  # why an entry's body does not fit its kind, or None
REFUSAL_LOG_EVERY_S = 60.0
_SELECT = "SELECT payload, sig, id FROM entries"
_ORDER = " ORDER BY lamport, author, seq"
_MEMBER_KINDS = ("member", "genesis")  # change membership: always appended through Batch


def _entry(row: tuple) -> Entry:
    payload, sig, entry_id = row
    return Entry._trusted(payload, sig, decode_payload(payload, check_canonical=False), entry_id)


def raw_id(entry_id: bytes | str) -> bytes:
    """An entry id as bytes: bytes as they are, a str as the hex digits it spells (how bodies,
    the CLI and JSON carry ids; one of another length names no entry); MalformedId for a str
    that is not hex, or anything else (a list a hostile body put where an id belongs)."""
    if isinstance(entry_id, str):
        try:
            return bytes.fromhex(entry_id)
        except ValueError:
            pass
    elif isinstance(entry_id, (bytes, bytearray, memoryview)):
        return bytes(entry_id)
    raise MalformedId(f"not a hex entry id: {entry_id!r:.80}")


class Ledger:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.RLock()
        self._heads = Heads()  # see heads()
        self._members: tuple[tuple[int, int], frozenset[bytes]] | None = None  # see member_keys()
        self.quota_tracker = QuotaTracker()  # what merges with a quota stored lately, per author
        self._refusal_logged: dict[bytes, float] = {}  # author -> when a refused body of it was last logged

    @classmethod
    def open(cls, path: str | Path, *, genesis_id: bytes | None = None) -> "Ledger":
        """Open (or create) the ledger at `path`; `genesis_id` pins the consortium (WrongConsortium
        if the ledger is already pinned to another). An unpinned ledger adopts the first genesis
        entry it stores."""
        store = Store(path)
        if genesis_id is not None:
            if not isinstance(genesis_id, bytes) or len(genesis_id) != 32:
                store.close()
                raise MalformedEntry("a genesis id is 32 bytes")
            with store.transaction():
                pin = store.genesis_pin()
                if pin is None:
                    store.set_meta("genesis", genesis_id)
            if pin is not None and pin != genesis_id:
                store.close()
                raise WrongConsortium(f"ledger is pinned to genesis {pin.hex()}, not {genesis_id.hex()}")
        return cls(store)

    def close(self) -> None:
        with self._lock:
            self._store.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _writing(self, *, durable: bool = False) -> Iterator[None]:
        """One write transaction (under the lock) that keeps the cached heads current
        (ledger.heads): when they were current as it began -- read under SQLite's write lock,
        so nothing another connection commits can slip in between -- the rows that entered
        or left the log meanwhile (`Store.log_moves`) make the new map as it commits.
        Otherwise nothing is tracked, and the next `heads()` reads the log again."""
        s, h = self._store, self._heads
        with self._lock:
            new = None
            with s.transaction(durable=durable):
                track = h.current(self._change_token())
                s.log_moves = [] if track else None
                try:
                    yield
                    if track and s.log_moves:
                        new = h.moved(s, s.log_moves)  # inside the transaction: reads its rows
                finally:
                    s.log_moves = None
            if track:  # committed
                h.committed(s.commit_token, new)

    @property
    def path(self) -> str:
        return self._store.path

    @property
    def genesis_id(self) -> bytes | None:
        with self._lock:
            return self._store.genesis_pin()

    # --- writing -----------------------------------------------------------------------
    def append(self, signer: Signer, kind: str, body: dict) -> Entry:
        """Sign and store the signer's next entry (one transaction). Raises Equivocation /
        RevokedAuthor for a signer that may not write, NotAdmin / UnknownAuthor for a member
        entry it may not make, WrongConsortium for a second genesis. The entry of a signer
        not (yet) admitted is stored held and enters the log once its admission arrives.
        The entry is durable (fsynced) when this returns."""
        with self._writing(durable=True):
            return self._append_one(signer, kind, body)

    def append_many(self, signer: Signer, items: list[tuple[str, dict]]) -> list[Entry | LedgerError]:
        """Group commit: sign and store several of the signer's next entries in one
        durable transaction -- one WAL fsync for all of them. Item i's result is its Entry, or
        the LedgerError `append` would have raised for it (then nothing of it was stored and
        the next item takes its seq). Every stored entry is durable when this returns; an
        error outside the ledger rules (disk, SQLite) rolls the whole group back and is raised:
        then none of them was stored -- and none may have been shown to anyone (the caller
        gossips only what this returned)."""
        out: list[Entry | LedgerError] = []
        with self._writing(durable=True):
            last: Entry | None = None  # the group's previous entry, when it went into the log
            for kind, body in items:
                try:
                    if last is not None and kind not in _MEMBER_KINDS:
                        e = last = self._append_next(signer, kind, body, last)
                    else:
                        e = self._append_one(signer, kind, body)
                        plain = kind not in _MEMBER_KINDS and self._store.state_of(e.id) == LOG
                        last = e if plain else None
                    out.append(e)
                except LedgerError as exc:  # raised before anything of this item was stored
                    out.append(exc)
        return out

    def _append_next(self, signer: Signer, kind: str, body: dict, last: Entry) -> Entry:
        """The entry after `last` in the same transaction, without `_append_one`'s queries.

        Valid only while `last` -- the signer's own entry, not a member / genesis one -- went
        into the log in this transaction: then the signer is an admitted, non-revoked member
        whose chain is not frozen (nothing else writes inside the transaction), `last` is
        its tip with nothing stored above it, and `last.lamport` is the log's highest clock.
        So the next entry continues the log head, exactly what `Batch.add` would decide."""
        e = Entry.create(signer, seq=last.seq + 1, prev=last.id, lamport=last.lamport + 1, kind=kind, body=body)
        self._store.insert(Row(e.id, e.author, e.seq, e.prev, e.lamport, e.kind), e.payload, e.sig, LOG)
        return e

    def _append_one(self, signer: Signer, kind: str, body: dict) -> Entry:
        """`append`'s work inside the caller's transaction (it fsyncs on commit)."""
        s = self._store
        me = signer.public_key
        if s.frozen_seq(me) is not None:
            raise Equivocation("this key forked its chain; it may not append", author=me)
        status = s.member_status(me)
        if status is not None and status.revoked:
            new = stored_rotations(s).get(me)
            if new is not None:
                raise RevokedAuthor(f"this key was rotated to {peer_id_from_public_key(new)}; "
                                    "it may not sign new entries (use the node's new key)", author=me)
            raise RevokedAuthor("this key's membership was revoked", author=me)
        if kind == "member":
            self._check_member_change(signer, body, store_membership(s))
        seq, prev, own_lamport = self._tip(me)
        if kind == "genesis":
            if s.genesis_pin() is not None:
                raise WrongConsortium("this ledger already belongs to a consortium")
            if seq != 0:
                raise MalformedEntry("a genesis must be its author's first entry", author=me)
        lamport = max(s.max_log_lamport(), own_lamport) + 1
        e = Entry.create(signer, seq=seq + 1, prev=prev, lamport=lamport, kind=kind, body=body)
        batch = Batch(s, exempt=frozenset((me,)))  # own entries: no waiting cap
        err = batch.add(e)
        if err is not None:
            raise err
        batch.finish()
        return e

    def _tip(self, author: bytes) -> tuple[int, bytes, int]:
        """(seq, id, lamport) of the author's last contiguous stored entry, held ones included."""
        top = self._store.top_row(author)
        if top is None:
            return 0, ZERO, 0
        if top[1] == LOG:  # the common case: no held rows above the log head
            return top[0].seq, top[0].id, top[0].lamport
        seq, eid, lamport = self._store.log_head(author)
        while True:
            near = self._store.rows_at(author, seq + 1, seq + 1)
            if len(near) != 1 or near[0][1] != HELD or (seq and near[0][0].prev != eid):
                return seq, eid, lamport
            row = near[0][0]
            seq, eid, lamport = row.seq, row.id, row.lamport

    @staticmethod
    def _check_member_change(signer: Signer, body: dict, m: Membership) -> None:
        me = signer.public_key
        target = body.get("member") if isinstance(body, dict) else None
        if isinstance(body, dict) and body.get("action") == "rotate":
            if not m.is_member(me):
                raise UnknownAuthor("only an admitted, non-revoked member can rotate its key", author=me)
            if isinstance(target, bytes) and (target in m.members or target in m.rotations.values()):
                raise MalformedEntry("the new key must be fresh (it is already known to this consortium)",
                                     author=target)
            return
        status = m.members.get(target) if isinstance(target, bytes) else None
        if body.get("action") == "revoke" and status is not None and target in m.rotations:
            raise RevokedAuthor(f"that key was rotated to {peer_id_from_public_key(m.current(target))}; "
                                "revoke the current key", author=target)
        if not m.is_admin(me):
            raise NotAdmin("only an admin can admit, revoke or restore members", author=me)
        if body.get("action") == "restore":
            if status is None:
                raise UnknownAuthor("cannot restore a key that is not a member", author=target)
            if target in m.keys_of(me) or me in m.keys_of(m.current(target)):
                raise NotAdmin("an identity cannot restore itself: another admin settles its rotation", author=me)
            if status.admin and not m.is_founder(target) and not m.is_founder(me):
                raise NotAdmin("only the founder can restore an admin", author=me)
            return
        status = m.members.get(target) if isinstance(target, bytes) else None
        if body.get("action") == "admit":
            if status is not None and status.revoked:
                raise RevokedAuthor("that key was revoked; revocation is permanent", author=target)
            if body.get("admin") and not m.is_founder(me):
                raise NotAdmin("only the founder can grant admin", author=me)
        elif body.get("action") == "revoke":
            if target == m.founder or m.is_founder(target):
                raise NotAdmin("the founder cannot be revoked", author=me)
            if status is None:
                raise UnknownAuthor("cannot revoke a key that is not a member", author=target)
            if status.admin and not m.is_founder(me):
                raise NotAdmin("only the founder can revoke an admin", author=me)

    def create_genesis(self, signer: Signer, consortium: str, members: Iterable[tuple[bytes, bool]] = ()) -> Entry:
        """The founder's genesis entry: consortium name, founder (admin), optional initial members."""
        body = {"consortium": consortium, "founder": signer.public_key,
                "members": [[bytes(k), bool(a)] for k, a in members]}
        return self.append(signer, "genesis", body)

    def admit(self, signer: Signer, key: bytes, *, admin: bool = False, name: str | None = None) -> Entry:
        """Append a `member` entry admitting `key` (only an admin may; only the founder grants admin)."""
        body: dict = {"action": "admit", "member": key, "admin": admin}
        if name:
            body["name"] = name
        return self.append(signer, "member", body)

    def revoke(self, signer: Signer, key: bytes) -> Entry:
        """Revoke `key` (or the key it rotated to), accepting its entries up to the highest seq
        this ledger has in its log."""
        key = self.membership().current(key)
        upto = self.heads().get(key, 0)
        return self.append(signer, "member", {"action": "revoke", "member": key, "upto": upto})

    def rotate(self, old: Signer, new: Signer) -> Entry:
        """Move `old`'s membership to the fresh key `new`: a `member` rotate entry signed by `old`
        carrying `new`'s signature over the rotation. `old`'s earlier entries stay valid; it can
        sign nothing after this one. Raises UnknownAuthor / RevokedAuthor if `old` may not write,
        MalformedEntry if `new` is already known here."""
        from ledger.entry import rotation_message

        proof = new.sign(rotation_message(old.public_key, new.public_key))
        return self.append(old, "member", {"action": "rotate", "member": new.public_key, "proof": proof})

    def rival_rotations(self, key: bytes) -> dict[bytes, Entry]:
        """new key -> rotate entry, for `key` frozen by two or more valid rotations at one seq
        (the owner's and a thief's, see membership.py); {} when `key` is not so contested."""
        from ledger.entry import rotation_proof_ok

        with self._lock:
            f = self._store.frozen_seq(key)
        if f is None:
            return {}
        before = self.get(next((r.id for r, st in self._store.rows_at(key, f - 1, f - 1) if st == LOG), ZERO))
        out: dict[bytes, Entry] = {}
        for row, _ in self._store.rows_at(key, f, f):
            e = self.get(row.id, include_held=True)
            if e is None or e.kind != "member" or not rotation_proof_ok(key, e.body):
                continue
            if f > 1 and (before is None or e.prev != before.id or e.lamport <= before.lamport):
                continue
            out[e.body["member"]] = e
        return out if len(out) > 1 else {}

    def restore(self, signer: Signer, old: bytes, new: bytes) -> Entry:
        """Settle `old`'s contested rotation in favour of `new` (an admin's `member` restore
        entry; membership.py gives the rule): `new` must be the target of one of the valid
        rotations competing at the seq where `old` froze. The founder signs it when `old`
        is an admin. Raises MalformedEntry when `old` is not so contested or `new` is not
        one of its rotations' keys, NotAdmin when `signer` may not settle it."""
        rivals = self.rival_rotations(old)
        if not rivals:
            raise MalformedEntry(f"{peer_id_from_public_key(old)} has no contested rotation to restore "
                                 "(two valid rotations at one seq)", author=old)
        if new not in rivals:
            raise MalformedEntry(f"{peer_id_from_public_key(new)} is not a key {peer_id_from_public_key(old)} "
                                 f"rotated to (its rotations name {', '.join(sorted(peer_id_from_public_key(k) for k in rivals))})",
                                 author=new)
        return self.append(signer, "member", {"action": "restore", "member": old, "key": new})

    def merge(self, items: Iterable[Entry | bytes], *, members_only: bool = False,
              quota: AuthorQuota | None = None, exempt: Iterable[bytes] = (),
              check: BodyCheck | None = None) -> MergeResult:
        """Verify and store foreign entries in one transaction; never raises for bad entries
        (they are listed in `.rejected`).

        `members_only` (what a node uses for entries from the network): an entry is stored
        only if its author is a member whose entry at that seq the log accepts, once the
        membership entries of this same batch are applied; the others are rejected
        (UnknownAuthor / RevokedAuthor) and never stored, so outsiders cannot make the
        store grow. The genesis entry is always eligible. Without it, entries of
        not-yet-admitted keys are stored held and wait for their admission.

        `quota` (entries from the network): an entry over its author's size or
        rate quota (ledger/quota.py) is rejected with QuotaExceeded and not stored.
        `exempt`: authors none of the quotas or waiting caps apply to (the node's own key); with
        members_only their entries are stored (held) even before their admission is known, so
        a restored home takes its chain back in one pull whatever order it arrives in.

        `check` (entries from the network): the body spec, a callable returning why an
        entry's body does not fit its kind (None when it does; the ledger knows no kinds
        but genesis / member). An entry it refuses is rejected with RefusedBody, logged
        (once per author per minute) and not stored. Its author's chain then does not link
        past that seq on this node: the later entries wait as a chain gap (bounded per
        author and in total, and they expire, `expire_held`), so an author that signs a
        malformed body is in effect frozen there on every node that runs the same spec,
        without any record of the refusal to keep consistent; a node whose spec accepts
        the body later (an upgrade) takes it and the rest of the chain from sync. The
        `exempt` authors' entries are not checked (the node's own, checked when written:
        refusing one would make the node sign that seq again)."""
        parsed: list[Entry] = []
        early: list[tuple[bytes | None, LedgerError]] = []
        own = frozenset(exempt)
        for item in items:
            try:
                e = item if isinstance(item, Entry) else Entry.from_bytes(item)
                e.verify()
                why = None if check is None or e.author in own or e.kind in _MEMBER_KINDS else check(e)
                if why is not None:
                    raise self._refused(e, why)
                parsed.append(e)
            except LedgerError as exc:
                early.append((exc.entry_id if isinstance(item, (bytes, bytearray)) else getattr(item, "id", None), exc))
        opts = dict(quota=quota, tracker=self.quota_tracker, exempt=own)
        with self._writing():
            if members_only:
                return self._merge_members_only(parsed, early, opts)
            batch = Batch(self._store, **opts)
            rejected = list(early)
            for e in parsed:
                err = batch.add(e)
                if err is not None:
                    rejected.append((e.id, err))
            res = batch.finish()
            res.rejected = rejected + res.rejected
            return res

    def _refused(self, e: Entry, why: str) -> RefusedBody:
        err = RefusedBody(f"{e.kind} entry body refused: {why}", author=e.author, seq=e.seq, entry_id=e.id)
        now = time.monotonic()
        if now - self._refusal_logged.get(e.author, -1e18) >= REFUSAL_LOG_EVERY_S:
            if len(self._refusal_logged) >= 4096:
                self._refusal_logged.clear()
            self._refusal_logged[e.author] = now
            log.warning("merge: %s", err)
        return err

    def expire_held(self, ttl: float, *, now: float | None = None, keep: Iterable[bytes] = ()) -> int:
        """Delete held entries first held more than `ttl` seconds ago; returns how many.

        Held entries wait for a predecessor (a chain gap), an admission, or the genesis;
        what non-members -- or a member whose chain has a gap that never closes, e.g.
        behind a refused entry -- can park here expires. Genesis entries and those of the
        `keep` authors (the node's own key: its signed entries waiting for its admission
        must never be lost, or it would sign those seqs again) are kept. Sync fetches an
        expired entry again if it ever becomes admissible (a gap that closes later, an
        admission that arrives after the ttl)."""
        now = time.time() if now is None else now
        keep = set(keep)
        with self._writing():
            c = self._store.conn
            c.execute("INSERT OR IGNORE INTO seen(id, at) SELECT id, ? FROM entries WHERE state=?", (now, HELD))
            ids = {r[0] for r in c.execute(
                "SELECT e.id, e.author FROM entries e JOIN seen h ON h.id = e.id WHERE e.state=? AND h.at<?"
                " AND e.kind!='genesis'", (HELD, now - ttl))
                if r[1] not in keep}
            self._store.remove_rows(ids)
            return len(ids)

    def _merge_members_only(self, parsed: list[Entry], early: list, opts: dict) -> MergeResult:
        """Rounds of `Batch`es in one transaction: each stores the entries whose authors are
        (by then) accepted members; admissions stored in one round admit the next round's."""
        total = MergeResult(rejected=list(early))
        todo = list(parsed)
        own = opts["exempt"]  # the node's own entries are kept (held) even before it learns it is a member
        while todo:
            m = self._batch_membership(todo)
            ok = [e.kind == "genesis" or e.author in own or m.accepts(e.author, e.seq) for e in todo]
            ready = [e for e, y in zip(todo, ok) if y]
            if not ready:
                break
            todo = [e for e, y in zip(todo, ok) if not y]
            statuses = {e.author: m.members.get(e.author) for e in ready}  # (just read, as the batch would)
            batch = Batch(self._store, **opts, statuses=statuses)
            for e in ready:
                err = batch.add(e)
                if err is not None:
                    total.rejected.append((e.id, err))
            res = batch.finish()
            total.added += res.added
            total.pending += res.pending
            total.waiting.update(res.waiting)
            total.rejected += res.rejected
            total.removed += res.removed
            total.duplicates += res.duplicates
        m = self._batch_membership(todo)
        for e in todo:
            where = dict(author=e.author, seq=e.seq, entry_id=e.id)
            status = m.members.get(e.author)
            total.rejected.append((e.id, UnknownAuthor("author is not a member; entry not stored", **where)
                                   if status is None else RevokedAuthor(f"author was revoked after seq {status.upto}; "
                                                                        "entry not stored", **where)))
        return total

    def _batch_membership(self, entries: list[Entry]) -> Membership:
        """The membership rows of just these entries' authors (what `accepts` needs): a
        gossip batch looks up a few authors, not the whole member table (a
        consortium of thousands pays per merge for the authors it merges, not for everyone)."""
        statuses = {a: self._store.member_status(a) for a in {e.author for e in entries}}
        return Membership(None, None, None, {a: st for a, st in statuses.items() if st is not None}, {})

    # --- reading -----------------------------------------------------------------------
    def get(self, entry_id: bytes | str, *, include_held: bool = False) -> Entry | None:
        """The entry with this id (32 bytes, or its 64 hex digits) in the log (or held, with
        include_held); None if not stored; a str that is not hex raises MalformedId (a ValueError)."""
        entry_id = raw_id(entry_id)
        with self._lock:
            q = _SELECT + " WHERE id=?" + ("" if include_held else " AND state=0")
            row = self._store.conn.execute(q, (entry_id,)).fetchone()
            return None if row is None else _entry(row)

    def find_prefix(self, prefix: str, *, kinds: tuple[str, ...] | None = None, limit: int = 2) -> list[Entry]:
        """Log entries whose hex id starts with `prefix` (hex digits, any length), optionally
        of `kinds`; at most `limit` of them (an index range scan, not a full scan)."""
        p = prefix.lower()
        if not p or len(p) > 64 or any(c not in "0123456789abcdef" for c in p):
            return []
        lo, hi = bytes.fromhex((p + "0" * 64)[:64]), bytes.fromhex((p + "f" * 64)[:64])
        q, args = _SELECT + " WHERE id BETWEEN ? AND ? AND +state=0", [lo, hi]  # (+: by the id index)
        if kinds:
            q, args = q + f" AND kind IN ({','.join('?' * len(kinds))})", args + list(kinds)
        with self._lock:
            return [_entry(r) for r in self._store.conn.execute(q + " LIMIT ?", args + [limit])]

    def state(self, entry_id: bytes | str) -> str | None:
        """'log', 'held', 'evidence', or None when not stored (the id as bytes or hex, as `get`)."""
        entry_id = raw_id(entry_id)
        with self._lock:
            st = self._store.state_of(entry_id)
            return None if st is None else STATE_NAMES[st]

    def query(self, kind: str | None = None, author: bytes | None = None) -> list[Entry]:
        """Log entries, optionally of one kind and/or author, in log order.

        With an author, its chain index (author, seq) finds its rows; with a kind only, the
        kind index: SQLite left to itself (no statistics) walks the whole log in log order
        instead, to skip a sort -- one author's hello, or a kind with no entries, then cost a
        read of every log row (a daemon looking up a peer's hello in a log of
        1,000 members read 1,000 rows per peer)."""
        if author is not None:
            q, args = _SELECT + " INDEXED BY entries_chain WHERE author=? AND state=0", [author]
            if kind is not None:
                q, args = q + " AND kind=?", args + [kind]
        elif kind is not None:
            q, args = _SELECT + " INDEXED BY entries_kind WHERE kind=? AND state=0", [kind]
        else:
            q, args = _SELECT + " WHERE state=0", []
        with self._lock:
            return [_entry(r) for r in self._store.conn.execute(q + _ORDER, args)]

    def stored_at(self, ids: list[bytes]) -> dict[bytes, float]:
        """{entry id: Unix time this node stored the entry} (a local, unsigned fact; entries
        stored before this was recorded have none)."""
        with self._lock:
            return self._store.stored_at(list(ids))

    def all_entries(self) -> list[Entry]:
        """Every entry of the log in merged order (lamport, author, seq); held entries excluded."""
        return self.query()

    def heads(self, *, copy: bool = True) -> dict[bytes, int]:
        """author -> highest seq in the log (contiguous from 1 by construction). `copy=False`:
        the cached map itself (read it, never change it; one map per ledger, not two).

        Cached until another connection writes (ledger.heads: this object's own writes keep
        it current)."""
        with self._lock:
            heads = self._heads.read(self._store.conn, self._change_token())
            return dict(heads) if copy else heads

    def heads_since(self, version: int | None) -> tuple[int, dict[bytes, int], set[bytes] | None]:
        """(version, `heads(copy=False)`, the authors whose head differs from the map of that
        earlier `version` -- or None when that is not known: no version given, a rebuild
        since, or more than `ledger.heads.HEADS_LOG` maps ago). A cached view of the heads
        (`atdnode.replication.sync_digest`) then updates only those authors instead of comparing two maps
        of every author."""
        with self._lock:
            heads = self.heads(copy=False)
            return self._heads.version, heads, self._heads.since(version)

    def change_token(self) -> tuple[int, int]:
        """A value that moves whenever any connection may have written the database: what a
        cached view of the log (`heads`, atdnode.replication.sync_digest's vector) is keyed on."""
        with self._lock:
            return self._change_token()

    def _change_token(self) -> tuple[int, int]:
        """Changes when any connection (this one or another process's) wrote the database:
        what the cached heads are keyed on. Call with the lock held."""
        return self._store.change_token()

    def local_writes(self) -> tuple[int, int]:
        """Moves whenever a connection of *this process* commits to this ledger's file, or this
        connection writes anything -- without a query: what a harness that holds every writer
        of its ledgers in one process (netsim.memnet) keys a cache on. Another process's
        writes do not move it (`change_token` sees those)."""
        with self._lock:
            return commits_to(self._store.path), self._store.conn.total_changes

    def heads_of(self, authors: Iterable[bytes]) -> dict[bytes, int]:
        """`heads()` of just these authors (those with no log entry left out): from the cache
        while the database is unchanged, else one chain-index lookup per author -- not a scan of
        every head (a harness polling a few authors' heads of many ledgers)."""
        keys = list(dict.fromkeys(authors))
        with self._lock:
            if self._heads.current(self._change_token()):
                h = self._heads.map
                return {a: h[a] for a in keys if a in h}
            return {a: seq for a in keys if (seq := self._store.log_head(a)[0])}

    def head_of(self, author: bytes) -> int:
        """`heads().get(author, 0)` for one author (an index lookup, not a scan of every head)."""
        with self._lock:
            return self._store.log_head(author)[0]

    def entries_after(self, author: bytes, seq: int, *, include_held: bool = False) -> list[Entry]:
        """The author's entries with seq > `seq`, ascending (log only unless include_held)."""
        q = _SELECT + " WHERE author=? AND seq>?" + (f" AND state!={EVIDENCE}" if include_held else " AND state=0")
        with self._lock:
            return [_entry(r) for r in self._store.conn.execute(q + " ORDER BY seq", (author, seq))]

    def forks(self) -> dict[bytes, int]:
        """author -> the seq its chain forked at (its rows from there are evidence)."""
        with self._lock:
            return self._store.all_frozen()

    def rows_between(self, author: bytes, lo: int, hi: int) -> list[Entry]:
        """Every stored entry of `author` with lo <= seq <= hi, whatever its state (fork
        evidence included), by seq then id."""
        with self._lock:
            return [_entry(r) for r in self._store.conn.execute(
                _SELECT + " WHERE author=? AND seq BETWEEN ? AND ? ORDER BY seq, id", (author, lo, hi))]

    def membership(self) -> Membership:
        """Who is a member now: founder, members with admin / revoked / upto / name, key rotations."""
        with self._lock:
            return store_membership(self._store)

    def member_keys(self) -> frozenset[bytes]:
        """Keys of the admitted, non-revoked members (`Membership.is_member`), interned.

        Cached until the database changes (`change_token`: our own writes and any other
        connection's), so an admission or revocation shows at the next call; while the set is
        unchanged the same object is returned (a caller can tell "unchanged" by `is`). One
        indexed read of the member table, no `MemberStatus` per member (a daemon reads this
        at every start and after every merge that carried a member entry)."""
        with self._lock:
            token = self._change_token()
            cached = self._members
            if cached is None or cached[0] != token:
                keys = frozenset(intern_key(k) for (k,) in self._store.conn.execute(
                    "SELECT key FROM members WHERE revoked=0"))
                self._members = (token, cached[1] if cached is not None and cached[1] == keys else keys)
            return self._members[1]

    def stats(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._store.conn.execute("SELECT state, COUNT(*) FROM entries GROUP BY state"))
        return {name: counts.get(st, 0) for st, name in STATE_NAMES.items()}

    def kind_counts(self) -> dict[str, int]:
        """Entries in the log, by kind."""
        with self._lock:
            return dict(self._store.conn.execute("SELECT kind, COUNT(*) FROM entries WHERE state=0 GROUP BY kind"))

    def raw_rows(self) -> list[bytes]:
        """Wire bytes of every stored entry: log first (log order), then held and evidence."""
        with self._lock:
            cur = self._store.conn.execute(
                "SELECT payload, sig FROM entries ORDER BY state != 0, CASE WHEN state=0 THEN lamport END,"
                " CASE WHEN state=0 THEN author END, CASE WHEN state=0 THEN seq END, pos")
            from ledger.encoding import encode_wire

            return [encode_wire(p, s) for p, s in cur]

    def verify(self) -> VerifyReport:
        """Re-verify every stored row (see verify.py); raises the first LedgerError."""
        with self._lock:
            return verify_store(self._store)


__all__ = ["Ledger", "MergeResult", "LOG", "HELD", "EVIDENCE", "ZERO"]
