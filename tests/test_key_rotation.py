"""Key rotation (`member` rotate entries) and encrypted key backup.

Rotation: the node's earlier entries stay valid, the old key can author nothing new (its
own ledger refuses to sign, peers refuse what it signs anyway), membership, admin flag and
name follow the new key, and a peer that merges the same entries in any order agrees.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from atdnode.node import NodeHome, NodeIdentity, init_home
from ledger import Entry, Ledger, MalformedEntry, RevokedAuthor, Signer, peer_id_from_public_key, public_key_from_peer_id
from ledger.entry import rotation_message
from tests.factories import cli
from tests.atd_forkserver import CLI_ONLY, forkserver
from tests.nodeprocs import WarmAtd, _env, live_status, start_daemon, wait_until


def _two(tmp_path: Path):
    """Founder F's ledger and member M's ledger (M admitted as 'm'), synced."""
    f, m = Signer.generate(), Signer.generate()
    lf = Ledger.open(tmp_path / "f.db")
    lf.create_genesis(f, "demo")
    lf.admit(f, m.public_key, name="m")
    lm = Ledger.open(tmp_path / "m.db", genesis_id=lf.genesis_id)
    lm.merge(lf.raw_rows())
    return f, m, lf, lm


def test_rotation_keeps_history_and_retires_the_old_key(tmp_path: Path) -> None:
    f, m, lf, lm = _two(tmp_path)
    before = lm.append(m, "weights", {"blob": "00" * 32, "part": "extractor"})
    m2 = Signer.generate()
    rot = lm.rotate(m, m2)
    after = lm.append(m2, "hello", {"addrs": [], "role": "node"})
    mem = lm.membership()
    assert mem.rotations == {m.public_key: m2.public_key}
    assert mem.is_member(m2.public_key) and not mem.is_member(m.public_key)
    assert mem.members[m2.public_key].name == "m" and mem.members[m.public_key].upto == rot.seq
    assert mem.current(m.public_key) == m2.public_key
    assert {before.id, rot.id, after.id} <= {e.id for e in lm.query()}  # history kept
    with pytest.raises(RevokedAuthor, match="rotated to " + peer_id_from_public_key(m2.public_key)):
        lm.append(m, "hello", {"addrs": []})
    lm.verify()

    # the peer merges everything, shuffled, plus an entry the old key signed after rotating
    forged = Entry.create(m, seq=rot.seq + 1, prev=rot.id, lamport=rot.lamport + 5, kind="weights",
                          body={"blob": "11" * 32})
    rows = lm.raw_rows() + [forged.to_bytes()]
    random.Random(0).shuffle(rows)
    res = lf.merge(rows)
    assert any(i == forged.id and isinstance(err, RevokedAuthor) for i, err in res.rejected)
    assert lf.get(forged.id) is None and lf.get(before.id) is not None and lf.get(after.id) is not None
    assert {e.id for e in lf.query()} == {e.id for e in lm.query()}
    assert lf.membership() == lm.membership()
    lf.verify()

    # a revocation names the node: revoking the old key's peer id revokes the new key
    lf.revoke(f, m.public_key)
    assert lf.membership().members[m2.public_key].revoked
    with pytest.raises(RevokedAuthor):
        lf.append(m2, "hello", {})


def test_a_rotation_needs_the_new_keys_proof(tmp_path: Path) -> None:
    f, m, lf, lm = _two(tmp_path)
    m2, other = Signer.generate(), Signer.generate()
    proof = other.sign(rotation_message(m.public_key, m2.public_key))
    with pytest.raises(MalformedEntry, match="rotate"):
        lm.append(m, "member", {"action": "rotate", "member": m2.public_key, "proof": proof})
    good = m2.sign(rotation_message(m.public_key, m2.public_key))
    with pytest.raises(MalformedEntry, match="rotate"):  # a proof for another old key
        lm.append(f, "member", {"action": "rotate", "member": m2.public_key, "proof": good})
    with pytest.raises(MalformedEntry, match="fresh"):  # not onto a key the consortium knows
        lm.rotate(m, f)
    with pytest.raises(MalformedEntry, match="rotate"):  # even a signed entry with a bad proof is refused
        Entry.create(m, seq=9, prev=b"\1" * 32, lamport=9, kind="member",
                     body={"action": "rotate", "member": m2.public_key, "proof": proof})
    assert lm.membership().rotations == {}


def test_revoked_before_rotating_gives_the_new_key_nothing(tmp_path: Path) -> None:
    f, m, lf, lm = _two(tmp_path)
    lf.revoke(f, m.public_key)  # founder revokes M at seq 0 ...
    m2 = Signer.generate()
    rot = lm.rotate(m, m2)  # ... while M, not knowing, rotates
    lf.merge(lm.raw_rows())
    mem = lf.membership()
    assert not mem.is_member(m2.public_key) and mem.rotations == {}
    assert lf.get(rot.id) is None
    lf.verify()


def test_the_founder_rotates_and_keeps_its_powers(tmp_path: Path) -> None:
    f, m, lf, lm = _two(tmp_path)
    f2, n = Signer.generate(), Signer.generate()
    lf.rotate(f, f2)
    lf.admit(f2, n.public_key, admin=True, name="n")  # only the founder may grant admin
    lm.merge(lf.raw_rows())
    mem = lm.membership()
    assert mem.is_founder(f2.public_key) and mem.is_admin(f2.public_key) and mem.is_admin(n.public_key)
    assert not mem.is_admin(f.public_key)
    lm.verify()


def test_key_backup_round_trip_and_wrong_passphrase(tmp_path: Path) -> None:
    from atdnode.node import KeyBackupError, export_keys, import_keys

    cheap = {"n": 1 << 14, "r": 8, "p": 1}
    home = NodeHome.at(tmp_path / "a")
    ident = init_home(home, name="a", consortium="demo")
    out = tmp_path / "a.keys"
    assert export_keys(home, out, b"correct horse", kdf_cost=cheap) == ident.peer_id
    assert out.stat().st_mode & 0o077 == 0
    text = out.read_text()
    assert ident.signer.seed.hex() not in text and "correct horse" not in text
    with pytest.raises(KeyBackupError, match="exists"):
        export_keys(home, out, b"correct horse", kdf_cost=cheap)
    restored = NodeHome.at(tmp_path / "restored")
    with pytest.raises(KeyBackupError, match="wrong passphrase"):
        import_keys(restored, out, b"wrong horse!")
    header = json.loads(text)
    header["peer_id"] = "12D3KooWtampered"
    (tmp_path / "t.keys").write_text(json.dumps(header))
    with pytest.raises(KeyBackupError, match="altered"):
        import_keys(restored, tmp_path / "t.keys", b"correct horse")
    assert import_keys(restored, out, b"correct horse") == ident.peer_id
    back = NodeIdentity.load(restored)
    assert back.signer.seed == ident.signer.seed and back.x25519_public == ident.x25519_public
    with Ledger.open(home.ledger_db) as led:
        genesis = led.genesis_id.hex()
    assert init_home(restored, join=genesis).peer_id == ident.peer_id  # init keeps restored keys
    other = NodeHome.at(tmp_path / "b")
    init_home(other, join=genesis)
    with pytest.raises(KeyBackupError, match="another node key"):
        import_keys(other, out, b"correct horse")


@pytest.mark.slow
def test_rotate_a_running_node_and_peers_follow(tmp_path: Path) -> None:
    """CLI + daemons as OS processes: export, rotate while running, restart under the new id.
    The `atd` commands are processes forked from one interpreter that imported the CLI once
    (tests/atd_forkserver.py: ~0.7 s of CPU less per command); the daemons are plain processes."""
    with forkserver(tmp_path, _env(), CLI_ONLY) as warm:
        _rotate_a_running_node(WarmAtd(warm), tmp_path)


def _rotate_a_running_node(atd: WarmAtd, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    atd("init", "--home", str(a), "--genesis", "--consortium", "demo")
    genesis = json.loads(atd("ledger", "show", "--home", str(a), "--kind", "genesis", "--json").stdout)[0]["id"]
    old = atd("init", "--home", str(b), "--join", genesis).stdout.strip()
    atd("member", "add", "--home", str(a), old, "--name", "bee")
    pw = tmp_path / "pw"
    pw.write_text("a long passphrase\n")
    proc = atd("key", "export", "--home", str(b), "--out", str(tmp_path / "b.keys"), "--passphrase-file", str(pw),
               check=False)
    assert proc.returncode != 0 and "--encrypted" in proc.stderr and proc.stderr.count("\n") == 1
    atd("key", "export", "--home", str(b), "--encrypted", "--out", str(tmp_path / "b.keys"), "--passphrase-file", str(pw))

    # polled in-process (`atd member list` run by typer's runner; the daemon's status over its
    # control socket): an `atd` start-up per poll costs ~0.7 s of CPU. The commands above and
    # below run as processes.
    def members(home: Path) -> dict:
        rows = json.loads(cli("member", "list", "--home", str(home), "--json"))["members"]
        return {r["peer_id"]: r for r in rows}

    def connected(home: Path) -> list[str]:
        return live_status(home)["peers"]

    da = start_daemon(a)
    daemons = [da]
    try:
        db = start_daemon(b, "--bootstrap", da.addrs[0])
        daemons.append(db)
        wait_until(lambda: old in connected(a), 60, "b connected to a")
        new = atd("key", "rotate", "--home", str(b)).stdout.strip()
        assert new != old and new.startswith("12D3KooW")
        wait_until(lambda: new in members(a) and members(a)[old]["revoked"], 60, "a learned the rotation")
        assert members(a)[new]["name"] == "bee" and not members(a)[new]["revoked"]
        db.stop()
        daemons.remove(db)
        db = start_daemon(b, "--bootstrap", da.addrs[0])
        daemons.append(db)
        assert f"/p2p/{new}" in db.addrs[0]
        wait_until(lambda: new in connected(a), 60, "a connected to b's new peer id")
        atd("ledger", "verify", "--home", str(a))
        atd("ledger", "verify", "--home", str(b))
    finally:
        for d in daemons:
            d.stop()
    # the old backup still decrypts (it is the old key, now retired: a restored copy cannot sign)
    restored = tmp_path / "restored"
    assert atd("key", "import", str(tmp_path / "b.keys"), "--home", str(restored), "--passphrase-file",
               str(pw)).stdout.strip() == old


def test_features_sealed_to_the_old_id_stay_readable(vgs_template, tmp_path: Path) -> None:
    """The X25519 key survives a rotation, so features sealed before it still open."""
    from atdnode.blobs import BlobStore
    from atdnode.aggregation import share_features
    from atdnode.aggregation.features_share import addressed_to, open_features
    from atdnode.node import rotate_key
    from tests.vgs_homes import copy_homes, sync

    a, b, c = copy_homes(vgs_template("disjoint"), tmp_path / "h")
    old = NodeIdentity.load(a).peer_id
    shared = share_features(b, to=[old])
    sync([a, b, c])
    r = rotate_key(a)
    assert r.old == old and r.new == NodeIdentity.load(a).peer_id != old
    sync([a, b, c])
    ident = NodeIdentity.load(a)
    with Ledger.open(a.ledger_db) as led:
        (entry,) = [e for e in addressed_to(led, ident.peer_id) if e.id == shared.entry.id]
        opened = open_features(ident, BlobStore(a.blobs_dir), led, entry)
    assert opened.X.shape[0] == shared.shape[0]
    with Ledger.open(b.ledger_db) as led:  # the peer agrees: a's old entries stay, its new key is the member
        m = led.membership()
        assert m.rotations == {public_key_from_peer_id(old): ident.public_key} and m.is_member(ident.public_key)
        led.verify()


def test_a_stolen_old_key_cannot_fork_a_rotated_identity(tmp_path: Path) -> None:
    """After M -> Y, M's old key signing another entry at (or after) the rotate
    seq is evidence against the old key only: Y stays the member, nothing is frozen, and a
    peer merging in any order agrees; a thief's competing rotation cannot take the identity."""
    f, m, lf, lm = _two(tmp_path)
    lm.append(m, "weights", {"blob": "00" * 32, "part": "extractor"})
    y = Signer.generate()
    rot = lm.rotate(m, y)
    lm.append(y, "hello", {"addrs": [], "role": "node"})
    prev = lm.get(rot.prev)
    at_rot = Entry.create(m, seq=rot.seq, prev=rot.prev, lamport=prev.lamport + 1, kind="weights",
                          body={"blob": "22" * 32})  # the thief, at the rotate seq
    after = Entry.create(m, seq=rot.seq + 1, prev=at_rot.id, lamport=prev.lamport + 2, kind="weights",
                         body={"blob": "33" * 32})
    for order in range(3):
        db = Ledger.open(tmp_path / f"p{order}.db", genesis_id=lf.genesis_id)
        rows = lf.raw_rows() + lm.raw_rows() + [at_rot.to_bytes(), after.to_bytes()]
        random.Random(order).shuffle(rows)
        res = db.merge(rows)
        mem = db.membership()
        assert mem.is_member(y.public_key) and mem.rotations == {m.public_key: y.public_key}, order
        assert db.state(at_rot.id) == "evidence" and db.state(after.id) in ("evidence", None)  # None: refused
        assert db.state(rot.id) == "log" and {at_rot.id, after.id} <= {i for i, _ in res.rejected}
        assert db._store.all_frozen() == {}
        db.append(y, "metrics", {"n": 1})  # the new key still signs
        db.verify()
        db.close()
    lm.merge([at_rot.to_bytes()])  # the owner's own node learns of the theft: same outcome
    assert lm.membership().is_member(y.public_key) and lm.state(at_rot.id) == "evidence"
    lm.append(y, "metrics", {"n": 2})
    lm.verify()

    # two valid rotations at one seq: the owner cannot be told from the thief -> the old key freezes
    z = Signer.generate()
    rival = Entry.create(m, seq=rot.seq, prev=rot.prev, lamport=prev.lamport + 1, kind="member",
                         body={"action": "rotate", "member": z.public_key,
                               "proof": z.sign(rotation_message(m.public_key, z.public_key))})
    lf.merge(lm.raw_rows() + [rival.to_bytes()])
    mem = lf.membership()
    assert not mem.is_member(y.public_key) and not mem.is_member(z.public_key)
    lf.verify()


