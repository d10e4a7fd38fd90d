"""Who may fetch a blob: reader lists that hold, and availability nobody can squat.

A `weights` / `features` / `aggregate` entry names a blob and may restrict it to a reader
list (`atdnode.bodies.blob_readers`): the peers on the list and the entry's author. Several
entries, by several authors, can name the same blob. The union over all of them would let
any member read any restricted blob by naming it in an entry of its own with
`readers: []`; a "first publisher by (lamport, author, seq)" rule would let a member close
anyone's open blob by naming it first with `readers: [itself]` (a lamport clock only has to
increase along its author's own chain, so a member with a short chain signs an entry that
sorts before anyone's). So no order between entries of different authors decides anything.
A reader list is a claim that binds its own author only:

1. A blob is restricted when any entry naming it carries a reader list. An author's
   *claim* is the union, over its own entries naming the blob, of (author + readers).
2. A node serves a restricted blob only per the claims that gave it the blob:
   - the blob's owner, i.e. a node that authored an entry naming it, serves it per its own
     claim alone (an entry of another author never widens, nor narrows, its list; its
     own entries left open: it serves every member);
   - any other holder serves it per the intersection of the claims that admit it (it
     fetched the blob as their reader); if none admits it, it holds the blob through an
     entry open to every member and serves it to every member (nothing more leaks than it
     already got), or else (copied by other means) per the intersection of every claim.
   So an entry of another author never widens a blob's reader list, whatever the order
   of the entries.
3. A node fetches a restricted blob when some claim admits it, or when some entry naming
   it is open to every member: a member's own list never stops the others from fetching a
   blob another member published openly (they fetch it from that member, who serves every
   member), and an open entry naming someone else's restricted blob costs a refused
   fetch, never a read (its holders serve per rule 2).

For the logs, every entry of another author than the first (in log order) naming a blob is
reported once, naming both authors; that order decides nothing.

Costs: a reader on both the owner's list and an intruder's narrows what it passes on to
the intersection (the owner and the other readers still serve the owner's list); a blob
the node copied by other means is served per the intersection of every claim. Key
rotation: readers keep access under the ids their keys rotated to (`with_current_ids`).

`BlobReaders` holds the result for a daemon: the blob server asks `may_read(peer, blob)`
on every request (`atdnode.blobs.xfer`), the fetch loop asks `for_me(blob)`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from collections.abc import Iterable

from atdnode.bodies import blob_readers
from atdnode.repeats import warn_once
from ledger import Entry, Ledger
from ledger.keys import peer_id_from_public_key, public_key_from_peer_id

log = logging.getLogger("atdnode.blobs.readers")

BLOB_KINDS = ("aggregate", "weights", "features")


def with_current_ids(m, peers: frozenset[str]) -> frozenset[str]:
    """`peers` plus the peer ids their keys rotated to (a reader keeps access after rotating).
    `m`: the ledger's `Membership`."""
    out = set(peers)
    for p in peers:
        try:
            out.add(peer_id_from_public_key(m.current(public_key_from_peer_id(p))))
        except ValueError:
            pass
    return frozenset(out)


@dataclass(frozen=True)
class ReaderLists:
    """The rule applied for one node: `serve` (restricted blob -> peers it serves it to),
    `admitted` (restricted blobs some claim lets it fetch), `restricted` (blobs some entry
    restricts), `notes` ([(entry, why)]: entries
    of another author than the first one naming the blob, in log order)."""

    serve: dict[str, frozenset[str]]
    admitted: frozenset[str]
    restricted: frozenset[str]
    notes: list[tuple[Entry, str]]


