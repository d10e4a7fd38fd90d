"""`Ledger.heads_of` (issue 29: a few authors' heads without reading every head) agrees with
`heads()` whether the heads cache is current or the database moved under it."""
from __future__ import annotations

from pathlib import Path

from ledger import Ledger, Signer

F, A, B = (Signer.from_seed(bytes([i]) * 32) for i in (1, 2, 3))


def test_heads_of_agrees_with_heads_cached_and_after_other_writers(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    led = Ledger.open(db)
    led.create_genesis(F, "c", members=[(A.public_key, False), (B.public_key, False)])
    for i in range(3):
        led.append(A, "metrics", {"i": i})
    want = [A.public_key, B.public_key, F.public_key]
    assert led.heads_of(want) == {A.public_key: 3, F.public_key: 1}  # B wrote nothing: left out
    led.heads()  # cache current
    assert led.heads_of(want) == {k: v for k, v in led.heads().items() if k in want}
    with Ledger.open(db) as other:  # another connection (a CLI command) appends: the cache is stale
        other.append(B, "metrics", {"b": 1})
        other.append(A, "metrics", {"i": 3})
    assert led.heads_of(want) == {A.public_key: 4, B.public_key: 1, F.public_key: 1}
    assert led.heads_of(want) == led.heads()
    assert led.heads_of([]) == {} and led.heads_of([b"\0" * 32]) == {}
    led.close()
