"""The p-FESTA / MSD embedder is a secret of the clients (issue 10; p-FESTA §III-B, MSD §III):
sealed on the ledger to the client members, adopted by id by the server, never readable by
it. Ledger-level checks first, then a p-FESTA campaign on the in-memory network."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from atdnode.node import NodeIdentity
from atdnode.split import SplitSecretError
from atdnode.split.secret import (campaign_secret, check_adopted, check_secret_body, check_secret_entry,
                                  create_secret, ensure_hello, ensure_joined, open_secret)
from ledger import Ledger
from atdnode.bodies import READERS, SPLIT_SECRET_KIND, BodyError, blob_readers
from protocols.feature_crypto import DecryptionError, open_sealed_bytes
from protocols.split_parts import SPLIT_MODEL, build_plain_embedder
from tests.split_checks import files_containing, secret_bytes, spread
from tests.factories import daemon_on, make_consortium
from tests.splitnet import client, configure, data

CFG = SPLIT_MODEL


def test_secret_sealed_to_clients_only(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 4)  # server, two clients, a member that has no key yet
    server, c1, c2, late = (NodeIdentity.load(h) for h in homes)
    with Ledger.open(homes[0].ledger_db) as led:
        ensure_hello(server, led, role="pfesta-server")
        service = led.append(server.signer, "service", {"algorithm": "pfesta", "body": CFG.to_dict()}).id.hex()
    for ident, h in ((c1, homes[1]), (c2, homes[2])):
        spread(homes)
        with Ledger.open(h.ledger_db) as led:
            ensure_hello(ident, led)
            ensure_joined(ident, led, service)
    spread(homes)
    with Ledger.open(homes[1].ledger_db) as led:
        entry = create_secret(c1, led, service, CFG)
        mine = open_secret(c1, led, entry.id.hex(), service, CFG)
    assert entry.kind == SPLIT_SECRET_KIND
    assert set(entry.body["recipients"]) == {c1.peer_id, c2.peer_id}  # not the server, not the keyless member
    spread(homes)
    with Ledger.open(homes[2].ledger_db) as led:
        theirs = open_secret(c2, led, entry.id.hex(), service, CFG)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    x = torch.rand(3, 1, 16, 16)
    assert torch.equal(build_plain_embedder(CFG, state=mine)(x), build_plain_embedder(CFG, state=theirs)(x))
    # the position table is random, not the public sin-cos one (and not another draw)
    with Ledger.open(homes[1].ledger_db) as led:
        other = open_secret(c1, led, create_secret(c1, led, service, CFG).id.hex(), service, CFG)
    assert not torch.equal(other["vit.pos_embed"], mine["vit.pos_embed"])

    with Ledger.open(homes[0].ledger_db) as led:  # the server replicates the entry, cannot open it
        check_secret_entry(led, led.get(entry.id), service)
        with pytest.raises(SplitSecretError, match="did not join"):
            open_secret(server, led, entry.id.hex(), service, CFG)
        with pytest.raises(SplitSecretError, match="server cannot make"):
            create_secret(server, led, service, CFG)
    with pytest.raises(DecryptionError):  # not even by going around the recipient list
        open_sealed_bytes(entry.body["envelope"], server.x25519_private, c2.peer_id, purpose="atd-split-embedder-v1")
    with Ledger.open(homes[3].ledger_db) as led:  # admitted, joined, but announced its key too late
        ensure_hello(late, led)
        ensure_joined(late, led, service)
        with pytest.raises(SplitSecretError, match="not a recipient"):
            open_secret(late, led, entry.id.hex(), service, CFG)
    assert files_containing(Path(homes[0].root), secret_bytes(mine)) == []
    assert files_containing(Path(homes[1].root), secret_bytes(mine)) == []  # sealed everywhere, no file
    env = bytearray(entry.body["envelope"])
    env[-5] ^= 1
    with pytest.raises(DecryptionError):
        open_sealed_bytes(bytes(env), c2.x25519_private, c2.peer_id, purpose="atd-split-embedder-v1")


def test_bodies_validate() -> None:
    good = {"service": "ab" * 32, "recipients": ["a", "b"], "envelope": b"x", "alg": "A"}
    assert check_secret_body(dict(good)) == good
    for bad in ({**good, "service": "zz"}, {**good, "recipients": ["b", "a"]}, {**good, "recipients": []},
                {**good, "recipients": [1]}, {**good, "envelope": b""}, {**good, "envelope": "x"},
                {k: v for k, v in good.items() if k != "alg"}):
        with pytest.raises(BodyError):
            check_secret_body(bad)
    assert blob_readers({READERS: ["a", "b"]}) == {"a", "b"} and blob_readers({}) is None


def test_pfesta_campaign_secret_never_reaches_the_server(tmp_path: Path) -> None:
    """Two clients ask at once; the server waits for both, both may make a secret, the server
    adopts one and both use it. Nothing on the server (ledger, state, records) holds it."""
    from atdnode.transport import MemoryNetwork

    homes = make_consortium(tmp_path, 3)
    configure(homes[0], "pfesta-server", rounds=1, steps_per_round=2)
    net = MemoryNetwork(seed=21)
    results: dict = {}

    async def main() -> None:
        server = daemon_on(net, homes[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, [], [])
            svc = server.services[0]

            async def go(name, home, task, spec):
                results[name] = await client(net, home, server, task, spec, evaluate=False)

            async with trio.open_nursery() as clients:
                clients.start_soon(go, "a", homes[1], "digit", data(1, limit=60))
                clients.start_soon(go, "b", homes[2], "ink", data(2, limit=60))
            results["adopted"] = svc.secret_entry
            assert "embedder" not in str(sorted(svc.offer))
            server.stop()

    trio.run(main)
    adopted = results["adopted"]
    assert results["a"].record["secret_entry"] == results["b"].record["secret_entry"] == adopted
    ident = NodeIdentity.load(homes[1])
    with Ledger.open(homes[1].ledger_db) as led:
        service = led.query(kind="service")[0]
        state = open_secret(ident, led, adopted, service.id.hex(), CFG)
    assert not any("embedder" in k or "seed" == k for k in service.body)
    assert files_containing(Path(homes[0].root), secret_bytes(state)) == []


def test_a_member_outside_the_campaign_cannot_open_it(tmp_path: Path) -> None:
    """Issue 24 item 6: the secret is sealed to the members that joined the campaign (their own
    signed `split_join`), not to every member with a key: an outsider (say, a node the server's
    operator also runs) is no recipient, a secret sealed to it anyway is refused by every node,
    and the adopted secret is the campaign's first valid one, whichever the server names."""
    from atdnode import bodies
    from protocols.feature_crypto import ALG, seal_bytes
    from atdnode.split.secret import PURPOSE
    from safetensors.torch import save as st_save
    from protocols.split_parts import new_embedder_state

    homes = make_consortium(tmp_path, 4)  # server, two clients, an outsider with a key
    server, c1, c2, out = (NodeIdentity.load(h) for h in homes)
    with Ledger.open(homes[0].ledger_db) as led:
        ensure_hello(server, led, role="pfesta-server")
        service = led.append(server.signer, "service", {"algorithm": "pfesta", "body": CFG.to_dict()}).id.hex()
    spread(homes)
    for ident, h in ((c1, homes[1]), (c2, homes[2]), (out, homes[3])):
        with Ledger.open(h.ledger_db) as led:
            ensure_hello(ident, led)
            if ident is not out:
                ensure_joined(ident, led, service)
    spread(homes)
    with Ledger.open(homes[1].ledger_db) as led:
        entry = create_secret(c1, led, service, CFG)
    assert set(entry.body["recipients"]) == {c1.peer_id, c2.peer_id}  # not the outsider
    # a colluding maker (c2) seals another secret to the outsider as well: it is no valid secret
    with Ledger.open(homes[2].ledger_db) as led:
        spread(homes)
        to = {c2.peer_id: c2.x25519_public, out.peer_id: out.x25519_public}
        env = seal_bytes(st_save(new_embedder_state(CFG)), to, c2.x25519_private, purpose=PURPOSE,
                         sender_id=c2.peer_id)
        leaky = bodies.append(led, c2.signer, SPLIT_SECRET_KIND,
                              {"service": service, "recipients": sorted(to), "envelope": env, "alg": ALG})
        with pytest.raises(SplitSecretError, match="outside the campaign"):
            check_secret_entry(led, leaky, service)
    spread(homes)
    with Ledger.open(homes[3].ledger_db) as led:
        for e in (entry, leaky):
            with pytest.raises(SplitSecretError, match="did not join"):
                open_secret(out, led, e.id.hex(), service, CFG)
        with pytest.raises(SplitSecretError, match="not joined"):
            create_secret(out, led, service, CFG)
    with Ledger.open(homes[0].ledger_db) as led:  # the server's pick cannot be the leaky one
        assert campaign_secret(led, service).id == entry.id
    with Ledger.open(homes[2].ledger_db) as led:
        check_adopted(led, entry.id.hex(), service)
        with pytest.raises(SplitSecretError, match="first valid secret"):
            check_adopted(led, leaky.id.hex(), service)
        # a second valid secret made later does not displace the first
        later = create_secret(c2, led, service, CFG)
        assert later.lamport > entry.lamport and campaign_secret(led, service).id == entry.id
