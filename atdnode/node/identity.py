"""A node's keys: the Ed25519 key (ledger author + libp2p peer id) and the X25519 key.

Files in the node home (see atdnode.node.home): ``node.key`` and ``x25519.key``, each the raw
32-byte private key, mode 0600, created exclusively (an existing key is never overwritten:
ConfigError). Loading refuses a key file that others can read, like ssh does.

`init_home` is the whole of ``atd init``: directories, keys, config, ledger, and the
genesis entry (founder) or the pinned genesis id (joining node). `found_consortium` makes
fresh homes one consortium with it (`atd local`, netsim, the tests).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from atdnode.errors import ConfigError
from atdnode.node.home import NodeHome
from ledger import Entry, Ledger, Signer
from ledger.errors import LedgerError

KEY_LEN = 32


def _write_secret(path: Path, data: bytes) -> None:
    """Create `path` with mode 0600 and write `data`; ConfigError if it already exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} already exists; refusing to overwrite a node key") from None
    try:
        os.fchmod(fd, 0o600)  # in case of a permissive umask on exotic filesystems
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_secret(path: Path) -> bytes:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing (run `atd init` first)") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path} is accessible by other users (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
    data = path.read_bytes()
    if len(data) != KEY_LEN:
        raise ConfigError(f"{path} is not a raw {KEY_LEN}-byte key ({len(data)} bytes)")
    return data


@dataclass(frozen=True)
class NodeIdentity:
    """A node's keys: its Ed25519 signer (ledger entries, libp2p peer id) and its X25519 key
    (sealed features and secrets addressed to it); `create` writes them 0600, never over a home's."""

    signer: Signer
    x25519_private: X25519PrivateKey

    @property
    def public_key(self) -> bytes:
        return self.signer.public_key

    @property
    def peer_id(self) -> str:
        return self.signer.peer_id

    @property
    def x25519_public(self) -> bytes:
        return self.x25519_private.public_key().public_bytes_raw()

    @classmethod
    def create(cls, home: NodeHome, *, seeds: tuple[bytes, bytes] | None = None) -> "NodeIdentity":
        """Generate and store fresh keys in `home` (directories created); ConfigError if a key exists.
        `seeds` (the Ed25519 and the X25519 32-byte secrets) gives reproducible keys instead of
        random ones: a simulation derives them from its scenario's seed, so peer ids repeat."""
        home.make_dirs()
        for path in (home.key_file, home.x25519_key_file):
            if path.exists():
                raise ConfigError(f"{path} already exists; refusing to overwrite a node key")
        if seeds is not None and any(len(s) != KEY_LEN for s in seeds):
            raise ConfigError(f"node key seeds must be two {KEY_LEN}-byte secrets")
        signer = Signer.generate() if seeds is None else Signer.from_seed(seeds[0])
        x = X25519PrivateKey.generate() if seeds is None else X25519PrivateKey.from_private_bytes(seeds[1])
        _write_secret(home.key_file, signer.seed)
        _write_secret(home.x25519_key_file, x.private_bytes_raw())
        return cls(signer, x)

    @classmethod
    def load(cls, home: NodeHome) -> "NodeIdentity":
        """The keys stored in `home`; ConfigError if missing, malformed or readable by others."""
        signer = Signer.from_seed(_read_secret(home.key_file))
        x = X25519PrivateKey.from_private_bytes(_read_secret(home.x25519_key_file))
        return cls(signer, x)

    def libp2p_keypair(self) -> Any:
        """libp2p's Ed25519 KeyPair from the same seed, so the transport's peer id is ours."""
        from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pPrivateKey
        from libp2p.crypto.keys import KeyPair

        priv = Libp2pPrivateKey.from_bytes(self.signer.seed)
        return KeyPair(priv, priv.get_public_key())


