"""Reader lists that hold (issue 24, item 2): a later entry of another author never widens a
blob's readers (atdnode.blobs.readers), on the serving side of real daemons too.

The attack of the issue: member M signs its own `weights` entry naming member A's
reader-restricted blob with `readers: []` (so M, as that entry's author, would be a
reader) and asks A for the blob. Before the fix A served all of it (readers were the
union over every entry naming the blob); now M gets 0 bytes and A's named reader still
gets the blob.
"""
from __future__ import annotations

import random
from pathlib import Path

import trio

from atdnode.bodies import READERS
from atdnode.blobs.readers import reader_lists
from atdnode.node import NodeIdentity
from atdnode.blobs import PROTOCOL as BLOB_PROTOCOL, pack
from atdnode.blobs.wire import unpack
from atdnode.transport import MemoryNetwork
from ledger import Entry, Signer
from tests.factories import append, daemon_on, make_consortium, wait_for

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


def test_member_naming_anothers_restricted_blob_in_its_own_entry_gets_nothing(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 3)  # 0: owner, 1: its named reader, 2: the thief
    net = MemoryNetwork(seed=24)
    data = random.Random(24).randbytes(1 << 20)

    async def main() -> None:
        d = [daemon_on(net, h) for h in homes]
        h = d[0].store.put_bytes(data)
        reader = NodeIdentity.load(homes[1]).peer_id
        append(homes[0], "weights", {"blob": h, "manifest": d[0].store.manifest(h).hash, "size": len(data),
                                     READERS: [reader]})
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d[0].run, [], [])
            for x in d[1:]:
                await nursery.start(x.run, [], [a0[0]])
            await wait_for(lambda: d[1].store.has(h), "the named reader fetches it", 60)
            # the thief names the blob in its own entry, with an empty reader list
            stolen = append(homes[2], "weights", {"blob": h, "manifest": d[0].store.manifest(h).hash,
                                                  "size": len(data), READERS: []})
            await wait_for(lambda: any(e.id == stolen.id for e, _ in d[0].readers._lists.notes),
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
            # the owner's reader is still served (the thief's entry narrowed nothing it named)
            assert d[0].readers.may_read(reader, h)
            for x in d:
                x.stop()

    trio.run(main)