def _contested(tmp_path: Path):
    """F founds, M is a member that rotated M -> Y (and Y said hello); a thief with M's old
    key signed a rival rotation M -> Z at the same seq. Returns the signers, F's ledger
    (holding everything: M frozen, Y and Z non-members) and every row."""
    f, m, lf, lm = _two(tmp_path)
    lm.append(m, "weights", {"blob": "00" * 32, "part": "extractor"})
    y, z = Signer.generate(), Signer.generate()
    rot = lm.rotate(m, y)
    hello = lm.append(y, "hello", {"addrs": [], "role": "node"})
    prev = lm.get(rot.prev)
    rival = Entry.create(m, seq=rot.seq, prev=rot.prev, lamport=prev.lamport + 1, kind="member",
                         body={"action": "rotate", "member": z.public_key,
                               "proof": z.sign(rotation_message(m.public_key, z.public_key))})
    lf.merge(lm.raw_rows() + [rival.to_bytes()])
    return f, m, y, z, lf, hello


def test_an_admin_restores_an_identity_frozen_by_a_competing_rotation(tmp_path: Path) -> None:
    """After M -> Y and a thief's M -> Z at the same seq, M is frozen and neither Y nor Z is a
    member; the founder's restore M -> Y gives the identity back to Y (name, membership,
    Y's held entries enter the log), Z stays out, and a peer merging every row in any order
    agrees. The restore names only a key M's own key rotated to, and nobody restores its own
    identity."""
    from ledger import NotAdmin

    f, m, y, z, lf, hello = _contested(tmp_path)
    mem = lf.membership()
    assert not mem.is_member(y.public_key) and not mem.is_member(z.public_key)
    assert lf._store.frozen_seq(m.public_key) is not None
    assert set(lf.rival_rotations(m.public_key)) == {y.public_key, z.public_key}
    with pytest.raises(MalformedEntry, match="not a key"):  # a fresh key is an admission, not a restore
        lf.restore(f, m.public_key, Signer.generate().public_key)
    lf.restore(f, m.public_key, y.public_key)
    mem = lf.membership()
    assert mem.is_member(y.public_key) and not mem.is_member(z.public_key)
    assert mem.rotations == {m.public_key: y.public_key} and mem.members[y.public_key].name == "m"
    assert lf._store.all_frozen() == {} and lf.state(hello.id) == "log"
    assert lf.rival_rotations(m.public_key) == {}
    lf.verify()
    rows = lf.raw_rows()
    for order in range(3):
        db = Ledger.open(tmp_path / f"q{order}.db", genesis_id=lf.genesis_id)
        shuffled = list(rows)
        random.Random(order).shuffle(shuffled)
        db.merge(shuffled)
        assert db.membership().rotations == {m.public_key: y.public_key} and db.membership().is_member(y.public_key)
        assert db.state(hello.id) == "log" and db._store.all_frozen() == {}
        db.verify()
        db.close()
    # a member that is not an admin cannot restore (its own node refuses; merged, it counts for nothing)
    (tmp_path / "b").mkdir()
    f2, m2, y2, z2, lf2, _ = _contested(tmp_path / "b")
    other = Signer.generate()
    lf2.admit(f2, other.public_key)
    with pytest.raises(NotAdmin):
        lf2.restore(other, m2.public_key, y2.public_key)
    forged = Entry.create(other, seq=1, prev=b"\0" * 32, lamport=50, kind="member",
                          body={"action": "restore", "member": m2.public_key, "key": z2.public_key})
    lf2.merge([forged.to_bytes()])
    assert not lf2.membership().is_member(z2.public_key) and lf2._store.frozen_seq(m2.public_key) is not None


