"""The p-FESTA / MSD embedder is a secret of the clients (p-FESTA §III-B, MSD §III): sealed on
the ledger to the clients the server accepted, adopted by id in the server's signed entry,
never readable by it. Ledger-level checks first, then p-FESTA campaigns on the in-memory
network."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from atdnode.node import NodeIdentity
from atdnode.split import SplitSecretError
from atdnode.split import accept_clients, adopt_secret
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
    with Ledger.open(homes[0].ledger_db) as led:  # the server accepts the two clients
        accept_clients(server, led, service, [c1.peer_id, c2.peer_id])
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
    with Ledger.open(homes[3].ledger_db) as led:  # admitted, joined late, never accepted
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
    """The secret is sealed to the campaign's accepted clients (their own signed `split_join` and
    the server's acceptance), not to every member with a key: an outsider is no recipient, a
    secret sealed to it anyway is refused by every node (the server cannot adopt it), and the
    adopted secret is the one the server's signed adoption names."""
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
    with Ledger.open(homes[0].ledger_db) as led:
        accept_clients(server, led, service, [c1.peer_id, c2.peer_id])
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
        assert campaign_secret(led, service) is None  # nothing adopted yet
        with pytest.raises(SplitSecretError, match="outside the campaign"):
            adopt_secret(server, led, leaky.id.hex(), service)
        assert adopt_secret(server, led, entry.id.hex(), service) == entry.id.hex()
        assert campaign_secret(led, service).id == entry.id
    spread(homes)
    with Ledger.open(homes[2].ledger_db) as led:
        check_adopted(led, entry.id.hex(), service)
        with pytest.raises(SplitSecretError, match="adoption names"):
            check_adopted(led, leaky.id.hex(), service)
        # a second valid secret made later does not displace the first
        later = create_secret(c2, led, service, CFG)
        assert later.lamport > entry.lamport and campaign_secret(led, service).id == entry.id


def _campaign(tmp_path: Path, n: int):
    """A p-FESTA service on homes[0]; members 1..n-1 announce keys and join; the server
    accepts members 1 and 2 only. Returns homes, identities and the service id."""
    homes = make_consortium(tmp_path, n)
    ids = [NodeIdentity.load(h) for h in homes]
    with Ledger.open(homes[0].ledger_db) as led:
        ensure_hello(ids[0], led, role="pfesta-server")
        service = led.append(ids[0].signer, "service", {"algorithm": "pfesta", "body": CFG.to_dict()}).id.hex()
    spread(homes)
    for ident, h in zip(ids[1:], homes[1:]):
        with Ledger.open(h.ledger_db) as led:
            ensure_hello(ident, led)
            ensure_joined(ident, led, service)
    spread(homes)
    with Ledger.open(homes[0].ledger_db) as led:
        accept_clients(ids[0], led, service, [ids[1].peer_id, ids[2].peer_id])
    spread(homes)
    return homes, ids, service


def test_a_member_that_joined_and_was_not_accepted_cannot_open_the_embedder(tmp_path: Path) -> None:
    """Joining is not self-service: member x signed its `split_join` (and announced its key)
    but the server never accepted it. The secret is not sealed to it, x cannot make one, a
    secret sealed to it as well is invalid, and after the adoption the server accepts
    nobody more (the adopted secret stays sealed to every accepted client)."""
    from atdnode import bodies
    from atdnode.split.secret import PURPOSE, accepted
    from protocols.feature_crypto import ALG, seal_bytes
    from safetensors.torch import save as st_save
    from protocols.split_parts import new_embedder_state

    homes, (server, c1, c2, x), service = _campaign(tmp_path, 4)
    with Ledger.open(homes[3].ledger_db) as led:
        assert accepted(led, service) == {c1.public_key, c2.public_key}
        with pytest.raises(SplitSecretError, match="accepted client"):
            create_secret(x, led, service, CFG)
    with Ledger.open(homes[1].ledger_db) as led:
        entry = create_secret(c1, led, service, CFG)
        # a client sealing to x as well: not the campaign's client list
        to = {p: k for p, k in ((c1.peer_id, c1.x25519_public), (c2.peer_id, c2.x25519_public),
                                (x.peer_id, x.x25519_public))}
        env = seal_bytes(st_save(new_embedder_state(CFG)), to, c1.x25519_private, purpose=PURPOSE,
                         sender_id=c1.peer_id)
        wide = bodies.append(led, c1.signer, SPLIT_SECRET_KIND,
                             {"service": service, "recipients": sorted(to), "envelope": env, "alg": ALG})
        with pytest.raises(SplitSecretError, match="outside the campaign"):
            check_secret_entry(led, wide, service)
    assert set(entry.body["recipients"]) == {c1.peer_id, c2.peer_id}
    spread(homes)
    with Ledger.open(homes[0].ledger_db) as led:
        adopt_secret(server, led, entry.id.hex(), service)
        with pytest.raises(SplitSecretError, match="closed its client list"):
            accept_clients(server, led, service, [x.peer_id])
    spread(homes)
    with Ledger.open(homes[3].ledger_db) as led:
        for e in (entry, wide):
            with pytest.raises(SplitSecretError, match="did not accept"):
                open_secret(x, led, e.id.hex(), service, CFG)
        with pytest.raises(DecryptionError):  # nor by going around the checks
            open_sealed_bytes(entry.body["envelope"], x.x25519_private, x.peer_id, purpose=PURPOSE)
    with Ledger.open(homes[2].ledger_db) as led:
        open_secret(c2, led, entry.id.hex(), service, CFG)  # an accepted client opens it


