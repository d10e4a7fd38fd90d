"""One budget per member whatever kinds it invents, and a bounded, expiring store of entries
that wait for a missing link.

- The 100-kinds flood: a member signs 500 entries of 200 KB over 100 invented kinds (each
  kind alone well within a per-kind window); merged as a node merges from the network, the
  ledger grows by no more than the configured per-member budget.
- Chain gaps: entries whose predecessor never arrives are held at most per author and in
  total (members too), and expire (a simulated clock: `expire_held(now=...)`).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import ledger.merge as merge_mod
from atdnode.bodies import refusal
from atdnode.replication import quota_from_config
from ledger import Entry, Ledger, QuotaExceeded, SeqGap, Signer

F = Signer.from_seed(b"F" * 32)
A = Signer.from_seed(b"A" * 32)
B = Signer.from_seed(b"B" * 32)


def _founded(path: Path) -> Ledger:
    led = Ledger.open(path)
    led.create_genesis(F, "d", members=[(A.public_key, False), (B.public_key, False)])
    return led


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))  # the database (and a WAL, shm)


def test_a_flood_over_100_invented_kinds_grows_no_ledger_past_the_budget(tmp_path: Path) -> None:
    budget = 8 << 20
    quota = quota_from_config({"author_bytes": budget})
    lf = _founded(tmp_path / "f.db")
    la = Ledger.open(tmp_path / "a.db", genesis_id=lf.genesis_id)
    la.merge(lf.raw_rows())
    pad = os.urandom(200_000)
    flood = [e for e in la.append_many(A, [(f"k{i % 100}", {"pad": pad, "i": i}) for i in range(500)])]
    assert all(isinstance(e, Entry) for e in flood)
    before = _size(tmp_path / "f.db")
    for i in range(0, 500, 50):  # in gossip-sized batches
        res = lf.merge([e.to_bytes() for e in flood[i:i + 50]], members_only=True, quota=quota, check=refusal)
    stored = sum(len(e.payload) + len(e.sig) for e in lf.entries_after(A.public_key, 0, include_held=True))
    lf.close()  # (the last connection checkpoints the write-ahead log into the database and removes it)
    grown = _size(tmp_path / "f.db") - before
    assert 0 < stored <= budget and grown <= budget * 1.25 + (1 << 20), (stored, grown)
    assert stored >= budget - 2 * 200_000  # the budget is what bounds it: it is filled
    assert any("budget per member" in str(err) for _, err in res.rejected if isinstance(err, QuotaExceeded))
    lf = Ledger.open(tmp_path / "f.db")
    # without an author budget each invented kind had its own window: the flood went in whole
    lf2 = _founded(tmp_path / "f2.db")
    per_kind = quota_from_config(None)
    res = lf2.merge([e.to_bytes() for e in flood[:200]], members_only=True, quota=per_kind, check=refusal)
    assert len(res.added) < 200  # the unnamed kinds share one window: 16 MiB, not 16 MiB per kind
    for led in (lf, la, lf2):
        led.close()


def test_entries_waiting_for_a_link_are_bounded_per_author_and_in_total_and_expire(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    monkeypatch.setattr(merge_mod, "MAX_WAITING_PER_AUTHOR", 5)
    monkeypatch.setattr(merge_mod, "MAX_WAITING_TOTAL", 8)
    lf = _founded(tmp_path / "f.db")

    def gapped(signer: Signer, n: int) -> list[Entry]:
        """Seqs 2..n+1 of a chain whose seq 1 never arrives."""
        prev, out = b"\1" * 32, []
        for s in range(2, n + 2):
            e = Entry.create(signer, seq=s, prev=prev, lamport=100 + s, kind="metrics", body={"s": s})
            out.append(e)
            prev = e.id
        return out

    ra = lf.merge(gapped(A, 10), members_only=True, check=refusal)
    assert len(ra.pending) == 5 and all(isinstance(err, SeqGap) for _, err in ra.rejected)  # per author
    rb = lf.merge(gapped(B, 10), members_only=True, check=refusal)
    assert len(rb.pending) == 3 and lf.stats()["held"] == 8  # in total, members included
    assert lf.expire_held(3600, now=time.time() + 60) == 0  # young: kept
    assert lf.expire_held(3600, now=time.time() + 3601) == 8  # the simulated clock passes the ttl
    assert lf.stats()["held"] == 0 and lf.stats()["log"] == 1
    rb = lf.merge(gapped(B, 10), members_only=True, check=refusal)  # room again
    assert len(rb.pending) == 5
    lf.verify()
    lf.close()