def init_home(
    home: NodeHome,
    *,
    name: str | None = None,
    consortium: str | None = None,
    join: str | None = None,
    role: str = "node",
    members: Sequence[bytes] = (),
    entries: Sequence[bytes] = (),
) -> NodeIdentity:
    """Create a node home: keys, config.toml, ledger.db, blob dirs.

    With `consortium`, this node founds it: its ledger gets the signed genesis entry, which
    admits `members` (public keys; not admins) from the start. With `join` (hex genesis id),
    the ledger is pinned to that consortium and will accept only its genesis, and starts
    with `entries` (encoded entries of that consortium: what its first sync would pull)
    merged, the config learning the consortium's name from them as `atd ledger sync` does.
    Neither: the node joins later (`config.genesis_id` stays unset). `role` goes into
    config.toml, hence into the node's signed hello. A home holding only both key files (`atd key import`,
    `NodeIdentity.create`) keeps them. ConfigError if the home already holds a node or the
    arguments conflict.
    """
    from atdnode.node.config import NodeConfig

    if consortium is not None and join is not None:
        raise ConfigError("choose either --genesis (found a consortium) or --join GENESIS_ID, not both")
    if members and consortium is None:
        raise ConfigError("only the founder's genesis admits members")
    if entries and join is None:
        raise ConfigError("only a joining node starts with its consortium's entries")
    pin: bytes | None = None
    if join is not None:
        try:
            pin = bytes.fromhex(join.strip())
        except ValueError:
            pin = None
        if pin is None or len(pin) != 32:
            raise ConfigError(f"--join needs a 64-hex-digit genesis entry id, got {join!r}")
    if home.config_file.exists() or home.ledger_db.exists():
        raise ConfigError(f"{home.root} already holds an atd node; refusing to overwrite it")
    if home.key_file.exists() and home.x25519_key_file.exists():
        ident = NodeIdentity.load(home)  # keys restored by `atd key import`: initialise around them
        home.make_dirs()
    else:
        ident = NodeIdentity.create(home)
    cfg = NodeConfig(name=name or home.root.name, consortium=consortium, role=role)
    try:
        with Ledger.open(home.ledger_db, genesis_id=pin) as led:
            if consortium is not None:
                pin = led.create_genesis(ident.signer, consortium, [(k, False) for k in members]).id
            elif entries:
                led.merge(entries)
                cfg.consortium = led.membership().consortium
    except LedgerError as exc:
        raise ConfigError(f"cannot create the ledger: {exc}") from None
    cfg.genesis_id = pin.hex() if pin is not None else None
    cfg.save(home)
    return ident


def found_consortium(homes: Sequence[NodeHome], consortium: str, *, name_admissions: bool = False,
                     share_ledger: bool = False, admit_in_genesis: bool = False,
                     keys: Sequence[tuple[bytes, bytes]] | None = None,
                     roles: Mapping[str, str] | None = None) -> Entry:
    """Make fresh homes one consortium, as `atd init --genesis` on the first, `atd init --join`
    on the others and `atd member add` of each on the first would: `homes[0]` founds
    `consortium` and admits the others (each home's name is its folder's name).

    `name_admissions`: each admission records the node's name. `admit_in_genesis`: the
    genesis itself lists the others as members (no admission entries; they carry no name).
    `share_ledger`: each joiner's ledger gets the founder's genesis and admissions merged,
    and its config the consortium's name (what its first `atd ledger sync` would pull), so
    it knows who may talk to it before its daemon starts. `keys`: one (Ed25519, X25519)
    seed pair per home, for reproducible keys (`NodeIdentity.create`). `roles`: home name ->
    the node's role (default "node"). Returns the genesis entry."""
    if keys is not None and len(keys) != len(homes):
        raise ConfigError(f"{len(keys)} key seeds for {len(homes)} homes")
    if admit_in_genesis and name_admissions:
        raise ConfigError("members admitted in the genesis carry no names; name_admissions needs admissions")
    # every node's keys first (as `atd key import` would: init_home keeps them): the founder
    # admits the joiners by key, and each joiner starts with the founder's whole ledger
    joiners = [NodeIdentity.create(h, seeds=None if keys is None else keys[i]) for i, h in enumerate(homes)][1:]
    role = {h.root.name: (roles or {}).get(h.root.name, "node") for h in homes}
    founder = init_home(homes[0], consortium=consortium, role=role[homes[0].root.name],
                        members=[j.public_key for j in joiners] if admit_in_genesis else ())
    with Ledger.open(homes[0].ledger_db) as led:
        genesis = led.query(kind="genesis")[0]
        for h, j in zip(homes[1:], joiners) if not admit_in_genesis else ():
            led.admit(founder.signer, j.public_key, admin=False, name=h.root.name if name_admissions else None)
        known = [e.to_bytes() for e in led.query()] if share_ledger else []
    for h in homes[1:]:
        init_home(h, join=genesis.id.hex(), role=role[h.root.name], entries=known)
    return genesis