def test_a_rogue_secret_cannot_displace_the_clients(tmp_path: Path) -> None:
    """An accepted client signs its own secret at a lamport below the adopted one's (a short
    chain can): sealed to itself alone it is no secret of the campaign; sealed to every
    client it is valid, yet the campaign's secret stays the one the server adopted, and the
    clients still open theirs."""
    from atdnode.split.secret import PURPOSE
    from ledger import Entry
    from protocols.feature_crypto import ALG, seal_bytes
    from safetensors.torch import save as st_save
    from protocols.split_parts import new_embedder_state

    homes, (server, c1, c2), service = _campaign(tmp_path, 3)
    with Ledger.open(homes[1].ledger_db) as led:
        for i in range(5):  # c1's clock runs ahead of c2's
            led.append(c1.signer, "metrics", {"n": i})
        entry = create_secret(c1, led, service, CFG)
    spread(homes)
    with Ledger.open(homes[0].ledger_db) as led:
        adopt_secret(server, led, entry.id.hex(), service)
    rogues = []
    with Ledger.open(homes[2].ledger_db) as led:
        last = led.query(author=c2.public_key)[-1]
        for i, to in enumerate(({c2.peer_id: c2.x25519_public},
                                {c1.peer_id: c1.x25519_public, c2.peer_id: c2.x25519_public})):
            env = seal_bytes(st_save(new_embedder_state(CFG)), to, c2.x25519_private, purpose=PURPOSE,
                             sender_id=c2.peer_id)
            prev = rogues[-1] if rogues else last
            rogue = Entry.create(c2.signer, seq=prev.seq + 1, prev=prev.id, lamport=prev.lamport + 1,
                                 kind=SPLIT_SECRET_KIND, body={"service": service, "recipients": sorted(to),
                                                               "envelope": env, "alg": ALG})
            assert not led.merge([rogue]).rejected and rogue.lamport < entry.lamport
            rogues.append(rogue)
        with pytest.raises(SplitSecretError, match="not sealed to every accepted client"):
            check_secret_entry(led, rogues[0], service)
        check_secret_entry(led, rogues[1], service)  # valid, but not adopted
    spread(homes)
    for h, ident in ((homes[0], None), (homes[1], c1), (homes[2], c2)):
        with Ledger.open(h.ledger_db) as led:
            assert campaign_secret(led, service).id == entry.id
            if ident is None:  # the server: an offered rogue changes nothing
                assert adopt_secret(server, led, rogues[1].id.hex(), service) == entry.id.hex()
                continue
            for r in rogues:
                with pytest.raises(SplitSecretError):
                    check_adopted(led, r.id.hex(), service)
            check_adopted(led, entry.id.hex(), service)
            open_secret(ident, led, entry.id.hex(), service, CFG)


def test_a_manual_server_refuses_a_member_its_operator_did_not_accept(tmp_path: Path) -> None:
    """`[split] accept = "manual"`: a member that joins and asks is refused with the one-line
    reason (naming `atd split accept`), and nothing is sealed to it; the operator's
    `atd split accept PEER` then makes it a client."""
    from atdnode.split import SplitJoinError
    from atdnode.transport import MemoryNetwork

    homes = make_consortium(tmp_path, 2)
    configure(homes[0], "pfesta-server", rounds=1, steps_per_round=1, clients=1, accept="manual")
    net = MemoryNetwork(seed=38)
    got: dict = {}

    async def main() -> None:
        server = daemon_on(net, homes[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, [], [])
            try:
                await client(net, homes[1], server, "digit", data(1, limit=20), evaluate=False)
            except SplitJoinError as e:
                got["error"] = str(e)
            got["adopted"] = server.services[0].secret_entry
            server.stop()

    trio.run(main)
    assert "atd split accept" in got.get("error", "") and "\n" not in got["error"]
    assert got["adopted"] is None
    with Ledger.open(homes[0].ledger_db) as led:
        assert led.query(kind="split_accept") == [] and led.query(kind=SPLIT_SECRET_KIND) == []
    from atdnode.split.secret import accepted
    from tests.factories import cli

    peer = NodeIdentity.load(homes[1]).peer_id
    assert "accepted into campaign" in cli("split", "accept", "--home", str(homes[0].root), peer)
    with Ledger.open(homes[0].ledger_db) as led:
        (service,) = led.query(kind="service")
        assert accepted(led, service.id.hex()) == {NodeIdentity.load(homes[1]).public_key}
