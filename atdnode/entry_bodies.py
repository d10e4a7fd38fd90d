"""Typed fields of ledger entry bodies that several modules write and read.

Blob readers. A `weights` / `features` / `aggregate` entry names a blob (`"blob": hex`).
If its body carries a reader list, the blob protocol serves that blob only to the peers
on the list and to the entry's author, and other daemons do not try to fetch it:

    READERS = "readers"        list[str]: libp2p peer ids allowed to fetch the blob

`readers` is the field to write (e.g. MSD's distilled body for its authorised clients).
Two older spellings are read as reader lists too, so entries already in ledgers keep
their meaning: `recipients` (sealed `features`: the peers it is encrypted to) and
`authorized` (MSD bodies written before `readers` existed). A body with none of them is
readable by every member.
"""
from __future__ import annotations

READERS = "readers"
READER_ALIASES = ("recipients", "authorized")


def blob_readers(body: dict) -> frozenset[str] | None:
    """The peer ids a blob named by `body` may be served to (besides its author), or None
    for "every member". A malformed list (not a list of strings) restricts to nobody."""
    for key in (READERS, *READER_ALIASES):
        if key in body:
            value = body[key]
            if isinstance(value, list) and all(isinstance(p, str) for p in value):
                return frozenset(value)
            return frozenset()
    return None
