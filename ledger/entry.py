"""`Entry`: one signed record in an author's hash chain.

Invariants checked on construction (MalformedEntry otherwise): author is 32 bytes, seq >= 1,
prev is 32 bytes and all-zero exactly when seq == 1, 1 <= lamport < 2**62, kind matches
``[a-z][a-z0-9_-]{0,31}``, body is a canonicalisable map, and `genesis` / `member` bodies
have their exact schema (see `check_body`). `sig` is not checked on construction — call
`verify()`; `Entry.from_bytes` does so for you.

`body` is the decoded body dict; treat it as read-only: the signed payload is computed once
and is the source of truth for `id` and `to_bytes()`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ledger import encoding
from ledger.errors import LedgerError, MalformedEntry
from ledger.keys import PUBLIC_KEY_LEN, SIGNATURE_LEN, Signer, peer_id_from_public_key, verify_signature

ZERO_HASH = b"\0" * 32
MAX_COUNTER = 1 << 62
KIND_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}\Z")
KINDS = ("genesis", "member", "hello", "weights", "features", "aggregate", "metrics", "service")
ROTATE_DOMAIN = b"atd-rotate-v1\0"


def rotation_message(old: bytes, new: bytes) -> bytes:
    """What the new key signs to accept `old`'s identity: ROTATE_DOMAIN || old || new."""
    return ROTATE_DOMAIN + old + new


def rotation_proof_ok(old: bytes, body: dict) -> bool:
    """Is `body` a rotate body whose proof is the new key's signature over `rotation_message`?"""
    new, proof = body.get("member"), body.get("proof")
    if body.get("action") != "rotate" or not _is_key(new) or not isinstance(proof, bytes) or len(proof) != SIGNATURE_LEN:
        return False
    try:
        verify_signature(new, proof, rotation_message(old, new))
    except LedgerError:
        return False
    return True


def _is_key(v: Any) -> bool:
    return isinstance(v, bytes) and len(v) == PUBLIC_KEY_LEN


def check_body(kind: str, body: dict, author: bytes) -> None:
    """Schema of the bodies the ledger itself interprets; other kinds are free-form maps.

    genesis: {"consortium": str (1..64), "founder": author, "members": [[pubkey32, admin: bool], ...]}
    member:  {"action": "admit", "member": pubkey32, "admin": bool[, "name": str]}
             {"action": "revoke", "member": pubkey32, "upto": int >= 0}
             {"action": "rotate", "member": new_pubkey32, "proof": sig64}  (signed by the old key;
              `proof` is the new key's signature over ROTATE_DOMAIN || old || new, see membership.py)
             {"action": "restore", "member": old_pubkey32, "key": new_pubkey32}  (an admin settles a
              contested rotation of `member` in favour of `key`, see membership.py)
    """
    if kind == "genesis":
        if set(body) != {"consortium", "founder", "members"}:
            raise MalformedEntry("genesis body needs exactly consortium, founder, members")
        c = body["consortium"]
        if not isinstance(c, str) or not 1 <= len(c) <= 64:
            raise MalformedEntry("genesis consortium must be a 1..64 character string")
        if body["founder"] != author:
            raise MalformedEntry("genesis founder must be its author")
        members = body["members"]
        if not isinstance(members, list) or not all(
            isinstance(m, list) and len(m) == 2 and _is_key(m[0]) and isinstance(m[1], bool) for m in members
        ):
            raise MalformedEntry("genesis members must be a list of [pubkey32, admin]")
    elif kind == "member":
        action = body.get("action")
        if action == "admit":
            allowed, required = {"action", "member", "admin", "name"}, {"action", "member", "admin"}
        elif action == "revoke":
            allowed = required = {"action", "member", "upto"}
        elif action == "rotate":
            allowed = required = {"action", "member", "proof"}
        elif action == "restore":
            allowed = required = {"action", "member", "key"}
        else:
            raise MalformedEntry("member action must be 'admit', 'revoke', 'rotate' or 'restore'")
        if not required <= set(body) <= allowed:
            raise MalformedEntry(f"member {action} body needs keys {sorted(required)}")
        if not _is_key(body["member"]):
            raise MalformedEntry("member key must be 32 bytes")
        if action == "restore" and (not _is_key(body["key"]) or body["key"] == body["member"]):
            raise MalformedEntry("restore needs the contested key and one of the keys it rotated to")
        if action == "admit" and not isinstance(body["admin"], bool):
            raise MalformedEntry("member admin flag must be a bool")
        if "name" in body and (not isinstance(body["name"], str) or len(body["name"]) > 128):
            raise MalformedEntry("member name must be a string of at most 128 characters")
        if action == "revoke" and not (type(body["upto"]) is int and 0 <= body["upto"] < MAX_COUNTER):
            raise MalformedEntry("revoke upto must be a non-negative int")
        if action == "rotate" and (body["member"] == author or not rotation_proof_ok(author, body)):
            raise MalformedEntry("rotate needs a new key and that key's signature over the rotation")


