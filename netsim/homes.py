"""Node homes for a simulated consortium, made in-process (no `atd` subprocess per step).

`make_consortium` is `atdnode.node.found_consortium` with what a simulation needs: keys
derived from (scenario seed, node name), so peer ids -- and with them everything the
in-memory network decides by peer id -- are the same in every run of a scenario; a
genesis that admits every node; each joiner's ledger starting with the genesis already
merged (what a joiner's first sync would fetch), so setup costs no network round.
"""
from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from atdnode.node import NodeHome, NodeIdentity, found_consortium
from ledger import Entry, Ledger, Signer


def node_seed(seed: int, name: str, salt: str = "key") -> bytes:
    """The 32-byte secret of node `name` in a scenario with `seed`."""
    return hashlib.sha256(f"atd-netsim|{salt}|{seed}|{name}".encode()).digest()


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
    """Create a home `root/NAME` for each name (none may exist yet); the first node founds
    the consortium and its genesis admits all the others. `roles` (default "node") go into
    each node's config, hence into its signed hello entry.

    `established`: the consortium has met before -- every ledger already holds every
    node's signed `hello` (its in-memory address, X25519 key, role and name: what its
    daemon would sign on the in-memory back-end), as after the first round of gossip. The
    ledgers are copies of one file, so 1,000 nodes cost one ledger's writes, not the
    10^6 merges of a hello flood (the daemons then sign no new hello)."""
    root.mkdir(parents=True, exist_ok=True)
    homes = {name: NodeHome.at(root / name) for name in names}
    seeds = {name: node_seed(seed, name) for name in names}
    genesis = found_consortium(list(homes.values()), consortium, admit_in_genesis=True, share_ledger=True,
                               keys=[(seeds[n], node_seed(seed, n, "x25519")) for n in names], roles=roles)
    peer_ids = {name: Signer.from_seed(seeds[name]).peer_id for name in names}
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
