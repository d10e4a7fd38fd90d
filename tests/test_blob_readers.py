"""Reader lists that hold: a later entry of another author never widens a blob's readers,
nor closes an open blob (atdnode.blobs.readers), on the serving side of real daemons too.

The attack: member M signs its own `weights` entry naming member A's
reader-restricted blob with `readers: []` (so M, as that entry's author, would be a
reader) and asks A for the blob. Before the fix A served all of it (readers were the
union over every entry naming the blob); now M gets 0 bytes and A's named reader still
gets the blob.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from atdnode.bodies import READERS
from atdnode.blobs.readers import reader_lists
from atdnode.node import NodeIdentity
from atdnode.blobs import PROTOCOL as BLOB_PROTOCOL, pack
from atdnode.blobs.wire import unpack
from atdnode.transport import MemoryNetwork
from ledger import Entry, Ledger, Signer
from tests.factories import append, daemon_on, make_consortium, wait_for, weights_body

BLOB = "ab" * 32
OWNER, READER, THIEF = (Signer.from_seed(bytes([i]) * 32) for i in (1, 2, 3))


def entry(signer: Signer, lamport: int, body: dict, seq: int = 1) -> Entry:
    return Entry.create(signer, seq=seq, prev=b"\0" * 32 if seq == 1 else b"\1" * 32, lamport=lamport,
                        kind="weights", body={"blob": BLOB, **body})


def readers_of(*entries: Entry, node: Signer = READER) -> frozenset[str] | None:
    """Who `node` serves the blob to (None: every member)."""
    return reader_lists(entries, [node.public_key]).serve.get(BLOB)


def test_a_later_entry_of_another_author_never_widens_a_reader_list() -> None:
    own = entry(OWNER, 5, {READERS: [READER.peer_id]})
    assert readers_of(own) == readers_of(own, node=OWNER) == {OWNER.peer_id, READER.peer_id}
    for thief_body in ({READERS: []}, {READERS: [THIEF.peer_id]}, {}, {"recipients": [THIEF.peer_id]},
                       {READERS: [READER.peer_id, THIEF.peer_id]}):
        for lamport in (9, 1):  # later, and backdated below the owner's entry (a short chain can)
            for node in (OWNER, READER):  # the owner and its reader, the two holders
                got = readers_of(own, entry(THIEF, lamport, thief_body), node=node)
                assert got is not None and THIEF.peer_id not in got, (thief_body, lamport, node.peer_id, got)
            # the owner serves its own list, untouched by the intruder's entry
            assert readers_of(own, entry(THIEF, lamport, thief_body), node=OWNER) == {OWNER.peer_id, READER.peer_id}
    # the intruding entry is reported, naming both authors
    notes = reader_lists([own, entry(THIEF, 9, {READERS: []})]).notes
    assert len(notes) == 1 and THIEF.peer_id in notes[0][1] and OWNER.peer_id in notes[0][1]
    # who fetches: the reader, not the thief (not even with the thief's own entry naming it)
    assert BLOB in reader_lists([own, entry(THIEF, 9, {READERS: []})], [READER.public_key]).admitted
    assert BLOB not in reader_lists([own], [THIEF.public_key]).admitted
    # the owner may add readers with a later entry of its own; an unrestricted blob stays open
    assert THIEF.peer_id in readers_of(own, entry(OWNER, 7, {READERS: [THIEF.peer_id]}, seq=2))
    assert readers_of(entry(OWNER, 5, {}), entry(OWNER, 6, {}, seq=2)) is None
    # an open blob is not closed by an intruder's list: the owner and its other holders serve it,
    # and the others still fetch it
    public = [entry(OWNER, 5, {}), entry(THIEF, 6, {READERS: []})]
    assert readers_of(*public, node=OWNER) is None and readers_of(*public, node=READER) is None
    assert BLOB in reader_lists(public, [READER.public_key]).admitted


def test_a_restricted_claim_binds_its_own_author_only_whatever_the_lamports() -> None:
    """Squatting: the thief names the owner's open blob with `readers: [itself]`, backdated
    below the owner's entry (lamport 1, a short chain can) or not. Every other member still
    fetches it and every holder but the thief serves it to all. The converse: the thief
    naming the owner's restricted blob in an open entry, backdated or not, is served by
    no holder (it may try a fetch; it gets 0 bytes, see the daemon test below)."""
    for lamport in (1, 9):
        squat = entry(THIEF, lamport, {READERS: [THIEF.peer_id]})
        public = [entry(OWNER, 5, {}), squat]
        for node in (OWNER, READER):  # the publisher, and a member that fetched it from it
            assert BLOB in reader_lists(public, [node.public_key]).admitted, (lamport, node.peer_id)
            assert readers_of(*public, node=node) is None, (lamport, node.peer_id)
        open_claim = [entry(OWNER, 5, {READERS: [READER.peer_id]}), entry(THIEF, lamport, {})]
        for node in (OWNER, READER):
            got = readers_of(*open_claim, node=node)
            assert got == {OWNER.peer_id, READER.peer_id}, (lamport, node.peer_id, got)


def test_msd_body_and_msd_base_extractor_lists_hold() -> None:
    """The two bodies with no protection beyond their reader lists, as their writers build
    them: MSD's distilled body (`readers`: the campaign's contributors,
    atdnode.split.msd_campaign) and the msd-base extractor (`readers`: the secret's
    recipients but the publisher, atdnode.split.base)."""
    body = entry(OWNER, 3, {"part": "body", "algorithm": "msd", READERS: [READER.peer_id]})
    base = entry(OWNER, 4, {"part": "extractor", "algorithm": "msd-base", READERS: [READER.peer_id]}, seq=2)
    for own in (body, base):
        for lamport in (1, 8):
            thief = entry(THIEF, lamport, {"part": own.body["part"], "algorithm": own.body["algorithm"], READERS: []})
            for node in (OWNER, READER):
                got = readers_of(own, thief, node=node)
                assert got == {OWNER.peer_id, READER.peer_id}, (own.body["algorithm"], lamport, got)


async def _ask(d, peer: str, request: dict) -> dict:
    s = await d.transport.open_stream(peer, BLOB_PROTOCOL)
    await s.write_frame(pack(request))
    with trio.fail_after(10):
        msg = unpack(await s.read_frame())
    await s.close()
    return msg


@pytest.mark.parametrize("backdated", [False, True])
def test_member_naming_anothers_restricted_blob_in_its_own_entry_gets_nothing(tmp_path: Path, backdated: bool) -> None:
    """Later (`readers: []`, signed after the owner's entry) or backdated (an entry open to
    every member at lamport 1, below the owner's, in the thief's log before anyone starts)."""
    homes = make_consortium(tmp_path, 3)  # 0: owner, 1: its named reader, 2: the thief
    net = MemoryNetwork(seed=24)
    data = random.Random(24).randbytes(1 << 20)

    async def main() -> None:
        d = [daemon_on(net, h) for h in homes]
        h = d[0].store.put_bytes(data)
        reader = NodeIdentity.load(homes[1]).peer_id
        own = append(homes[0], "weights", weights_body(h, d[0].store.manifest(h).hash, len(data), **{READERS: [reader]}))
        stolen = None
        if backdated:
            stolen = Entry.create(NodeIdentity.load(homes[2]).signer, seq=1, prev=b"\0" * 32, lamport=1,
                                  kind="weights", body=weights_body(h, own.body["manifest"], len(data)))
            assert stolen.lamport < own.lamport
            with Ledger.open(homes[2].ledger_db) as led:
                assert not led.merge([stolen]).rejected
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d[0].run, [], [])
            for x in d[1:]:
                await nursery.start(x.run, [], [a0[0]])
            await wait_for(lambda: d[1].store.has(h), "the named reader fetches it", 60)
            if stolen is None:  # the thief names the blob in its own entry, with an empty reader list
                stolen = append(homes[2], "weights", weights_body(h, d[0].store.manifest(h).hash, len(data),
                                                                  **{READERS: []}))
            both = {stolen.id, own.id}  # a note names whichever of the two sorts second
            await wait_for(lambda: any(e.id in both for e, _ in d[0].readers._lists.notes),
                           "the owner merges the thief's entry and re-reads its reader lists", 60)
            owner = d[0].transport.peer_id
            assert await _ask(d[2], owner, {"op": "manifest", "blob": h}) == {"ok": False, "error": "not a reader"}
            got = await _ask(d[2], owner, {"op": "get", "blob": h, "chunk_size": 1 << 16, "chunks": [0, 1]})
            assert got == {"i": 0, "error": "not a reader"}
            with trio.move_on_after(5):  # the daemon's own fetch path gets nothing either
                try:
                    await d[2].fetch(h, timeout=5)
                except Exception:  # noqa: BLE001 (a refusal, a timeout: anything but the bytes)
                    pass
            assert not d[2].store.has(h)
            # the owner's reader is still served (the thief's entry narrowed nothing it named),
            # and passes the blob on to nobody outside the owner's list
            assert d[0].readers.may_read(reader, h)
            await wait_for(lambda: any(e.id in both for e, _ in d[1].readers._lists.notes),
                           "the reader merges the thief's entry", 60)
            assert not d[1].readers.may_read(d[2].transport.peer_id, h)
            for x in d:
                x.stop()

    trio.run(main)


def test_a_member_cannot_squat_anothers_open_blob_with_a_backdated_entry(tmp_path: Path) -> None:
    """The squatter (short chain) names the publisher's open blob in its own entry at lamport
    1, below the publisher's, with `readers: [itself]` and a wrong manifest hash; the
    third member merges that entry first (as after a restart) and still fetches the blob,
    from the publisher, with the manifest the publisher named."""
    homes = make_consortium(tmp_path, 3)  # 0: publisher, 1: squatter, 2: another member
    net = MemoryNetwork(seed=38)
    data = random.Random(38).randbytes(1 << 18)

    async def main() -> None:
        d = [daemon_on(net, h) for h in homes]
        h = d[0].store.put_bytes(data)
        published = append(homes[0], "weights", weights_body(h, d[0].store.manifest(h).hash, len(data)))
        squatter = NodeIdentity.load(homes[1]).signer
        squat = Entry.create(squatter, seq=1, prev=b"\0" * 32, lamport=1, kind="weights",
                             body=weights_body(h, "00" * 32, len(data), **{READERS: [squatter.peer_id]}))
        assert squat.lamport < published.lamport
        for home in homes[1:]:  # the squatter's own log, and the other member's before it starts
            with Ledger.open(home.ledger_db) as led:
                assert not led.merge([squat]).rejected
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d[0].run, [], [])
            for x in d[1:]:
                await nursery.start(x.run, [], [a0[0]])
            await wait_for(lambda: d[2].store.has(h), "the other member fetches the open blob", 60)
            assert d[0].readers.may_read(d[2].transport.peer_id, h)  # the publisher serves every member
            for x in d:
                x.stop()

    trio.run(main)
