"""`Ledger.heads_of` (a few authors' heads without reading every head) agrees with
`heads()` whether the heads cache is current or the database moved under it."""
from __future__ import annotations

from pathlib import Path

from ledger import Ledger, Signer

F, A, B = (Signer.from_seed(bytes([i]) * 32) for i in (1, 2, 3))


def test_heads_of_agrees_with_heads_cached_and_after_other_writers(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    led = Ledger.open(db)
    led.create_genesis(F, "c", members=[(A.public_key, False), (B.public_key, False)])
    for i in range(3):
        led.append(A, "metrics", {"i": i})
    want = [A.public_key, B.public_key, F.public_key]
    assert led.heads_of(want) == {A.public_key: 3, F.public_key: 1}  # B wrote nothing: left out
    led.heads()  # cache current
    assert led.heads_of(want) == {k: v for k, v in led.heads().items() if k in want}
    with Ledger.open(db) as other:  # another connection (a CLI command) appends: the cache is stale
        other.append(B, "metrics", {"b": 1})
        other.append(A, "metrics", {"i": 3})
    assert led.heads_of(want) == {A.public_key: 4, B.public_key: 1, F.public_key: 1}
    assert led.heads_of(want) == led.heads()
    assert led.heads_of([]) == {} and led.heads_of([b"\0" * 32]) == {}
    led.close()


# --- the heads cache kept current by this ledger's own writes -------------------

import random  # noqa: E402

from ledger import Entry, ZERO_HASH  # noqa: E402

X, Y = (Signer.from_seed(bytes([i]) * 32) for i in (4, 5))
_SCAN = "SELECT author, seq FROM entries WHERE state=0"  # heads()'s rebuild


def rebuilt(led: Ledger) -> dict[bytes, int]:
    """The heads a fresh connection reads (a rebuild from the rows, nothing cached)."""
    with Ledger.open(led.path) as other:
        return other.heads()


def scans(led: Ledger) -> list[str]:
    """Record the rebuild scans `led` runs from now on."""
    seen: list[str] = []
    led._store.conn.set_trace_callback(lambda sql: seen.append(sql) if sql.startswith(_SCAN) else None)
    return seen


def chain(signer: Signer, n: int, *, lamport: int = 100, start: tuple[int, bytes] = (0, ZERO_HASH)) -> list[Entry]:
    out, (seq, prev) = [], start
    for i in range(1, n + 1):
        e = Entry.create(signer, seq=seq + i, prev=prev, lamport=lamport + i, kind="metrics", body={"i": i})
        out.append(e)
        prev = e.id
    return out


def test_own_writes_keep_heads_current_without_a_rebuild(tmp_path: Path) -> None:
    """Appends, merges (held entries promoted, an admission releasing held entries), a fork,
    a revocation's cut, expiry and a group commit each update the cached heads in place of a
    rescan; every answer equals the one rebuilt from the rows; a map handed out earlier
    (`copy=False`) is never changed; another writer and a reopen still rebuild correctly."""
    led = Ledger.open(tmp_path / "l.db")
    led.create_genesis(F, "c", members=[(A.public_key, False), (B.public_key, False)])
    first = led.heads(copy=False)
    snapshot = dict(first)
    scanned = scans(led)

    def check() -> None:
        assert led.heads() == rebuilt(led)
        assert led.heads_of([A.public_key, B.public_key, X.public_key]) == {
            k: v for k, v in rebuilt(led).items() if k in (A.public_key, B.public_key, X.public_key)}

    for i in range(3):
        led.append(A, "metrics", {"i": i})
    check()
    b = chain(B, 4)
    assert led.merge([b[2], b[3], b[1]]).pending  # held: waiting for B's seq 1
    check()
    assert led.merge([b[0]]).added  # seq 1 arrives: 2..4 promoted from held into the log
    assert led.heads()[B.public_key] == 4
    check()
    x = chain(X, 2)
    led.merge(x)  # an unknown author: held
    assert X.public_key not in led.heads()
    led.admit(F, X.public_key)  # its admission re-derives: both enter the log
    assert led.heads()[X.public_key] == 2
    check()
    a = led.query(author=A.public_key)
    fork = Entry.create(A, seq=2, prev=a[0].id, lamport=a[1].lamport + 50, kind="metrics", body={"fork": 1})
    assert led.merge([fork]).removed  # A forked at 2: its seqs 2 and 3 leave the log
    assert led.heads()[A.public_key] == 1
    check()
    led.revoke(F, B.public_key)  # upto = 4
    late = chain(B, 1, lamport=10_000, start=(4, led.query(author=B.public_key)[-1].id))
    led.merge(late)
    assert led.heads()[B.public_key] == 4
    check()
    led.merge(chain(Y, 2))  # held (unknown author), then expired
    assert led.expire_held(0.0, now=1e12) == 3  # (and the revoked member's late entry)
    check()
    assert all(isinstance(e, Entry) for e in led.append_many(X, [("metrics", {"g": i}) for i in range(3)]))
    assert led.heads()[X.public_key] == 5
    check()
    assert scanned == []  # every write above kept the cache current: no rescan
    assert first == snapshot  # the map handed out before the writes is unchanged
    with Ledger.open(led.path) as other:  # another connection writes: the next read rebuilds
        other.append(X, "metrics", {"o": 1})
    assert led.heads()[X.public_key] == 6 and len(scanned) == 1
    check()
    led.append(F, "metrics", {})  # ... and the rebuilt cache is kept current again
    check()
    assert len(scanned) == 1
    want = led.heads()
    led.close()
    with Ledger.open(tmp_path / "l.db") as again:  # reopened: rebuilt from the rows
        assert again.heads() == want


def test_merges_in_any_order_and_cut_keep_the_same_heads(tmp_path: Path) -> None:
    """Entries of several authors (admissions among them) merged in random orders and
    cuts: after each merge the kept-current heads equal the rebuilt ones."""
    src = Ledger.open(tmp_path / "src.db")
    src.create_genesis(F, "c")
    src.admit(F, A.public_key, admin=True)
    for i in range(4):
        src.append(A if i % 2 else F, "metrics", {"i": i})
    src.admit(A, B.public_key)
    for i in range(5):
        src.append(B, "metrics", {"i": i})
    src.revoke(F, B.public_key)
    rows = src.raw_rows() + [e.to_bytes() for e in chain(X, 2)]
    want = src.heads()
    src.close()
    for seed in range(6):
        rnd = random.Random(seed)
        order = list(rows)
        rnd.shuffle(order)
        led = Ledger.open(tmp_path / f"s{seed}.db")
        led.heads()
        scanned = scans(led)
        cuts = sorted({0, len(order), *(rnd.randrange(len(order)) for _ in range(4))})
        for lo, hi in zip(cuts, cuts[1:]):
            led.merge(order[lo:hi])
            assert led.heads() == rebuilt(led)
        assert led.heads() == want and scanned == []
        led.close()


def test_heads_since_names_exactly_the_changed_authors_and_the_digest_follows(tmp_path: Path) -> None:
    """`heads_since(v)` lists the authors whose head differs from version v's map (None when
    that is not known: a rebuild, or too many maps ago); the sync digest built on it equals
    the digest of the heads computed from scratch after every kind of write."""
    from atdnode.replication.sync_digest import digest_vector, vector_of
    from ledger.heads import HEADS_LOG

    led = Ledger.open(tmp_path / "l.db")
    led.create_genesis(F, "c", members=[(A.public_key, False), (B.public_key, False)])
    v0, h0, _ = led.heads_since(None)
    old = dict(h0)

    def step() -> None:
        nonlocal v0, old
        v, heads, changed = led.heads_since(v0)
        want = {a for a in set(heads) | set(old) if heads.get(a) != old.get(a)}
        assert changed is None or changed == want
        assert digest_vector(led)[0] == vector_of(rebuilt(led))
        v0, old = v, dict(heads)

    for i in range(3):
        led.append(A, "metrics", {"i": i})
        step()
    tip = led.query(author=A.public_key)[-1]
    led.merge(chain(B, 2) + chain(A, 2, lamport=tip.lamport + 100, start=(tip.seq, tip.id)))  # two authors at once
    step()
    a = led.query(author=A.public_key)
    led.merge([Entry.create(A, seq=2, prev=a[0].id, lamport=a[1].lamport + 9, kind="metrics", body={})])  # a fork
    step()
    assert led.heads_since(v0)[2] == set()  # nothing since
    v_old = v0
    for i in range(HEADS_LOG + 2):
        led.append(B, "metrics", {"i": i})
    assert led.heads_since(v_old)[2] is None  # too long ago: not known
    assert led.heads_since(v_old + HEADS_LOG + 1)[2] == {B.public_key}
    step()
    with Ledger.open(led.path) as other:
        other.append(F, "metrics", {})
    assert led.heads_since(v0)[2] is None  # rebuilt after another writer: not known
    step()
    led.close()
