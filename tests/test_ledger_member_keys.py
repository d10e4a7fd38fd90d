"""`Ledger.member_keys` (the daemon's membership re-read, cached) sees every
admission and revocation at once -- its own writes, a merge, another connection's write --
and hands out the same set object while membership is unchanged."""
from __future__ import annotations

from pathlib import Path

from ledger import Ledger, Signer

F, A, B, C = (Signer.from_seed(bytes([i]) * 32) for i in (1, 2, 3, 4))


def active(led: Ledger) -> set[bytes]:
    m = led.membership()
    return {k for k in m.members if m.is_member(k)}


def test_member_keys_follow_admissions_and_revocations_at_once(tmp_path: Path) -> None:
    led = Ledger.open(tmp_path / "l.db")
    led.create_genesis(F, "c", members=[(A.public_key, False)])
    first = led.member_keys()
    assert first == active(led) == {F.public_key, A.public_key}
    led.append(A, "metrics", {})  # a write that changes no membership: the same object
    assert led.member_keys() is first
    led.admit(F, B.public_key)  # own write
    assert led.member_keys() == active(led) == {F.public_key, A.public_key, B.public_key}
    led.revoke(F, A.public_key)
    assert A.public_key not in led.member_keys() and led.member_keys() == active(led)
    other_side = Ledger.open(tmp_path / "o.db")
    other_side.merge(led.raw_rows())
    assert other_side.member_keys() == led.member_keys()
    led.admit(F, C.public_key)
    other_side.merge(led.raw_rows())  # a merge brings the admission
    assert C.public_key in other_side.member_keys()
    other_side.close()
    with Ledger.open(led.path) as cli:  # another connection (a CLI command) revokes B
        cli.revoke(F, B.public_key)
    assert B.public_key not in led.member_keys() and led.member_keys() == active(led)
    led.close()