def reader_lists(entries: Iterable[Entry], me: Iterable[bytes] = (), membership=None) -> ReaderLists:
    """Apply the module's rule to `entries` (those naming blobs) for the node whose keys are
    `me` (its current and earlier public keys). `membership` (optional) maps readers to the
    ids their keys rotated to."""
    mine_keys = set(me)
    mine = {peer_id_from_public_key(k) for k in mine_keys}
    named: dict[str, list[Entry]] = {}
    for e in entries:
        blob = e.body.get("blob")
        if isinstance(blob, str):
            named.setdefault(blob, []).append(e)
    serve: dict[str, frozenset[str]] = {}
    admitted: set[str] = set()
    restricted: set[str] = set()
    notes: list[tuple[Entry, str]] = []
    for blob, es in named.items():
        es.sort(key=lambda e: (e.lamport, e.author, e.seq))
        claims: dict[bytes, frozenset[str]] = {}  # author -> union of its restricted claims
        for e in es:
            allowed = blob_readers(e.body)
            if allowed is not None:
                claims[e.author] = claims.get(e.author, frozenset()) | allowed | {peer_id_from_public_key(e.author)}
        first = es[0].author
        for e in es:
            if e.author != first:
                notes.append((e, f"entry {e.id.hex()[:16]} by {peer_id_from_public_key(e.author)} names blob "
                                 f"{blob[:12]} also named by {peer_id_from_public_key(first)}: its reader list "
                                 "binds its own author only"))
        if not claims:
            continue
        if membership is not None:
            claims = {a: with_current_ids(membership, c) for a, c in claims.items()}
        own = [c for a, c in claims.items() if a in mine_keys]
        authored = any(e.author in mine_keys for e in es)
        restricted.add(blob)
        if authored:  # we own it: our own claim alone (open if our entries leave it open)
            if own:
                serve[blob] = frozenset().union(*own)
            admitted.add(blob)
            continue
        admitting = [c for c in claims.values() if c & mine]
        open_entry = any(blob_readers(e.body) is None for e in es)
        if admitting:  # we hold it as their reader
            serve[blob] = frozenset.intersection(*admitting)
        elif not open_entry:  # copied by other means: the narrowest reading
            serve[blob] = frozenset.intersection(*claims.values())
        # else: we hold it through an entry open to every member (serving it on leaks nothing more)
        if admitting or open_entry:  # a list admits us, or some author left it open (rule 3)
            admitted.add(blob)
    return ReaderLists(serve, frozenset(admitted), frozenset(restricted), notes)


class BlobReaders:
    """A daemon's view of the reader lists (refreshed from its ledger after blob entries merge)."""

    def __init__(self, me: bytes) -> None:
        self.me = me  # the node's public key
        self._lists = ReaderLists({}, frozenset(), frozenset(), [])
        self._reported: set[bytes] = set()

    def refresh(self, led: Ledger, entries: list[Entry] | None = None) -> None:
        """Recompute from the ledger (call in the ledger thread; `entries`: its entries of
        BLOB_KINDS, when the caller already read them); the first non-owner entry is one
        WARNING, later ones are counted (`atdnode.repeats.warn_once`)."""
        if entries is None:
            entries = [e for kind in BLOB_KINDS for e in led.query(kind=kind)]
        if not any(isinstance(e.body.get("blob"), str) for e in entries):  # no reader list to compute: no
            self._lists = reader_lists(())  # membership read either (O(members), at every daemon start)
            return
        m = led.membership()
        lists = reader_lists(entries, m.keys_of(self.me), m)
        self._lists = lists
        for e, why in lists.notes:
            if e.id not in self._reported:
                self._reported.add(e.id)
                warn_once(log, "entries naming another member's blob (they cannot widen who may read it)", why)

    def may_read(self, peer: str, blob: str) -> bool:
        """May member `peer` fetch `blob` from us? Yes unless the blob is restricted without `peer`."""
        allowed = self._lists.serve.get(blob)
        return allowed is None or peer in allowed

    def for_me(self, blob: str) -> bool:
        """Should we fetch `blob`: open to every member, or some reader list admits us?"""
        return blob not in self._lists.restricted or blob in self._lists.admitted

