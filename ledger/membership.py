"""Which stored entries form the log: a pure function of the stored set (`derive`).

Merge applies the common case incrementally; whenever membership or a fork changes it
re-runs `derive` over every stored row, and `verify` re-runs it to check the stored
states. Because the result depends only on the *set* of stored entries, merging the same
entries in any order gives the same log.

Rules (per author X; "chain" = X's stored rows at seq 1, 2, ... while contiguous):

* Forks. X is *frozen* at seq F, the smallest seq where X signed two different entries,
  or where X's entry at F does not link to X's entry at F-1 (wrong `prev`, or a lamport
  clock that does not increase). Rows at seq >= F are evidence, never in the log, and
  merge refuses X's further entries at seq >= F (Equivocation).
* Genesis. The log starts from the pinned genesis entry (seq 1 of the *founder*). With no
  genesis yet, every entry waits.
* Admins are the founder, genesis members flagged admin, and keys the founder admitted
  with ``admin: true``. Only the founder's entries grant admin or revoke an admin; the
  founder cannot be revoked. Admin power is a property of the key, not of time: a member
  entry counts if it lies in an admin's accepted prefix, whenever it was signed.
* Members are the founder, genesis members, and keys admitted by an admin's effective
  member entry. Revocation is permanent: a revoke ``{"member": K, "upto": n}`` by an admin
  (by the founder, if K is an admin) cuts K's accepted entries to seq <= n (the smallest
  `upto` wins). A member entry by a non-admin is kept in the log but has no effect.
* Log = for each member, its chain up to the revocation cut. Entries of keys not (yet)
  admitted, beyond a gap, or beyond a cut are *held*: stored, waiting, and they enter the
  log if a later admission / predecessor / un-cut makes them eligible.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

from ledger.errors import (
    Equivocation, LedgerError, RevokedAuthor, SeqGap, TamperedStore, UnknownAuthor,
)

LOG, HELD, EVIDENCE = 0, 1, 2
STATE_NAMES = {LOG: "log", HELD: "held", EVIDENCE: "evidence"}


class Row(NamedTuple):
    """The metadata of a stored entry that derivation needs."""

    id: bytes
    author: bytes
    seq: int
    prev: bytes
    lamport: int
    kind: str


@dataclass(frozen=True)
class MemberStatus:
    admin: bool
    revoked: bool
    upto: int | None = None  # with revoked: the last seq of this member that is accepted
    name: str | None = None


@dataclass(frozen=True)
class Membership:
    """Consortium membership as derived from the log."""

    consortium: str | None
    genesis_id: bytes | None
    founder: bytes | None
    members: dict[bytes, MemberStatus] = field(default_factory=dict)

    def is_member(self, key: bytes) -> bool:
        """Admitted and not revoked."""
        s = self.members.get(key)
        return s is not None and not s.revoked

    def is_admin(self, key: bytes) -> bool:
        s = self.members.get(key)
        return s is not None and s.admin and not s.revoked

    def accepts(self, key: bytes, seq: int) -> bool:
        """Would an entry of `key` at `seq` be eligible for the log (chain permitting)?"""
        s = self.members.get(key)
        return s is not None and (not s.revoked or (s.upto is not None and seq <= s.upto))


@dataclass
class Derived:
    states: dict[bytes, int]
    membership: Membership
    freeze: dict[bytes, int]


def _freeze_seq(seqs: dict[int, list[Row]]) -> int | None:
    for s in sorted(seqs):
        rows = seqs[s]
        if len(rows) > 1:
            return s
        before = seqs.get(s - 1)
        if before and any(r.prev != p.id or r.lamport <= p.lamport for r in rows for p in before):
            return s
    return None


def derive(rows: Iterable[Row], bodies: dict[bytes, dict], genesis_id: bytes | None) -> Derived:
    """States of all rows, membership and fork points; `bodies` holds genesis/member bodies by id.

    Raises TamperedStore if the set could not have been produced by merge (a foreign genesis).
    """
    by_author: dict[bytes, dict[int, list[Row]]] = {}
    all_rows: list[Row] = []
    for r in rows:
        all_rows.append(r)
        by_author.setdefault(r.author, {}).setdefault(r.seq, []).append(r)
        if r.kind == "genesis" and r.id != genesis_id:
            raise TamperedStore("a genesis entry other than the pinned one is stored",
                                author=r.author, seq=r.seq, entry_id=r.id)

    freeze: dict[bytes, int] = {}
    chain: dict[bytes, list[Row]] = {}
    for author, seqs in by_author.items():
        f = _freeze_seq(seqs)
        if f is not None:
            freeze[author] = f
        c: list[Row] = []
        s = 1
        while s in seqs and (f is None or s < f):
            c.append(seqs[s][0])
            s += 1
        chain[author] = c

    states = {r.id: (EVIDENCE if r.author in freeze and r.seq >= freeze[r.author] else HELD) for r in all_rows}
    g = next((r for r in all_rows if r.id == genesis_id), None) if genesis_id else None
    if g is None or not chain.get(g.author) or chain[g.author][0].id != genesis_id:
        return Derived(states, Membership(None, genesis_id, g.author if g else None, {}), freeze)

    founder = g.author
    gbody = bodies[g.id]
    admins = {founder} | {bytes(k) for k, adm in gbody["members"] if adm}
    initial = {bytes(k) for k, _ in gbody["members"]}
    names: dict[bytes, str] = {}

    def member_bodies(author: bytes, upto: int | None) -> list[tuple[Row, dict]]:
        return [(r, bodies[r.id]) for r in chain.get(author, ())
                if r.kind == "member" and (upto is None or r.seq <= upto)]

    founder_entries = member_bodies(founder, None)
    cut: dict[bytes, int] = {}
    for _, b in founder_entries:
        if b["action"] == "admit" and b["admin"]:
            admins.add(b["member"])
    for _, b in founder_entries:
        t = b["member"]
        if b["action"] == "revoke" and t != founder and t in admins:
            cut[t] = min(cut.get(t, b["upto"]), b["upto"])

    effective: list[tuple[Row, dict]] = []
    for k in admins:
        effective.extend(member_bodies(k, cut.get(k)))
    effective.sort(key=lambda rb: (rb[0].lamport, rb[0].author, rb[0].seq))
    members = {founder} | initial | admins
    for r, b in effective:
        t = b["member"]
        if b["action"] == "admit":
            members.add(t)
            if "name" in b:
                names[t] = b["name"]
        elif t not in admins:  # revocations of admins come only from the founder (handled above)
            cut[t] = min(cut.get(t, b["upto"]), b["upto"])

    statuses = {k: MemberStatus(admin=k in admins, revoked=k in cut, upto=cut.get(k), name=names.get(k))
                for k in members}
    for k in members:
        limit = cut.get(k)
        for r in chain.get(k, ()):
            if limit is not None and r.seq > limit:
                break
            states[r.id] = LOG
    return Derived(states, Membership(gbody["consortium"], genesis_id, founder, statuses), freeze)


def why_not_logged(row: Row, freeze: int | None, m: Membership) -> LedgerError:
    """The typed reason an entry is not (or must not be) in the log, naming the entry."""
    where = dict(author=row.author, seq=row.seq, entry_id=row.id)
    if freeze is not None and row.seq >= freeze:
        return Equivocation(f"author forked its chain at seq {freeze}", **where)
    if m.founder is None or m.consortium is None:
        return UnknownAuthor("no genesis entry yet", **where)
    status = m.members.get(row.author)
    if status is None:
        return UnknownAuthor("author is not a member", **where)
    if status.revoked and status.upto is not None and row.seq > status.upto:
        return RevokedAuthor(f"author was revoked after seq {status.upto}", **where)
    return SeqGap(f"author's seq {row.seq - 1} (or earlier) is missing", **where)
