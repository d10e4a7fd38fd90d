"""`atdnode.ids`: unique prefixes of entries, blobs, models and peers; ambiguous, unknown,
too short and malformed references are one-line `IdError`s. Also through the CLI."""
from __future__ import annotations

import json
from collections import defaultdict

import pytest

from atdnode.blobs import BlobStore
from atdnode.node import NodeHome, NodeIdentity, init_home
from atdnode.ids import IdError, MIN_PREFIX, resolve_entry, unique
from atdnode.node import resolve_blob, resolve_entry_ids, resolve_peer
from cli.app import run
from ledger import Ledger, Signer, peer_id_from_public_key


def test_unique_prefix_rules():
    ids = ["abcd1234", "abcd5678", "ef012345"]
    assert unique("ef01", ids, what="x") == "ef012345"
    assert unique("ABCD12", ids, what="x") == "abcd1234"  # hex is case-insensitive
    assert unique("abcd5678", ids, what="x") == "abcd5678"
    with pytest.raises(IdError, match="ambiguous: abcd1234, abcd5678"):
        unique("abcd", ids, what="x")
    with pytest.raises(IdError, match="x '9999' not found here"):
        unique("9999", ids, what="x")
    with pytest.raises(IdError, match=f"at least {MIN_PREFIX}"):
        unique("ef0", ids, what="x")
    with pytest.raises(IdError, match="not a 64-hex-digit"):
        unique("xyz!", ids, what="x")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A founder whose ledger holds enough entries that two share a 4-hex-digit prefix."""
    home = NodeHome.at(tmp_path_factory.mktemp("ids") / "n")
    init_home(home, consortium="c")
    signer = NodeIdentity.load(home).signer
    by_prefix: dict[str, list[tuple[str, str]]] = defaultdict(list)

    def only_hellos_collide() -> str | None:
        return next((p for p, v in by_prefix.items() if len(v) > 1 and all(k == "hello" for k, _ in v)), None)

    with Ledger.open(home.ledger_db) as led:
        led.append(signer, "metrics", {"i": -1})
        for e in led.query():
            by_prefix[e.id.hex()[:MIN_PREFIX]].append((e.kind, e.id.hex()))
        i = 0
        # ~300 entries expected (birthday bound); a collision with the genesis entry does not count,
        # the CLI test wants a prefix shared by hello entries alone
        while only_hellos_collide() is None:
            e = led.append(signer, "hello", {"addrs": [], "i": i})
            by_prefix[e.id.hex()[:MIN_PREFIX]].append((e.kind, e.id.hex()))
            i += 1
            assert i < 5000
    shared = only_hellos_collide()
    return home, shared, sorted(h for _, h in by_prefix[shared])


def test_entries_by_unique_prefix(node):
    home, shared, pair = node
    with Ledger.open(home.ledger_db) as led:
        metrics = led.query(kind="metrics")[0].id.hex()
        genesis = led.query(kind="genesis")[0].id.hex()
        # a prefix long enough to tell the two apart resolves; the shared one is ambiguous
        n = next(k for k in range(MIN_PREFIX, 64) if pair[0][:k] != pair[1][:k])
        assert resolve_entry(led, pair[0][:n + 1]).id.hex() == pair[0]
        with pytest.raises(IdError, match="ambiguous"):
            resolve_entry(led, shared)
        assert resolve_entry(led, metrics[:12], ("metrics",)).id.hex() == metrics
        assert resolve_entry(led, metrics).id.hex() == metrics
        with pytest.raises(IdError, match="is a metrics entry, not weights"):
            resolve_entry(led, metrics[:12], ("weights",))
        absent = next(f"{i:04x}" for i in range(1 << 16) if not led.find_prefix(f"{i:04x}"))
        with pytest.raises(IdError, match="is not in this node's ledger"):
            resolve_entry(led, absent)
    assert resolve_entry_ids(home, [genesis[:8]], ("genesis",)) == [genesis]


def test_blobs_held_or_announced(node, tmp_path):
    home, *_ = node
    store = BlobStore(home.blobs_dir)
    held = [store.put_bytes(bytes([i]) * 100) for i in range(40)]
    assert resolve_blob(home, held[0][:10]) == held[0]
    full = "f" * 64  # a full hash passes through: a peer may hold what this ledger never named
    assert resolve_blob(home, full) == full
    with pytest.raises(IdError, match="at least"):
        resolve_blob(home, held[0][:3])
    with pytest.raises(IdError, match="blob '[0-9a-f]{4}' not found among"):
        resolve_blob(home, next(f"{i:04x}" for i in range(1 << 16) if not any(h.startswith(f"{i:04x}") for h in held)))


def test_peers_by_prefix_or_suffix(node):
    home, *_ = node
    me = NodeIdentity.load(home).peer_id
    assert resolve_peer(home, me[-8:]) == me  # `ledger show` prints the last 8 characters
    assert resolve_peer(home, me[:20]) == me
    stranger = peer_id_from_public_key(Signer.from_seed(b"q" * 32).public_key)
    assert resolve_peer(home, stranger[-8:]) == stranger[-8:]  # unknown: left to the peer-id check
    assert run(["ledger", "show", "--home", str(home.root), "--author", stranger[-8:]]) != 0


def test_cli_takes_prefixes_and_says_why_not(node, capsys, monkeypatch):
    home, shared, pair = node
    monkeypatch.delenv("ATD_HOME", raising=False)
    h = str(home.root)
    assert run(["ledger", "show", "--home", h, "--kind", "metrics", "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)[0]
    me = metrics["author"]
    assert run(["ledger", "show", "--home", h, "--author", me[-8:], "--kind", "metrics", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [metrics]
    for argv, want in ((["aggregate", "--home", h, "--verify", shared], "entries of other kinds: hello"),
                       (["aggregate", "--home", h, "--verify", metrics["id"][:10]], "is a metrics entry"),
                       (["fetch", "--home", h, "0" * 3], "at least"),
                       (["classify", "--home", h, "--data", "digits", "--model", "abcdef"], "model 'abcdef' not found")):
        assert run(argv) != 0
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and want in err, (argv, err)


def test_ledger_wait_takes_a_unique_prefix(node, capsys, monkeypatch):
    """`atd ledger wait PREFIX`: once one entry here matches it; ambiguous or too short: one line."""
    home, shared, pair = node
    monkeypatch.delenv("ATD_HOME", raising=False)
    h = str(home.root)
    n = next(k for k in range(MIN_PREFIX, 64) if pair[0][:k] != pair[1][:k])
    assert run(["ledger", "wait", "--home", h, pair[0][:n + 1], pair[1]]) == 0
    assert capsys.readouterr().out.strip().endswith("2 entries here")
    with Ledger.open(home.ledger_db) as led:
        absent = next(f"{i:04x}" for i in range(1 << 16) if not led.find_prefix(f"{i:04x}"))
    for ref, want in ((shared, "ambiguous"), ("abc", "at least 4"), (absent, f"timed out after 0.2 s waiting for entries {absent}")):
        assert run(["ledger", "wait", "--home", h, "--timeout", "0.2", ref]) != 0
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and want in err, (ref, err)