def _check_fields(author: bytes, seq: int, prev: bytes, lamport: int, kind: str, body: dict) -> None:
    if not _is_key(author):
        raise MalformedEntry("author must be a 32-byte Ed25519 public key")
    if type(seq) is not int or not 1 <= seq < MAX_COUNTER:
        raise MalformedEntry(f"seq {seq!r} out of range", author=author)
    if not isinstance(prev, bytes) or len(prev) != 32:
        raise MalformedEntry("prev must be 32 bytes", author=author, seq=seq)
    if (seq == 1) != (prev == ZERO_HASH):
        raise MalformedEntry("prev must be all-zero exactly for seq 1", author=author, seq=seq)
    if type(lamport) is not int or not 1 <= lamport < MAX_COUNTER:
        raise MalformedEntry(f"lamport {lamport!r} out of range", author=author, seq=seq)
    if not isinstance(kind, str) or not KIND_RE.match(kind):
        raise MalformedEntry(f"bad kind {kind!r}", author=author, seq=seq)
    if not isinstance(body, dict):
        raise MalformedEntry("body must be a map", author=author, seq=seq)
    if kind == "genesis" and seq != 1:
        raise MalformedEntry("a genesis entry must be its author's seq 1", author=author, seq=seq)
    try:
        check_body(kind, body, author)
    except MalformedEntry as exc:
        raise MalformedEntry(exc.reason, author=author, seq=seq) from None


@dataclass(frozen=True, eq=False)
class Entry:
    """One signed ledger entry: author's Ed25519 key (32 bytes), seq (1 = first), prev (id of
    seq - 1; zeros for seq 1), lamport, kind, body (a msgpack map), sig (64 bytes); `.id` is
    the SHA-256 of its signed encoding."""

    author: bytes
    seq: int
    prev: bytes
    lamport: int
    kind: str
    body: dict
    sig: bytes = b""
    _payload: bytes = field(init=False, repr=False, default=b"")
    _id: bytes = field(init=False, repr=False, default=b"")
    _verified: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        _check_fields(self.author, self.seq, self.prev, self.lamport, self.kind, self.body)
        body = encoding.canonical(self.body)  # sorted keys, lists, exact types: what decoding gives back
        payload = encoding.pack_payload(self.author, self.seq, self.prev, self.lamport, self.kind, body)
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "_payload", payload)
        object.__setattr__(self, "_id", encoding.entry_id(payload))

    # --- construction -------------------------------------------------------------------
    @classmethod
    def create(cls, signer: Signer, *, seq: int, prev: bytes, lamport: int, kind: str, body: dict) -> "Entry":
        """A new entry by `signer`, signed over DOMAIN + canonical payload."""
        unsigned = cls(signer.public_key, seq, prev, lamport, kind, body)
        object.__setattr__(unsigned, "sig", signer.sign(encoding.signed_bytes(unsigned._payload)))
        object.__setattr__(unsigned, "_verified", True)
        return unsigned

    @classmethod
    def _trusted(cls, payload: bytes, sig: bytes, fields: tuple, entry_id: bytes | None = None) -> "Entry":
        """Build from already-validated parts without re-encoding (store reads, parsed wire)."""
        e = object.__new__(cls)
        for name, value in zip(("author", "seq", "prev", "lamport", "kind", "body"), fields):
            object.__setattr__(e, name, value)
        object.__setattr__(e, "sig", sig)
        object.__setattr__(e, "_payload", payload)
        object.__setattr__(e, "_id", entry_id if entry_id is not None else encoding.entry_id(payload))
        object.__setattr__(e, "_verified", False)
        return e

    @classmethod
    def from_parts(cls, payload: bytes, sig: bytes, *, verify: bool = True) -> "Entry":
        """Entry from payload + sig: canonical decoding and field checks, then signature (if verify)."""
        fields = encoding.decode_payload(payload, check_canonical=True)
        _check_fields(*fields)
        e = cls._trusted(payload, sig, fields)
        if verify:
            e.verify()
        return e

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Entry":
        """Parse wire bytes and verify the signature; MalformedEntry / BadSignature otherwise."""
        payload, sig = encoding.decode_wire(raw)
        return cls.from_parts(payload, sig, verify=True)

    # --- checks and views ---------------------------------------------------------------
    def verify(self) -> None:
        """Raise BadSignature unless `sig` signs this entry's canonical bytes by `author`."""
        if self._verified:
            return
        try:
            verify_signature(self.author, self.sig, encoding.signed_bytes(self._payload))
        except LedgerError as exc:
            raise type(exc)(exc.reason, author=self.author, seq=self.seq, entry_id=self._id) from None
        object.__setattr__(self, "_verified", True)

    @property
    def id(self) -> bytes:
        return self._id

    @property
    def payload(self) -> bytes:
        return self._payload

    def signed_bytes(self) -> bytes:
        return encoding.signed_bytes(self._payload)

    def to_bytes(self) -> bytes:
        """Wire form: msgpack [payload, sig]."""
        if len(self.sig) != SIGNATURE_LEN:
            raise MalformedEntry("entry is not signed", author=self.author, seq=self.seq)
        return encoding.encode_wire(self._payload, self.sig)

    def to_json(self) -> dict:
        """JSON-ready dict: hex ids and bytes, author as peer id."""
        return {
            "id": self._id.hex(),
            "author": peer_id_from_public_key(self.author),
            "seq": self.seq,
            "prev": self.prev.hex(),
            "lamport": self.lamport,
            "kind": self.kind,
            "body": _jsonable(self.body),
            "sig": self.sig.hex(),
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and self._id == other._id and self.sig == other.sig

    def __hash__(self) -> int:
        return hash(self._id)

    def __repr__(self) -> str:
        return (f"Entry({peer_id_from_public_key(self.author)[:16]}… seq={self.seq} "
                f"lamport={self.lamport} kind={self.kind} id={self._id.hex()[:16]})")


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v
