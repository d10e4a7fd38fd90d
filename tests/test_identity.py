"""Node identity and config: key files, peer ids equal to libp2p's, TOML config round trip."""
from __future__ import annotations

import os
import stat

import pytest

from atdnode.node import NodeConfig, NodeHome, NodeIdentity, found_consortium, init_home
from atdnode.errors import ConfigError
from ledger import Ledger, Signer, peer_id_from_public_key


def test_create_writes_private_keys_0600_and_loads_back(tmp_path):
    home = NodeHome.at(tmp_path / "n")
    ident = NodeIdentity.create(home)
    for f in (home.key_file, home.x25519_key_file):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        assert len(f.read_bytes()) == 32
    again = NodeIdentity.load(home)
    assert again.public_key == ident.public_key and again.peer_id == ident.peer_id
    assert again.x25519_public == ident.x25519_public and len(again.x25519_public) == 32
    assert ident.peer_id.startswith("12D3KooW")


def test_refuses_to_overwrite_a_key(tmp_path):
    home = NodeHome.at(tmp_path / "n")
    ident = NodeIdentity.create(home)
    with pytest.raises(ConfigError, match="refusing"):
        NodeIdentity.create(home)
    assert NodeIdentity.load(home).public_key == ident.public_key


def test_load_rejects_missing_short_or_world_readable_keys(tmp_path):
    home = NodeHome.at(tmp_path / "n")
    with pytest.raises(ConfigError, match="missing"):
        NodeIdentity.load(home)
    NodeIdentity.create(home)
    os.chmod(home.key_file, 0o644)
    with pytest.raises(ConfigError, match="other users"):
        NodeIdentity.load(home)
    os.chmod(home.key_file, 0o600)
    home.key_file.write_bytes(b"short")
    with pytest.raises(ConfigError, match="32-byte"):
        NodeIdentity.load(home)


def test_peer_id_equals_libp2p_and_keypair_comes_from_the_same_seed(tmp_path):
    from libp2p.crypto.ed25519 import Ed25519PublicKey as Libp2pPublicKey
    from libp2p.peer.id import ID

    for seed in (b"\x00" * 32, bytes(range(32)), os.urandom(32)):
        signer = Signer.from_seed(seed)
        expected = ID.from_pubkey(Libp2pPublicKey.from_bytes(signer.public_key)).to_base58()
        assert peer_id_from_public_key(signer.public_key) == expected == signer.peer_id
    ident = NodeIdentity.create(NodeHome.at(tmp_path / "n"))
    kp = ident.libp2p_keypair()
    assert kp.public_key.to_bytes() == ident.public_key
    assert ID.from_pubkey(kp.public_key).to_base58() == ident.peer_id
    msg = b"same key on the wire and on the ledger"
    assert kp.public_key.verify(msg, ident.signer.sign(msg))


def test_config_round_trip_keeps_unknown_keys(tmp_path):
    home = NodeHome.at(tmp_path / "n")
    cfg = NodeConfig(name="h1", genesis_id="ab" * 32, consortium="demo", bootstrap=["/ip4/127.0.0.1/tcp/1/p2p/x"],
                     role="festa-server", extra={"data": {"spec": "synthetic:4"}})
    cfg.save(home)
    assert NodeConfig.load(home) == cfg
    assert "genesis_id" not in NodeConfig(name="x").to_dict()


@pytest.mark.parametrize("text,match", [
    ("name = 3\n", "name"), ("genesis_id = 'zz'\n", "genesis_id"), ("listen = 'x'\n", "listen"),
    ("name = [\n", "TOML"),
])
def test_bad_config_is_a_config_error(tmp_path, text, match):
    home = NodeHome.at(tmp_path / "n")
    home.make_dirs()
    home.config_file.write_text(text)
    with pytest.raises(ConfigError, match=match):
        NodeConfig.load(home)


def test_init_home_founder_and_joiner(tmp_path):
    a = NodeHome.at(tmp_path / "a")
    ident = init_home(a, consortium="demo")
    cfg = NodeConfig.load(a)
    assert cfg.name == "a" and cfg.consortium == "demo"
    with Ledger.open(a.ledger_db) as led:
        (g,) = led.query(kind="genesis")
        assert g.author == ident.public_key and g.id.hex() == cfg.genesis_id
        assert led.membership().is_admin(ident.public_key)
    b = NodeHome.at(tmp_path / "b")
    init_home(b, name="bee", join=cfg.genesis_id)
    assert NodeConfig.load(b).genesis_id == cfg.genesis_id
    with Ledger.open(b.ledger_db) as led:
        assert led.genesis_id.hex() == cfg.genesis_id and led.all_entries() == []
    for kwargs, match in ((dict(consortium="x"), "already holds"), ):
        with pytest.raises(ConfigError, match=match):
            init_home(a, **kwargs)
    with pytest.raises(ConfigError, match="64-hex"):
        init_home(NodeHome.at(tmp_path / "c"), join="nothex")
    with pytest.raises(ConfigError, match="either"):
        init_home(NodeHome.at(tmp_path / "d"), consortium="x", join=cfg.genesis_id)


def test_found_consortium_seeded_keys_genesis_members_and_roles(tmp_path):
    """Seeded keys repeat the same consortium byte for byte; the genesis admits the joiners;
    each joiner starts with the founder's ledger and the consortium's name; roles reach the
    configs."""
    keys = [(bytes([i]) * 32, bytes([100 + i]) * 32) for i in range(3)]

    def found(root):
        homes = [NodeHome.at(root / n) for n in ("s", "a", "b")]
        g = found_consortium(homes, "sim", admit_in_genesis=True, share_ledger=True, keys=keys,
                             roles={"s": "msd-server"})
        return homes, g

    homes, g = found(tmp_path / "one")
    assert found(tmp_path / "two")[1].id == g.id  # reproducible: same keys, same genesis
    assert g.id != found_consortium([NodeHome.at(tmp_path / "r" / n) for n in "xyz"], "sim", admit_in_genesis=True).id
    ids = [NodeIdentity.load(h) for h in homes]
    assert [i.public_key for i in ids] == [Signer.from_seed(k).public_key for k, _ in keys]
    assert ids[1].x25519_public == NodeIdentity.create(NodeHome.at(tmp_path / "x"), seeds=keys[1]).x25519_public
    assert [m for m, _ in g.body["members"]] == [ids[1].public_key, ids[2].public_key]
    for h in homes:
        cfg = NodeConfig.load(h)
        assert (cfg.consortium, cfg.genesis_id, cfg.role) == ("sim", g.id.hex(), "msd-server" if h is homes[0] else "node")
        with Ledger.open(h.ledger_db) as led:
            assert [e.kind for e in led.all_entries()] == ["genesis"]  # no admission entries
            assert all(led.membership().is_member(i.public_key) for i in ids)
    with pytest.raises(ConfigError, match="2 key seeds for 3"):
        found_consortium([NodeHome.at(tmp_path / "e" / n) for n in "abc"], "sim", keys=keys[:2])
    with pytest.raises(ConfigError, match="carry no names"):
        found_consortium([NodeHome.at(tmp_path / "f" / n) for n in "ab"], "sim", admit_in_genesis=True,
                         name_admissions=True)
    with pytest.raises(ConfigError, match="32-byte"):
        NodeIdentity.create(NodeHome.at(tmp_path / "g"), seeds=(b"short", b"x" * 32))
