"""Applying entries to the store inside one transaction (`Batch`), and `MergeResult`.

The common case is incremental: an entry by an active member that extends its log head
goes straight into the log and pulls in any held successors. Anything that can change
membership or reveal a fork (genesis / member entries, a conflicting or mis-linked entry,
an entry of a revoked member) marks the batch for a full re-derivation at the end
(`membership.derive` over every stored row), so the outcome never depends on arrival order.

Caps: at most MAX_WAITING_PER_AUTHOR non-log entries (and MAX_WAITING_BYTES_PER_AUTHOR bytes)
per author, and MAX_WAITING_TOTAL held entries (MAX_WAITING_BYTES_TOTAL bytes) overall, from
members and non-members alike; beyond them entries are rejected (they can be re-sent by sync
later), and held entries expire (`Ledger.expire_held`). These bound what a flood of
unadmitted keys -- or members whose chains have gaps that never close -- can make a node
store. They never apply to the `exempt` authors (the node's own key: a restored home takes
its whole chain back), and neither does the per-author rate / size quota (`ledger.quota`)
that a node applies to entries from the network.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ledger.encoding import decode_payload, pack, unpack
from ledger.entry import Entry
from ledger.errors import BrokenLink, Equivocation, LedgerError, RevokedAuthor, SeqGap, UnknownAuthor, WrongConsortium
from ledger.membership import EVIDENCE, HELD, LOG, MemberStatus, Membership, Row, derive, why_not_logged
from ledger.quota import AuthorQuota, QuotaTracker
from ledger.store import Store

MAX_WAITING_PER_AUTHOR = 1024
MAX_WAITING_TOTAL = 50_000
MAX_WAITING_BYTES_PER_AUTHOR = 16 << 20
MAX_WAITING_BYTES_TOTAL = 128 << 20


@dataclass
class MergeResult:
    """What a merge did.

    added:     ids newly in the log (the merged ones and any held ones they released), log order
    pending:   ids stored from this merge that wait (for a predecessor, an admission, the genesis)
    waiting:   id -> the typed reason it waits (SeqGap / UnknownAuthor)
    rejected:  (id or None for undecodable bytes, error) for entries not taken into the log;
               entries of revoked members and fork evidence are still kept in the store
    removed:   ids that left the log (a revocation cut or a fork came to light)
    duplicates: number of entries already stored (merge is idempotent)
    """

    added: list[bytes] = field(default_factory=list)
    pending: list[bytes] = field(default_factory=list)
    rejected: list[tuple[bytes | None, LedgerError]] = field(default_factory=list)
    waiting: dict[bytes, LedgerError] = field(default_factory=dict)
    removed: list[bytes] = field(default_factory=list)
    duplicates: int = 0


def store_membership(store: Store, authors: Iterable[bytes] | None = None) -> Membership:
    """The stored membership; with `authors`, only their member rows (what `why_not_logged`
    needs for their entries: a merge that leaves a few entries waiting does not read the
    whole member table, thousands of rows in a large consortium)."""
    if authors is None:
        members = store.all_members()
    else:
        members = {a: st for a in set(authors) if (st := store.member_status(a)) is not None}
    return Membership(store.meta("consortium"), store.genesis_pin(), store.meta("founder"), members,
                      stored_rotations(store))


def stored_rotations(store: Store) -> dict[bytes, bytes]:
    """Effective key rotations (old -> new), cached in meta by the last re-derivation."""
    raw = store.meta("rotations")
    return {bytes(a): bytes(b) for a, b in unpack(raw)} if raw else {}


def pack_rotations(rotations: dict[bytes, bytes]) -> bytes:
    return pack(sorted([k, v] for k, v in rotations.items()))


class Batch:
    """One transaction's worth of merging; call `add` per entry, then `finish`."""

    def __init__(self, store: Store, *, quota: AuthorQuota | None = None, tracker: QuotaTracker | None = None,
                 exempt: frozenset[bytes] = frozenset(),
                 statuses: dict[bytes, MemberStatus | None] | None = None) -> None:
        """`quota` (with its `tracker`): refuse entries over their author's quota (quota.py);
        `exempt`: authors whose entries bypass every quota, waiting caps included (the node's
        own key, so that a restored home takes its whole chain back at once); `statuses`:
        member rows (None: not a member) the caller read in this transaction just before."""
        self.s = store
        self.quota, self.tracker, self.exempt = quota, tracker or QuotaTracker(), exempt
        self.result = MergeResult()
        self.recompute = False
        self._before: dict[bytes, int | None] = {}  # id -> state before this batch (None: new row)
        self._stored: list[Entry] = []
        self._evidence_err: dict[bytes, LedgerError] = {}
        self._status: dict[bytes, MemberStatus | None] = dict(statuses or {})
        # Until `finish` re-derives, rows change only through this batch, so what it wrote is
        # what the store holds: the fork points it read or set, and each row's state now
        self._frozen: dict[bytes, int | None] = {}
        self._now: dict[bytes, tuple[int, int, bytes, int]] = {}  # id -> (state, lamport, author, seq)

    def _member(self, author: bytes) -> MemberStatus | None:
        if author not in self._status:
            self._status[author] = self.s.member_status(author)
        return self._status[author]

    def _insert(self, e: Entry, state: int) -> None:
        self.s.insert(Row(e.id, e.author, e.seq, e.prev, e.lamport, e.kind), e.payload, e.sig, state)
        if self.quota is not None:
            self.tracker.record(e, window_s=self.quota.window_s, quota=self.quota)
        self._before.setdefault(e.id, None)
        self._now[e.id] = (state, e.lamport, e.author, e.seq)
        self._stored.append(e)

    def _set_state(self, row: Row, old: int, new: int) -> None:
        self._before.setdefault(row.id, old)
        self._now[row.id] = (new, row.lamport, row.author, row.seq)
        self.s.set_state(row, old, new)

    def add(self, e: Entry) -> LedgerError | None:
        """Store `e` (signature already verified) if acceptable; return the rejection error otherwise."""
        s = self.s
        if s.has(e.id):
            self.result.duplicates += 1
            return None
        where = dict(author=e.author, seq=e.seq, entry_id=e.id)
        if e.kind == "genesis":
            pin = s.genesis_pin()
            if pin is None:
                s.set_meta("genesis", e.id)
            elif pin != e.id:
                return WrongConsortium(f"genesis of another consortium (this ledger is pinned to {pin.hex()})", **where)
            self.recompute = True
        if e.author not in self._frozen:
            self._frozen[e.author] = s.frozen_seq(e.author)
        frozen = self._frozen[e.author]
        rotate_at_fork = e.seq == frozen and e.kind == "member" and e.body.get("action") == "rotate"
        if frozen is not None and e.seq >= frozen and not rotate_at_fork:  # a rotation there decides (membership.py)
            return Equivocation(f"author forked its chain at seq {frozen}; its later entries are refused", **where)

        fork: int | None = None
        err: LedgerError | None = None
        near = s.rows_at(e.author, e.seq - 1, e.seq + 1)
        for r, _ in near:
            if r.seq == e.seq:
                fork, err = e.seq, Equivocation("two different entries signed for the same seq", **where)
            elif r.seq == e.seq - 1 and (e.prev != r.id or e.lamport <= r.lamport):
                fork = e.seq if fork is None else min(fork, e.seq)
                err = err or BrokenLink("prev does not name the author's previous entry, "
                                        "or its lamport clock does not increase", **where)
            elif r.seq == e.seq + 1 and (r.prev != e.id or r.lamport <= e.lamport):
                fork = e.seq + 1 if fork is None else min(fork, e.seq + 1)
        if fork is not None:
            f = fork if frozen is None else min(fork, frozen)
            self.s.set_frozen(e.author, f)
            self._frozen[e.author] = f
            self.recompute = True
            state = EVIDENCE if e.seq >= f else HELD
            if state == EVIDENCE:
                self._evidence_err[e.id] = err or Equivocation(f"author forked its chain at seq {f}", **where)
            self._insert(e, state)
            return None

        own = e.author in self.exempt
        if self.quota is not None and not own:
            over = self.tracker.check(self.quota, e)
            if over is not None:
                return over
        status = self._member(e.author)
        head_seq = s.log_head(e.author)[0]
        if status is not None and not status.revoked and e.seq == head_seq + 1:
            self._insert(e, LOG)
            if e.kind in ("member", "genesis"):
                self.recompute = True
            if any(r.seq == e.seq + 1 for r, _ in near):
                self._promote(e.author, e.seq + 1)
            return None

        size = len(e.payload) + len(e.sig)
        if not own and (s.count_waiting(e.author) >= MAX_WAITING_PER_AUTHOR or (
            s.waiting_bytes(e.author) + size > MAX_WAITING_BYTES_PER_AUTHOR
        ) or s.count_waiting() >= MAX_WAITING_TOTAL or s.waiting_bytes() + size > MAX_WAITING_BYTES_TOTAL):
            cls = UnknownAuthor if status is None else SeqGap
            return cls("too many entries of this author are already waiting", **where)
        self._insert(e, HELD)
        if e.kind in ("member", "genesis") or (status is not None and status.revoked):
            self.recompute = True
        return None

    def _promote(self, author: bytes, seq: int) -> None:
        """Move held successors that now continue the log head into the log."""
        while True:
            near = self.s.rows_at(author, seq, seq)
            if len(near) != 1 or near[0][1] != HELD:
                return
            row = near[0][0]
            self._set_state(row, HELD, LOG)
            if row.kind in ("member", "genesis"):
                self.recompute = True
            seq += 1

    def _rederive(self) -> None:
        s = self.s
        rows = s.all_rows()
        bodies = {i: decode_payload(p, check_canonical=False)[5] for i, p in s.payloads_of_kinds(("genesis", "member"))}
        d = derive((r for r, _ in rows), bodies, s.genesis_pin())
        for r, old in rows:
            new = d.states[r.id]
            if new != old:
                self._set_state(r, old, new)
        s.replace_members(d.membership.members)
        s.replace_frozen(d.freeze)
        if d.membership.rotations or s.meta("rotations") is not None:
            s.set_meta("rotations", pack_rotations(d.membership.rotations))
        for key, value in (("consortium", d.membership.consortium), ("founder", d.membership.founder)):
            if value is None:
                s.conn.execute("DELETE FROM meta WHERE key=?", (key,))
            else:
                s.set_meta(key, value)

    def finish(self) -> MergeResult:
        """Re-derive if needed and fill in the result (call inside the transaction)."""
        if self.recompute:
            self._rederive()
        s, res = self.s, self.result
        final: dict[bytes, int] = {}
        placed: list[tuple[tuple, bytes]] = []
        for entry_id, old in self._before.items():
            new, lamport, author, seq = s.conn.execute(  # after a re-derivation: read what it decided
                "SELECT state, lamport, author, seq FROM entries WHERE id=?", (entry_id,)).fetchone() \
                if self.recompute else self._now[entry_id]
            final[entry_id] = new
            if new == LOG and old != LOG:
                placed.append(((lamport, author, seq), entry_id))
            elif old == LOG and new != LOG:
                res.removed.append(entry_id)
        res.added = [i for _, i in sorted(placed)]
        waiting = [e for e in self._stored if final[e.id] != LOG]
        membership = store_membership(s, {e.author for e in waiting}) if waiting else None
        for e in waiting:
            row = Row(e.id, e.author, e.seq, e.prev, e.lamport, e.kind)
            if final[e.id] == EVIDENCE:
                res.rejected.append((e.id, self._evidence_err.get(e.id)
                                     or why_not_logged(row, s.frozen_seq(e.author), membership)))
                continue
            why = why_not_logged(row, s.frozen_seq(e.author), membership)
            if isinstance(why, RevokedAuthor):
                res.rejected.append((e.id, why))
            else:
                res.pending.append(e.id)
                res.waiting[e.id] = why
        return res
