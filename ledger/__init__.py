"""atd's signed, hash-chained, replicated ledger (pure: msgpack + cryptography + sqlite3).

No torch and no networking here; see encoding.py (bytes), entry.py (Entry), keys.py (Signer,
peer ids), membership.py (placement rules), merge.py / ledger.py (SQLite log), verify.py.
"""
from ledger.entry import KINDS, ZERO_HASH, Entry
from ledger.errors import (
    BadPeerId, BadSignature, BrokenLink, Equivocation, LedgerError, MalformedEntry, MalformedId, NotAdmin,
    QuotaExceeded, RefusedBody, RevokedAuthor, SeqGap, TamperedStore, UnknownAuthor, WrongConsortium,
)
from ledger.keys import Signer, parse_author, peer_id_from_public_key, public_key_from_peer_id, verify_signature
from ledger.ledger import Ledger
from ledger.membership import MemberStatus, Membership
from ledger.merge import MergeResult
from ledger.quota import AuthorQuota
from ledger.verify import VerifyReport

__all__ = [
    "Entry", "KINDS", "ZERO_HASH", "Ledger", "MergeResult", "Membership", "MemberStatus", "Signer",
    "VerifyReport", "parse_author", "peer_id_from_public_key", "public_key_from_peer_id", "verify_signature",
    "LedgerError", "MalformedEntry", "MalformedId", "BadSignature", "BrokenLink", "SeqGap", "Equivocation",
    "UnknownAuthor", "RevokedAuthor", "NotAdmin", "WrongConsortium", "TamperedStore", "BadPeerId",
    "QuotaExceeded", "RefusedBody", "AuthorQuota",
]
