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
* Rotation: a member X moves to a new key Y with ``{"action": "rotate", "member": Y,
  "proof": sig}`` in its own chain, where `proof` is Y's signature over
  ``ROTATE_DOMAIN || X || Y`` (entry.py). X's chain ends there: its entries up to the
  rotate entry stay in the log, later ones never enter it (X reads as revoked with
  ``upto`` = the rotate seq, and `rotations[X] = Y`). The rotation takes effect unless X
  was revoked before it (a cut below the rotate seq); then Y inherits X's membership,
  admin flag and name, and the founder's powers when X is the founder (or its successor).
  A revocation names one key: to revoke a node after its rotation, revoke its new key.
  The rotation retires the old key for good: whatever else X's key signs at or
  after the rotate seq (a thief's entry at that very seq included) is evidence against X's
  old key only -- it is never in the log, it does not freeze X, and Y stays the member.
  Only a fork below the rotate seq, or two valid rotations at the same seq, freeze X.
* Restore (the way back from a contested rotation). When X's chain holds two or more valid
  rotate entries at one seq r (the owner's X -> Y and a thief's X -> Z, both linked to
  X's entry at r-1), X is frozen at r and neither Y nor Z is a member. An admin settles
  it with ``{"action": "restore", "member": X, "key": Y}``: the rotation X -> Y takes
  effect as if it were X's only entry at r (Y inherits X's membership, admin flag, name,
  lineage and reader access; the thief's rotation and anything else X's key signed at or
  after r is evidence; X is no longer frozen, its key retired). It counts only if Y is
  the target of one of those competing rotations (so it names a key whose holder X's own
  key vouched for, never a fresh one), and only if signed by an admin other than X: by
  the founder when X is an admin, by any admin when X is the founder or a plain member.
  Several restores of one X: the first by (lamport, author, seq) among the effective ones.
  Admins are trusted with membership anyway (they can admit any key); the restore only
  lets them pick which of X's two claimed successors carries X's identity. Derivation
  runs twice when some X is contested and restored: once to find the admins, once with
  the settled rotations; both runs are functions of the stored set, so order still does
  not matter.
* Log = for each member, its chain up to the revocation cut. Entries of keys not (yet)
  admitted, beyond a gap, or beyond a cut are *held*: stored, waiting, and they enter the
  log if a later admission / predecessor / un-cut makes them eligible.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

from ledger.entry import rotation_proof_ok
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
    rotations: dict[bytes, bytes] = field(default_factory=dict)  # old key -> new key (effective rotations)

    def current(self, key: bytes) -> bytes:
        """The key that now carries `key`'s identity (itself unless it rotated away)."""
        seen = {key}
        while key in self.rotations and self.rotations[key] not in seen:
            key = self.rotations[key]
            seen.add(key)
        return key

    def keys_of(self, key: bytes) -> list[bytes]:
        """Every key that carried `key`'s identity: `key` and the keys that rotated to it."""
        return [key] + [k for k in self.rotations if k != key and self.current(k) == key]

    def is_founder(self, key: bytes) -> bool:
        """The founder's current key (the genesis author, or the key it rotated to)."""
        return self.founder is not None and key == self.current(self.founder)

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


def _rotation_row(author: bytes, seqs: dict[int, list[Row]], bodies: dict[bytes, dict]) -> Row | None:
    """The row that retires `author`'s key: the first seq r of its unforked, well-linked
    chain holding exactly one valid rotate entry that links to seq r-1 (a thief
    with the old key who signs anything else at or after r makes evidence against the old
    key only; it neither freezes the identity nor stops the rotation). None without one,
    or when the chain forks below it, or when two valid rotations compete at r (then the
    owner cannot be told from the thief: the fork freezes the key as before)."""
    prev: Row | None = None
    s = 1
    while s in seqs:
        rows = seqs[s]
        linked = [r for r in rows if prev is None or (r.prev == prev.id and r.lamport > prev.lamport)]
        rotates = [r for r in linked if r.kind == "member" and r.id in bodies
                   and bodies[r.id].get("action") == "rotate" and rotation_proof_ok(author, bodies[r.id])]
        if len(rotates) == 1:
            return rotates[0]
        if len(rows) != 1 or len(linked) != 1:
            return None
        prev = rows[0]
        s += 1
    return None


def _contested(seqs: dict[int, list[Row]], freeze: int, author: bytes, bodies: dict[bytes, dict]) -> dict[bytes, Row]:
    """new key -> rotate row, when `author`'s chain (frozen at `freeze`) holds two or more
    valid rotations at that seq, each linked to its entry at freeze - 1; else {}."""
    before = seqs.get(freeze - 1, [None])[0] if freeze > 1 else None
    out = {}
    for r in seqs.get(freeze, ()):
        b = bodies.get(r.id) if r.kind == "member" else None
        linked = before is None or (r.prev == before.id and r.lamport > before.lamport)
        if linked and b is not None and b.get("action") == "rotate" and rotation_proof_ok(author, b):
            out[b["member"]] = r
    return out if len(out) > 1 else {}


def derive(rows: Iterable[Row], bodies: dict[bytes, dict], genesis_id: bytes | None) -> Derived:
    """States of all rows, membership and fork points; `bodies` holds genesis/member bodies by id.

    Raises TamperedStore if the set could not have been produced by merge (a foreign genesis).
    """
    rows = list(rows)
    first, contested, restores = _derive(rows, bodies, genesis_id, {})
    if not contested or not restores:
        return first
    m = first.membership
    settled: dict[bytes, bytes] = {}
    for r, b in sorted(restores, key=lambda rb: (rb[0].lamport, rb[0].author, rb[0].seq)):
        old, new = b["member"], b["key"]
        if old in settled or new not in contested.get(old, {}) or old not in m.members:
            continue
        if r.author in m.keys_of(m.current(old)) or old in m.keys_of(r.author):
            continue  # nobody restores its own identity
        if m.members[old].admin and not m.is_founder(old) and not m.is_founder(r.author):
            continue  # an admin's successor is the founder's call (as its revocation is)
        settled[old] = contested[old][new].id
    if not settled:
        return first
    return _derive(rows, bodies, genesis_id, settled)[0]


def _derive(rows: list[Row], bodies: dict[bytes, dict], genesis_id: bytes | None,
            settled: dict[bytes, bytes]) -> tuple[Derived, dict[bytes, dict[bytes, Row]], list[tuple[Row, dict]]]:
    """One derivation, with `settled` (old key -> id of the rotate row a restore chose)
    standing for the contested rotations already resolved. Returns the result, the
    contested rotations left (old key -> {new key: row}) and the effective restore entries."""
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
    retired: dict[bytes, Row] = {}  # old key -> its rotate row (the key signs nothing valid after it)
    contested: dict[bytes, dict[bytes, Row]] = {}
    for author, seqs in by_author.items():
        rotate = _rotation_row(author, seqs, bodies)
        if author in settled:
            rotate = next((r for rs in seqs.values() for r in rs if r.id == settled[author]), None)
        if rotate is not None:  # rows at or after the rotate seq are evidence against the old key only
            retired[author] = rotate
            chain[author] = [seqs[s][0] for s in range(1, rotate.seq)] + [rotate]
            continue
        f = _freeze_seq(seqs)
        if f is not None:
            freeze[author] = f
            rivals = _contested(seqs, f, author, bodies)
            if rivals:
                contested[author] = rivals
        c: list[Row] = []
        s = 1
        while s in seqs and (f is None or s < f):
            c.append(seqs[s][0])
            s += 1
        chain[author] = c

    def evidence(r: Row) -> bool:
        if r.author in retired:
            return r.seq >= retired[r.author].seq and r.id != retired[r.author].id
        return r.author in freeze and r.seq >= freeze[r.author]

    states = {r.id: (EVIDENCE if evidence(r) else HELD) for r in all_rows}
    g = next((r for r in all_rows if r.id == genesis_id), None) if genesis_id else None
    if g is None or not chain.get(g.author) or chain[g.author][0].id != genesis_id:
        return Derived(states, Membership(None, genesis_id, g.author if g else None, {}), freeze), {}, []

    founder = g.author
    gbody = bodies[g.id]
    initial = {bytes(k) for k, _ in gbody["members"]}
    names: dict[bytes, str] = {}

    # Rotations: the first valid rotate entry in a chain ends that chain (see module docstring).
    rot: dict[bytes, tuple[int, bytes]] = {}
    for author, c in chain.items():
        for i, r in enumerate(c):
            b = bodies.get(r.id) if r.kind == "member" else None
            if b is not None and b.get("action") == "rotate" and rotation_proof_ok(author, b):
                rot[author] = (r.seq, b["member"])
                del c[i + 1:]
                break

    def lineage(k: bytes) -> list[bytes]:
        out = [k]
        while k in rot and rot[k][1] not in out:
            k = rot[k][1]
            out.append(k)
        return out

    def member_bodies(author: bytes, upto: int | None) -> list[tuple[Row, dict]]:
        return [(r, bodies[r.id]) for r in chain.get(author, ())
                if r.kind == "member" and (upto is None or r.seq <= upto)]

    founder_keys = lineage(founder)  # the founder cannot be revoked, so its rotations always count
    founder_entries = [rb for k in founder_keys for rb in member_bodies(k, None)]
    admins = set(founder_keys) | {bytes(k) for k, adm in gbody["members"] if adm}
    cut: dict[bytes, int] = {}
    for _, b in founder_entries:
        if b["action"] == "admit" and b["admin"]:
            admins.add(b["member"])
        elif b["action"] == "revoke" and b["member"] not in founder_keys:
            cut[b["member"]] = min(cut.get(b["member"], b["upto"]), b["upto"])

    def rotated(k: bytes) -> bool:
        """k's rotation took effect: it has one and k was not cut before it."""
        return k in rot and cut.get(k, rot[k][0]) >= rot[k][0]

    def close(keys: set[bytes]) -> None:
        todo = list(keys)
        while todo:
            k = todo.pop()
            if rotated(k) and rot[k][1] not in keys:
                keys.add(rot[k][1])
                todo.append(rot[k][1])

    close(admins)
    effective: list[tuple[Row, dict]] = []
    for k in admins:
        effective.extend(member_bodies(k, cut.get(k)))
    effective.sort(key=lambda rb: (rb[0].lamport, rb[0].author, rb[0].seq))
    members = {founder} | initial | admins
    for r, b in effective:
        t = b["member"]
        if b["action"] == "restore":
            continue  # applied by `derive` (a second run)
        if b["action"] == "admit":
            members.add(t)
            if "name" in b:
                names[t] = b["name"]
        elif b["action"] == "revoke" and t not in admins:  # admins are revoked by the founder (above)
            cut[t] = min(cut.get(t, b["upto"]), b["upto"])
    close(members)
    rotations = {k: rot[k][1] for k in members if rotated(k)}
    for old_key in sorted(rotations, key=lambda k: rot[k][0]):
        for k in lineage(old_key)[1:]:
            if k not in names and old_key in names:
                names[k] = names[old_key]
    for k in rotations:  # the old key reads as revoked after its rotate entry
        cut[k] = rot[k][0]

    statuses = {k: MemberStatus(admin=k in admins, revoked=k in cut, upto=cut.get(k), name=names.get(k))
                for k in members}
    for k in members:
        limit = cut.get(k)
        for r in chain.get(k, ()):
            if limit is not None and r.seq > limit:
                break
            states[r.id] = LOG
    restores = [(r, b) for r, b in effective if b["action"] == "restore"]
    return (Derived(states, Membership(gbody["consortium"], genesis_id, founder, statuses, rotations), freeze),
            contested, restores)


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
        if row.author in m.rotations:
            return RevokedAuthor(f"author rotated to a new key at seq {status.upto}; the old key signs nothing after it",
                                 **where)
        return RevokedAuthor(f"author was revoked after seq {status.upto}", **where)
    return SeqGap(f"author's seq {row.seq - 1} (or earlier) is missing", **where)
