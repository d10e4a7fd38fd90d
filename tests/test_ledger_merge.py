"""Merging into the SQLite ledger: chains, pending, forks, membership, dumps, order independence."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ledger import (
    BrokenLink, Entry, Equivocation, Ledger, MalformedEntry, NotAdmin, RevokedAuthor, SeqGap, Signer,
    UnknownAuthor, WrongConsortium, ZERO_HASH,
)
from ledger import merge as merge_mod
from ledger.dump import export_dump, import_dump

F = Signer.from_seed(b"F" * 32)  # founder
A = Signer.from_seed(b"A" * 32)
B = Signer.from_seed(b"B" * 32)
X = Signer.from_seed(b"X" * 32)  # never admitted


def ids(entries) -> list[bytes]:
    return [e.id for e in entries]


@pytest.fixture
def founder(tmp_path) -> Ledger:
    led = Ledger.open(tmp_path / "f.db")
    led.create_genesis(F, "demo")
    led.admit(F, A.public_key)
    led.admit(F, B.public_key)
    yield led
    led.close()


def fresh(tmp_path, name: str, genesis: Ledger | None = None) -> Ledger:
    return Ledger.open(tmp_path / f"{name}.db", genesis_id=genesis.genesis_id if genesis else None)


def chain(signer: Signer, n: int, *, start_lamport: int = 100, kind: str = "metrics", tag: str = "") -> list[Entry]:
    out, prev = [], ZERO_HASH
    for i in range(1, n + 1):
        e = Entry.create(signer, seq=i, prev=prev, lamport=start_lamport + i, kind=kind, body={"i": i, "tag": tag})
        out.append(e)
        prev = e.id
    return out


def test_append_fills_seq_prev_lamport(founder):
    e1 = founder.append(A, "hello", {"addrs": []})
    e2 = founder.append(A, "metrics", {"acc": 0.5})
    assert (e1.seq, e1.prev, e2.seq, e2.prev) == (1, ZERO_HASH, 2, e1.id)
    assert e2.lamport == e1.lamport + 1
    assert e1.lamport > max(e.lamport for e in founder.query(author=F.public_key))
    assert founder.heads()[A.public_key] == 2
    assert founder.entries_after(A.public_key, 1) == [e2]
    assert founder.get(e2.id) == e2 and founder.state(e2.id) == "log"
    founder.verify()


def test_lamport_is_max_seen_plus_one(tmp_path, founder):
    other = fresh(tmp_path, "o", founder)
    other.merge(founder.raw_rows())
    far = chain(A, 1, start_lamport=500)
    assert other.merge(far).added == ids(far)
    mine = other.append(B, "hello", {})
    assert mine.lamport == 502


def test_merge_is_idempotent(tmp_path, founder):
    other = fresh(tmp_path, "o", founder)
    rows = founder.raw_rows()
    first = other.merge(rows)
    assert len(first.added) == len(rows) and not first.rejected
    again = other.merge(rows + rows)
    assert again.added == [] and again.duplicates == 2 * len(rows)
    assert ids(other.all_entries()) == ids(founder.all_entries())


def test_entry_before_its_predecessor_waits(founder):
    c = chain(A, 3)
    res = founder.merge([c[2]])
    assert res.pending == [c[2].id] and isinstance(res.waiting[c[2].id], SeqGap)
    assert founder.state(c[2].id) == "held" and founder.get(c[2].id) is None
    res = founder.merge([c[0]])
    assert res.added == [c[0].id] and founder.state(c[2].id) == "held"
    res = founder.merge([c[1]])
    assert res.added == [c[1].id, c[2].id]
    assert founder.heads()[A.public_key] == 3
    founder.verify()


def test_equivocation_keeps_evidence_and_refuses_later_entries(founder):
    c = chain(A, 3)
    fork = Entry.create(A, seq=2, prev=c[0].id, lamport=150, kind="metrics", body={"fork": True})
    assert founder.merge(c).added == ids(c)
    res = founder.merge([fork])
    (rid, err), = res.rejected
    assert rid == fork.id and isinstance(err, Equivocation)
    assert set(res.removed) == {c[1].id, c[2].id}  # chain frozen below the fork
    assert founder.heads()[A.public_key] == 1
    assert founder.state(fork.id) == "evidence" and founder.state(c[1].id) == "evidence"
    later = Entry.create(A, seq=4, prev=c[2].id, lamport=200, kind="metrics", body={})
    (_, err), = founder.merge([later]).rejected
    assert isinstance(err, Equivocation) and founder.state(later.id) is None
    with pytest.raises(Equivocation):
        founder.append(A, "hello", {})
    report = founder.verify()
    assert report.equivocators == 1 and report.evidence == 3


def test_wrong_prev_is_a_broken_link(founder):
    c = chain(A, 2)
    bad = Entry.create(A, seq=3, prev=b"\x11" * 32, lamport=150, kind="metrics", body={})
    founder.merge(c)
    (rid, err), = founder.merge([bad]).rejected
    assert rid == bad.id and isinstance(err, BrokenLink)
    assert founder.heads()[A.public_key] == 2
    founder.verify()


def test_wrong_prev_found_when_the_predecessor_arrives_later(founder):
    c = chain(A, 2)
    bad = Entry.create(A, seq=3, prev=b"\x11" * 32, lamport=150, kind="metrics", body={})
    assert founder.merge([bad]).pending == [bad.id]
    founder.merge(c)
    assert founder.state(bad.id) == "evidence" and founder.heads()[A.public_key] == 2
    founder.verify()


def test_lamport_must_increase_along_a_chain(founder):
    e1 = Entry.create(A, seq=1, prev=ZERO_HASH, lamport=50, kind="hello", body={})
    e2 = Entry.create(A, seq=2, prev=e1.id, lamport=50, kind="hello", body={})
    founder.merge([e1])
    (_, err), = founder.merge([e2]).rejected
    assert isinstance(err, BrokenLink)


def test_non_member_entries_wait_and_enter_after_admission(tmp_path, founder):
    c = chain(X, 2)
    res = founder.merge(c)
    assert res.added == [] and res.pending == ids(c)
    assert all(isinstance(res.waiting[i], UnknownAuthor) for i in res.pending)
    assert founder.query(author=X.public_key) == []
    founder.verify()
    res = founder.merge([founder.admit(F, X.public_key)])  # admission appended locally
    assert founder.query(author=X.public_key) == c
    founder.verify()


def test_non_member_flood_is_capped(monkeypatch, founder):
    monkeypatch.setattr(merge_mod, "MAX_WAITING_PER_AUTHOR", 3)
    c = chain(X, 5)
    res = founder.merge(c)
    assert res.pending == ids(c[:3])
    assert [type(err) for _, err in res.rejected] == [UnknownAuthor, UnknownAuthor]


def test_revoked_member_is_cut_at_upto(tmp_path, founder):
    a1 = founder.append(A, "hello", {})
    rev = founder.revoke(F, A.public_key)
    assert rev.body["upto"] == 1
    late = Entry.create(A, seq=2, prev=a1.id, lamport=rev.lamport + 1, kind="metrics", body={})
    (rid, err), = founder.merge([late]).rejected
    assert rid == late.id and isinstance(err, RevokedAuthor)
    assert founder.query(author=A.public_key) == [a1]
    assert founder.membership().members[A.public_key].revoked
    with pytest.raises(RevokedAuthor):
        founder.append(A, "hello", {})
    with pytest.raises(RevokedAuthor):
        founder.admit(F, A.public_key)
    founder.verify()
    # a node that had already accepted the late entry drops it when the revocation arrives
    other = fresh(tmp_path, "o", founder)
    rows = [r for r in founder.raw_rows() if Entry.from_bytes(r).id != rev.id]
    other.merge(rows)
    assert other.state(late.id) == "log"
    res = other.merge([rev])
    assert res.removed == [late.id] and other.state(late.id) == "held"
    assert ids(other.all_entries()) == ids(founder.all_entries())
    other.verify()


def test_admin_rules(founder):
    with pytest.raises(NotAdmin):
        founder.admit(A, X.public_key)  # A is not an admin
    founder.admit(F, A.public_key, admin=True)  # founder grants admin
    founder.admit(A, X.public_key)  # now A can admit
    assert founder.membership().is_member(X.public_key)
    with pytest.raises(NotAdmin):
        founder.admit(A, B.public_key, admin=True)  # only the founder grants admin
    with pytest.raises(NotAdmin):
        founder.revoke(A, F.public_key)
    with pytest.raises(NotAdmin):
        founder.revoke(F, F.public_key)
    with pytest.raises(UnknownAuthor):
        founder.revoke(F, Signer.from_seed(b"Z" * 32).public_key)
    founder.verify()


def test_member_entry_by_non_admin_is_logged_but_has_no_effect(founder):
    b1 = Entry.create(B, seq=1, prev=ZERO_HASH, lamport=50, kind="member",
                      body={"action": "admit", "member": X.public_key, "admin": True})
    assert founder.merge([b1]).added == [b1.id]
    assert not founder.membership().is_member(X.public_key)
    founder.verify()


def test_admin_power_comes_from_the_founder_and_its_revocation_cuts(tmp_path, founder):
    founder.admit(F, A.public_key, admin=True)
    a1 = founder.admit(A, X.public_key)
    x1 = founder.append(X, "hello", {})
    founder.append(F, "hello", {})
    # the founder revokes A before A's admission of X: X is no longer a member
    rev = Entry.create(F, seq=founder.heads()[F.public_key] + 1,
                       prev=founder.query(author=F.public_key)[-1].id, lamport=500, kind="member",
                       body={"action": "revoke", "member": A.public_key, "upto": a1.seq - 1})
    res = founder.merge([rev])
    assert set(res.removed) == {a1.id, x1.id}
    assert not founder.membership().is_member(X.public_key)
    founder.verify()


def test_wrong_consortium(tmp_path, founder):
    other_founder = Signer.from_seed(b"O" * 32)
    other = fresh(tmp_path, "other")
    g2 = other.create_genesis(other_founder, "other")
    (rid, err), = founder.merge([g2]).rejected
    assert rid == g2.id and isinstance(err, WrongConsortium)
    with pytest.raises(WrongConsortium):
        Ledger.open(founder.path, genesis_id=g2.id)
    with pytest.raises(WrongConsortium):
        founder.create_genesis(F, "again")
    export_dump(other, tmp_path / "other.dump")
    with pytest.raises(WrongConsortium):
        import_dump(founder, tmp_path / "other.dump")


def test_joined_node_accepts_only_its_genesis_and_keeps_own_entries_until_admitted(tmp_path, founder):
    joined = fresh(tmp_path, "joined", founder)
    hello = joined.append(X, "hello", {"role": "node"})
    assert joined.state(hello.id) == "held" and joined.all_entries() == []
    joined.verify()
    founder.admit(F, X.public_key)
    export_dump(founder, tmp_path / "f.dump")
    res = import_dump(joined, tmp_path / "f.dump")
    assert hello.id in res.added and joined.state(hello.id) == "log"
    assert joined.membership().consortium == "demo"
    more = joined.append(X, "metrics", {})
    assert more.seq == 2 and joined.state(more.id) == "log"
    joined.verify()
    # and the founder takes X's entries from the joined node
    assert founder.merge(joined.entries_after(X.public_key, 0)).added == [hello.id, more.id]


def test_dump_round_trip_and_bad_dumps(tmp_path, founder):
    founder.append(A, "hello", {})
    n = export_dump(founder, tmp_path / "d")
    other = fresh(tmp_path, "o")
    res = import_dump(other, tmp_path / "d")
    assert len(res.added) == n and ids(other.all_entries()) == ids(founder.all_entries())
    other.verify()
    data = (tmp_path / "d").read_bytes()
    (tmp_path / "t").write_bytes(data[:-10])
    with pytest.raises(MalformedEntry):
        import_dump(other, tmp_path / "t")
    (tmp_path / "g").write_bytes(b"not a dump at all")
    with pytest.raises(MalformedEntry):
        import_dump(other, tmp_path / "g")


def test_merge_reports_bad_bytes_without_raising(founder):
    good = chain(A, 1)[0]
    res = founder.merge([b"\x00garbage", good.to_bytes()[:-3], good.to_bytes()])
    assert res.added == [good.id]
    assert [type(err) for _, err in res.rejected] == [MalformedEntry, MalformedEntry]


# --- order independence ------------------------------------------------------------------

def _scenario(seed: int, tmp_path) -> list[bytes]:
    """A consortium history with admissions, an admin, a revocation, a fork and a non-member."""
    rnd = random.Random(seed)
    led = Ledger.open(tmp_path / f"src{seed}.db")
    led.create_genesis(F, "demo")
    led.admit(F, A.public_key, admin=rnd.random() < 0.5)
    for _ in range(rnd.randint(1, 4)):
        led.append(rnd.choice([F, A]), "metrics", {"r": rnd.random()})
    led.append(A, "hello", {})
    if led.membership().is_admin(A.public_key):
        led.admit(A, B.public_key)
    else:
        led.admit(F, B.public_key)
    led.append(B, "hello", {})
    for _ in range(rnd.randint(1, 5)):
        led.append(rnd.choice([A, B]), "metrics", {"r": rnd.random()})
    extra: list[bytes] = []
    if rnd.random() < 0.5:
        led.revoke(F, B.public_key)
        tail = led.query(author=B.public_key)[-1]
        extra.append(Entry.create(B, seq=tail.seq + 1, prev=tail.id, lamport=10_000, kind="metrics", body={}).to_bytes())
    if rnd.random() < 0.5:
        a = led.query(author=A.public_key)
        k = rnd.randrange(len(a))
        extra.append(Entry.create(A, seq=a[k].seq, prev=a[k].prev, lamport=a[k].lamport + 1,
                                  kind="metrics", body={"fork": 1}).to_bytes())
    extra += [e.to_bytes() for e in chain(X, 2)]
    rows = led.raw_rows() + extra
    led.close()
    return rows


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 3), order=st.randoms(use_true_random=False), cuts=st.lists(st.integers(0, 40), max_size=6))
def test_any_order_gives_the_same_log(tmp_path_factory, seed, order, cuts):
    tmp = tmp_path_factory.mktemp("order")
    rows = _scenario(seed, tmp)
    ref = Ledger.open(tmp / "ref.db")
    ref.merge(rows)
    shuffled = list(rows)
    order.shuffle(shuffled)
    led = Ledger.open(tmp / "shuffled.db")
    bounds = sorted({0, len(shuffled), *[c % (len(shuffled) + 1) for c in cuts]})
    for lo, hi in zip(bounds, bounds[1:]):  # in several merges, in any order
        led.merge(shuffled[lo:hi])
    assert ids(led.all_entries()) == ids(ref.all_entries())
    assert led.membership() == ref.membership()
    led.verify()
    ref.verify()
    led.close()
    ref.close()


def test_heads_follow_writes_from_this_and_other_connections(tmp_path, founder):
    """heads() is cached until the database changes: our own appends and merges, and a
    CLI command's append through another connection (another process) both show at once."""
    other = Ledger.open(founder.path)  # what a CLI command opens
    try:
        before = founder.heads()
        assert before == {F.public_key: 3} and founder.head_of(A.public_key) == 0
        other.append(A, "metrics", {"i": 1})
        assert founder.heads() == {F.public_key: 3, A.public_key: 1} == other.heads()
        founder.append(A, "metrics", {"i": 2})
        assert founder.heads()[A.public_key] == 2 == other.heads()[A.public_key] == founder.head_of(A.public_key)
        b = fresh(tmp_path, "b", founder)
        res = b.merge(founder.raw_rows(), members_only=True)
        assert not res.rejected and b.heads() == founder.heads()
        assert b.merge(chain(X, 1), members_only=True).rejected  # an outsider: refused, nothing stored
        assert b.heads() == founder.heads()
        b.close()
    finally:
        other.close()
