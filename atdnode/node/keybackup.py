"""Key backup (`atd key export --encrypted` / `atd key import`) and key rotation (`atd key rotate`).

Backup file (JSON, mode 0600)::

    {"format": "atd-key-backup", "version": 1, "peer_id": "12D3KooW...",
     "kdf": {"name": "scrypt", "n": 131072, "r": 8, "p": 1, "salt": b64(16 bytes)},
     "cipher": "chacha20-poly1305", "nonce": b64(12 bytes), "ciphertext": b64(...)}

The key is scrypt(passphrase, salt, n, r, p) -> 32 bytes; the plaintext is msgpack
``{"ed25519": seed32, "x25519": raw32}`` sealed with ChaCha20-Poly1305, and the associated
data is the canonical JSON of every other field, so editing the header (peer id, KDF cost)
breaks decryption. A wrong passphrase and a damaged file are the same one-line error.

Rotation (see ledger/membership.py for the rules): the node's current key signs a
`member` rotate entry carrying the new key's proof; the new seed is written to
``node.key.next`` *before* the entry is appended and renamed over ``node.key`` after, so
a crash in between is finished by running `atd key rotate` again (it never creates a
second new key). The X25519 key is kept: features sealed to this node stay readable.
The libp2p peer id changes with the key: peers learn the new one from the rotate entry
and from the new `hello` the daemon signs when it restarts with the new key.
"""
from __future__ import annotations

import base64
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from atdnode.errors import ConfigError
from atdnode.node.home import NodeHome
from atdnode.node.identity import NodeIdentity, _read_secret, _write_secret
from ledger import Entry, Ledger, Signer, peer_id_from_public_key

FORMAT = "atd-key-backup"
VERSION = 1
SCRYPT = {"n": 1 << 17, "r": 8, "p": 1}  # ~128 MiB, ~0.3 s: OWASP's scrypt minimum; also the cap on import
MIN_SCRYPT_N = 1 << 14
MIN_PASSPHRASE = 8


class KeyBackupError(ConfigError):
    """A backup cannot be written or read (wrong passphrase, damaged file, key already present)."""


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s: object, what: str) -> bytes:
    try:
        return base64.b64decode(str(s), validate=True)
    except ValueError:
        raise KeyBackupError(f"key backup: {what} is not base64") from None


def _aad(header: dict) -> bytes:
    return json.dumps({k: v for k, v in header.items() if k != "ciphertext"}, sort_keys=True,
                      separators=(",", ":")).encode()


def _derive(passphrase: bytes, kdf: dict) -> bytes:
    try:
        n, r, p = int(kdf["n"]), int(kdf["r"]), int(kdf["p"])
        salt = _unb64(kdf["salt"], "salt")
    except (KeyError, TypeError, ValueError):
        raise KeyBackupError("key backup: malformed kdf parameters") from None
    if kdf.get("name") != "scrypt":
        raise KeyBackupError("key backup: unsupported kdf (atd writes scrypt)")
    if n & (n - 1):
        raise KeyBackupError(f"key backup: scrypt parameter n={n} is not a power of two (atd writes {SCRYPT['n']})")
    if not (MIN_SCRYPT_N <= n <= SCRYPT["n"] and 1 <= r <= SCRYPT["r"] and p == SCRYPT["p"]):
        # a crafted header must not cost gigabytes and seconds before "wrong passphrase"
        raise KeyBackupError(f"key backup: scrypt parameters n={n}, r={r}, p={p} are beyond what atd writes "
                             f"(n {MIN_SCRYPT_N}..{SCRYPT['n']}, r <= {SCRYPT['r']}, p = {SCRYPT['p']}); refused "
                             f"unread (they would need {128 * n * r * p >> 20} MiB)")
    return Scrypt(salt=salt, length=32, n=n, r=r, p=p).derive(passphrase)