def test_atd_member_restore_is_one_command(tmp_path: Path) -> None:
    """The operations path: the owner rotated (`atd key rotate`), a thief's rival rotation
    froze the identity; the founder runs `atd member restore OLD NEW` and `atd member list`
    shows the owner's new key carrying the identity."""
    from tests.factories import make_consortium

    founder, owner = make_consortium(tmp_path, 2)
    old = NodeIdentity.load(owner).signer
    with Ledger.open(founder.ledger_db) as lf, Ledger.open(owner.ledger_db) as lo:
        lo.merge(lf.raw_rows())  # the owner's node has synced its admission
    new_peer = cli("key", "rotate", "--home", str(owner.root)).strip().splitlines()[-1]
    z = Signer.generate()
    with Ledger.open(owner.ledger_db) as lo:
        rot = next(e for e in lo.query(kind="member", author=old.public_key) if e.body.get("action") == "rotate")
        rival = Entry.create(old, seq=rot.seq, prev=rot.prev, lamport=rot.lamport, kind="member",
                             body={"action": "rotate", "member": z.public_key,
                                   "proof": z.sign(rotation_message(old.public_key, z.public_key))})
        rows = lo.raw_rows() + [rival.to_bytes()]
    with Ledger.open(founder.ledger_db) as lf:
        lf.merge(rows)
        assert not lf.membership().is_member(public_key_from_peer_id(new_peer))
    before = {r["peer_id"]: r for r in json.loads(cli("member", "list", "--home", str(founder.root), "--json"))["members"]}
    assert before[old.peer_id]["contested"] == sorted([new_peer, z.peer_id])  # what the admin chooses from
    out = cli("member", "restore", "--home", str(founder.root), old.peer_id, new_peer)
    assert "restored" in out
    listed = {r["peer_id"]: r for r in json.loads(cli("member", "list", "--home", str(founder.root), "--json"))["members"]}
    assert listed[old.peer_id]["rotated_to"] == new_peer and not listed[new_peer]["revoked"]
    assert listed[old.peer_id]["contested"] == []
    assert z.peer_id not in listed


