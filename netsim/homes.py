"""Node homes for a simulated consortium, made in-process (no `atd` subprocess per step).

`make_consortium` writes what `atd init --genesis` / `atd init --join` / `atd member add`
would: keys (mode 0600), config.toml, a ledger pinned to one genesis entry that admits
every node. Keys are derived from (scenario seed, node name), so peer ids — and with
them everything the in-memory network decides by peer id — are the same in every run
of a scenario. Each joiner's ledger starts with the genesis entry already merged (what a
joiner's first sync would fetch), so setup costs no network round.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from atdnode.node import NodeConfig, NodeHome, NodeIdentity
from ledger import Entry, Ledger, Signer


def node_seed(seed: int, name: str, salt: str = "key") -> bytes:
    """The 32-byte secret of node `name` in a scenario with `seed`."""
    return hashlib.sha256(f"atd-netsim|{salt}|{seed}|{name}".encode()).digest()


def _write_secret(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@dataclass
class Consortium:
    homes: dict[str, NodeHome]
    peer_ids: dict[str, str]
    seeds: dict[str, bytes]
    genesis: Entry

    @property
    def genesis_id(self) -> str:
        return self.genesis.id.hex()


def make_consortium(root: Path, names: list[str], *, seed: int, consortium: str = "netsim",
                    roles: dict[str, str] | None = None, established: bool = False) -> Consortium:
    """Create a home for each name under `root` (which must not hold them yet); the first
    node founds the consortium and its genesis admits all the others. `roles` (default
    "node") go into each node's config, hence into its signed hello entry.

    `established`: the consortium has met before -- every ledger already holds every
    node's signed `hello` (its in-memory address, X25519 key, role and name: what its
    daemon would sign on the in-memory back-end), as after the first round of gossip. The
    ledgers are copies of one file, so 1,000 nodes cost one ledger's writes, not the
    10^6 merges of a hello flood (the daemons then sign no new hello)."""
    root.mkdir(parents=True, exist_ok=True)
    homes: dict[str, NodeHome] = {}
    seeds: dict[str, bytes] = {}
    peer_ids: dict[str, str] = {}
    for name in names:
        home = NodeHome.at(root / name)
        home.make_dirs()
        seeds[name] = node_seed(seed, name)
        _write_secret(home.key_file, seeds[name])
        _write_secret(home.x25519_key_file, node_seed(seed, name, "x25519"))
        homes[name] = home
        peer_ids[name] = NodeIdentity.load(home).peer_id
    founder = names[0]
    signer = Signer.from_seed(seeds[founder])
    members = [(Signer.from_seed(seeds[n]).public_key, False) for n in names[1:]]
    with Ledger.open(homes[founder].ledger_db) as led:
        genesis = led.create_genesis(signer, consortium, members)
    for name in names:
        NodeConfig(name=name, genesis_id=genesis.id.hex(), consortium=consortium,
                   role=(roles or {}).get(name, "node")).save(homes[name])
        if name != founder and not established:
            with Ledger.open(homes[name].ledger_db, genesis_id=genesis.id) as led:
                led.merge([genesis.to_bytes()])
    if established:
        _say_every_hello(homes, names, seeds, roles or {})
    return Consortium(homes=homes, peer_ids=peer_ids, seeds=seeds, genesis=genesis)


def _say_every_hello(homes: dict[str, NodeHome], names: list[str], seeds: dict[str, bytes],
                     roles: dict[str, str]) -> None:
    """Append every node's hello to the founder's ledger, then copy that ledger to all."""
    from atdnode import bodies
    from atdnode.replication import write_announced

    founder = homes[names[0]].ledger_db
    said: dict[str, int] = {}
    with Ledger.open(founder) as led:
        for name in names:
            ident = NodeIdentity.load(homes[name])
            body = {"addrs": [f"/memory/{name}/p2p/{ident.peer_id}"],  # MemoryTransport.addrs()
                    "x25519": ident.x25519_public, "role": roles.get(name, "node"), "name": name}
            said[name] = bodies.append(led, Signer.from_seed(seeds[name]), "hello", body).seq
    for name in names[1:]:
        shutil.copyfile(founder, homes[name].ledger_db)  # closed: the WAL is checkpointed into it
    for name in names:  # ... and gossiped them: restarting daemons do not gossip them again
        write_announced(homes[name], said[name])