def export_keys(home: NodeHome, out: Path, passphrase: bytes, *, kdf_cost: dict | None = None) -> str:
    """Write `home`'s keys, encrypted under `passphrase`, to a new file `out`; returns the peer id."""
    if len(passphrase) < MIN_PASSPHRASE:
        raise KeyBackupError(f"the passphrase must have at least {MIN_PASSPHRASE} characters")
    ident = NodeIdentity.load(home)
    header = {"format": FORMAT, "version": VERSION, "peer_id": ident.peer_id,
              "kdf": {"name": "scrypt", **(kdf_cost or SCRYPT), "salt": _b64(secrets.token_bytes(16))},
              "cipher": "chacha20-poly1305", "nonce": _b64(secrets.token_bytes(12))}
    key = _derive(passphrase, header["kdf"])
    plain = msgpack.packb({"ed25519": ident.signer.seed, "x25519": ident.x25519_private.private_bytes_raw()},
                          use_bin_type=True)
    header["ciphertext"] = _b64(ChaCha20Poly1305(key).encrypt(_unb64(header["nonce"], "nonce"), plain, _aad(header)))
    try:
        _write_secret(Path(out), json.dumps(header, indent=1).encode())
    except ConfigError:
        raise KeyBackupError(f"{out} already exists; refusing to overwrite it") from None
    return ident.peer_id


def read_backup(path: Path, passphrase: bytes) -> tuple[Signer, X25519PrivateKey]:
    """Decrypt a backup; KeyBackupError for a wrong passphrase or a damaged / foreign file."""
    try:
        header = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise KeyBackupError(f"{path}: not a readable key backup ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        raise KeyBackupError(f"{path}: not an atd key backup (version {VERSION})")
    key = _derive(passphrase, header.get("kdf") or {})
    try:
        plain = ChaCha20Poly1305(key).decrypt(_unb64(header.get("nonce"), "nonce"),
                                             _unb64(header.get("ciphertext"), "ciphertext"), _aad(header))
    except (InvalidTag, ValueError):
        raise KeyBackupError(f"{path}: wrong passphrase, or the backup was altered") from None
    keys = msgpack.unpackb(plain, raw=False)
    signer = Signer.from_seed(bytes(keys["ed25519"]))
    if signer.peer_id != header.get("peer_id"):
        raise KeyBackupError(f"{path}: the key inside is not {header.get('peer_id')}")
    return signer, X25519PrivateKey.from_private_bytes(bytes(keys["x25519"]))


def import_keys(home: NodeHome, path: Path, passphrase: bytes) -> str:
    """Restore a backup's keys into `home` (created if needed); returns the peer id.

    Refuses to replace a different key that is already there. A home that holds only keys
    can then be initialised around them with `atd init --join GENESIS`.
    """
    signer, x = read_backup(path, passphrase)
    home.make_dirs()
    existing = [p for p in (home.key_file, home.x25519_key_file) if p.exists()]
    if existing:
        have = NodeIdentity.load(home)
        if have.signer.seed == signer.seed and have.x25519_private.private_bytes_raw() == x.private_bytes_raw():
            return signer.peer_id  # already restored: nothing to do
        raise KeyBackupError(f"{home.root} already holds another node key ({have.peer_id}); refusing to replace it")
    _write_secret(home.x25519_key_file, x.private_bytes_raw())
    _write_secret(home.key_file, signer.seed)
    return signer.peer_id


@dataclass
class Rotation:
    old: str
    new: str
    entry: Entry


def _next_key_file(home: NodeHome) -> Path:
    return home.root / "node.key.next"


def rotate_key(home: NodeHome) -> Rotation:
    """Move this node's identity to a fresh Ed25519 key (see module docstring)."""
    ident = NodeIdentity.load(home.require())
    pending = _next_key_file(home)
    if pending.exists():
        new = Signer.from_seed(_read_secret(pending))  # an interrupted rotation: finish it
    else:
        new = Signer.generate()
        _write_secret(pending, new.seed)
    with Ledger.open(home.ledger_db) as led:
        m = led.membership()
        if m.rotations.get(ident.public_key) == new.public_key:
            entry = next(e for e in reversed(led.query(kind="member", author=ident.public_key))
                         if e.body.get("action") == "rotate")
        else:
            try:
                entry = led.rotate(ident.signer, new)
            except BaseException:
                pending.unlink(missing_ok=True)  # nothing was signed: the new key is not needed
                raise
    os.replace(pending, home.key_file)
    dirfd = os.open(home.root, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)
    return Rotation(old=ident.peer_id, new=peer_id_from_public_key(new.public_key), entry=entry)