def test_a_crafted_backup_with_costly_scrypt_is_refused_fast(tmp_path: Path, monkeypatch) -> None:
    """A backup header asking n=2^20, r=16, p=4 (2 GB, 20+ s) is refused before any derivation, with
    a one-line error naming the cap; the real parameters still import. "Before any derivation"
    is checked directly (no scrypt object is made), not by the wall time, which a loaded
    machine stretches."""
    import atdnode.node.keybackup as kb
    from atdnode.node import KeyBackupError, export_keys, import_keys
    from atdnode.node.keybackup import SCRYPT

    home = NodeHome.at(tmp_path / "a")
    init_home(home, name="a", consortium="demo")
    out = tmp_path / "a.keys"
    export_keys(home, out, b"correct horse", kdf_cost={"n": 1 << 14, "r": 8, "p": 1})
    header = json.loads(out.read_text())
    made: list[dict] = []  # every scrypt derivation set up, by its parameters
    real = kb.Scrypt
    monkeypatch.setattr(kb, "Scrypt", lambda **kw: made.append(kw) or real(**kw))
    for cost in ({"n": 1 << 20, "r": 16, "p": 4}, {"n": SCRYPT["n"] * 2, "r": 8, "p": 1},
                 {"n": 1 << 14, "r": 8, "p": 2}):
        header["kdf"].update(cost)
        (tmp_path / "c.keys").write_text(json.dumps(header))
        with pytest.raises(KeyBackupError, match="beyond what atd writes") as err:
            import_keys(NodeHome.at(tmp_path / "r"), tmp_path / "c.keys", b"correct horse")
        assert made == [] and "\n" not in str(err.value)
    header["kdf"].update({"n": 20000, "r": 8, "p": 1})  # in range, but scrypt needs a power of two
    (tmp_path / "c.keys").write_text(json.dumps(header))
    with pytest.raises(KeyBackupError, match="not a power of two"):
        import_keys(NodeHome.at(tmp_path / "r"), tmp_path / "c.keys", b"correct horse")
    assert made == []
    assert import_keys(NodeHome.at(tmp_path / "r"), out, b"correct horse")
    assert [kw["n"] for kw in made] == [1 << 14]  # the accepted backup is derived once (the spy sees it)
