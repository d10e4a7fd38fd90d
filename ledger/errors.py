"""Typed ledger errors. Verification raises one of these; it never returns a silent False.

Every error may name the entry it is about (`author`, `seq`, `entry_id`); the message then
ends with ``entry <peer id> seq <n> id <hex>`` so a one-line CLI report identifies it.
"""
from __future__ import annotations

from ledger.peerid import describe_author


class LedgerError(Exception):
    """Base of every ledger error. `str(err)` is one human-readable line."""

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        author: bytes | None = None,
        seq: int | None = None,
        entry_id: bytes | None = None,
    ) -> None:
        self.reason = message
        self.author = author
        self.seq = seq
        self.entry_id = entry_id
        super().__init__(self._render())

    def _render(self) -> str:
        parts: list[str] = []
        if self.author is not None:
            parts.append(describe_author(self.author))
        if self.seq is not None:
            parts.append(f"seq {self.seq}")
        if self.entry_id is not None:
            parts.append(f"id {self.entry_id.hex()}")
        if not parts:
            return self.reason
        if self.seq is None and self.entry_id is None:
            return f"{self.reason} (key {parts[0]})"
        return f"{self.reason}: entry {' '.join(parts)}"


class MalformedEntry(LedgerError):
    """Bytes that do not decode to a well-formed, canonically encoded entry."""


class MalformedId(LedgerError, ValueError):
    """A str given as an entry id that is not hex (a ValueError, as `bytes.fromhex`'s)."""


class BadSignature(LedgerError):
    """The Ed25519 signature does not verify for the entry's author and signed bytes."""


class BrokenLink(LedgerError):
    """`prev` does not name the author's previous entry, or the lamport clock does not increase."""


class SeqGap(LedgerError):
    """An author's chain skips a sequence number (the predecessor is missing)."""


class Equivocation(LedgerError):
    """Two different entries signed by one author for the same seq (or a forked chain)."""


class UnknownAuthor(LedgerError):
    """The author is not an admitted member of the consortium."""


class RevokedAuthor(LedgerError):
    """The author's membership was revoked and the entry lies beyond the revocation point."""


class QuotaExceeded(LedgerError):
    """An entry from the network over its author's size or rate quota (ledger/quota.py); not stored."""


class RefusedBody(LedgerError):
    """An entry from the network whose body does not fit the spec of its kind (the merge's
    `check` callback, e.g. atdnode.bodies); not stored."""


class NotAdmin(LedgerError):
    """A membership change by a key that lacks the rights for it."""


class WrongConsortium(LedgerError):
    """A genesis entry (or pinned genesis id) of a different consortium."""


class TamperedStore(LedgerError):
    """The SQLite store is inconsistent with the entries it holds (edited, deleted, reordered)."""


class BadPeerId(LedgerError, ValueError):
    """A string that is not an Ed25519 libp2p peer id (``12D3KooW...``)."""
