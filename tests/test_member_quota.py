"""Per-author quotas on members' own entries, enforced on merge from the network.

Ledger level: an entry over its kind's size limit, or over its author's entries / bytes per
window, is refused (QuotaExceeded, not stored, logged once per window); the node's own key
and membership entries are never held back. Daemon level (real daemons, in-memory network):
a member flooding metrics gets only its quota into a peer's ledger, by gossip and sync alike.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from atdnode.node import NodeConfig
from atdnode.errors import ConfigError
from atdnode.replication import quota_from_config
from ledger import AuthorQuota, Ledger, QuotaExceeded, Signer
from ledger.quota import KindLimit, QuotaTracker
from tests.factories import daemon_on, make_consortium, wait_for

F = Signer.from_seed(b"F" * 32)
A = Signer.from_seed(b"A" * 32)


def _pair(tmp_path: Path) -> tuple[Ledger, Ledger]:
    lf = Ledger.open(tmp_path / "f.db")
    lf.create_genesis(F, "d", members=[(A.public_key, False)])
    la = Ledger.open(tmp_path / "a.db", genesis_id=lf.genesis_id)
    la.merge(lf.raw_rows())
    return lf, la


def test_a_flood_is_refused_and_logged_own_entries_are_not(tmp_path: Path, caplog) -> None:
    lf, la = _pair(tmp_path)
    base = lf.raw_rows()  # genesis only
    big = [la.append(A, "metrics", {"pad": b"x" * (100 << 10)}) for _ in range(3)]  # 100 KB metrics: over 64 KiB
    weights = la.append(A, "weights", {"blob": "00" * 32, "pad": b"x" * (100 << 10)})  # generous for weights
    quota = AuthorQuota()
    with caplog.at_level(logging.WARNING, logger="ledger.quota"):
        res = lf.merge([e.to_bytes() for e in big + [weights]], members_only=True, quota=quota)
    assert res.added == [] and lf.head_of(A.public_key) == 0  # nothing stored: the chain waits behind seq 1
    assert isinstance(dict(res.rejected)[big[0].id], QuotaExceeded)
    assert sum("quota" in r.message for r in caplog.records) == 1  # logged, once per window
    assert "over this node's limit" in str(dict(res.rejected)[big[0].id])
    assert quota.too_big(big[0]) and not quota.too_big(weights)  # what a daemon's gossip validator relays

    # rate: at most 5 metrics entries per window
    lf2 = Ledger.open(tmp_path / "f2.db", genesis_id=lf.genesis_id)
    lf2.merge(base)
    la2 = Ledger.open(tmp_path / "a2.db", genesis_id=lf.genesis_id)
    la2.merge(base)
    small = [la2.append(A, "metrics", {"k": k}) for k in range(20)]
    tight = AuthorQuota({**quota.limits, "metrics": KindLimit(1 << 10, 5, 1 << 20)}, window_s=3600)
    res = lf2.merge([e.to_bytes() for e in small], members_only=True, quota=tight)
    assert res.added == [e.id for e in small[:5]]
    assert all(isinstance(err, QuotaExceeded) for _, err in res.rejected) and len(res.rejected) == 15
    res = lf2.merge([e.to_bytes() for e in small], members_only=True, quota=tight)  # sync offers them again
    assert res.added == [] and lf2.head_of(A.public_key) == 5
    lf2.append(F, "metrics", {"k": "founder"})  # own appends are not merges: never limited
    lf2.verify()

    # the same flood, as this node's own entries coming back (a restored home): all of it
    la3 = Ledger.open(tmp_path / "a3.db", genesis_id=lf.genesis_id)
    la3.merge(base)
    res = la3.merge([e.to_bytes() for e in small], members_only=True, quota=tight, exempt=[A.public_key])
    assert len(res.added) == 20 and not res.rejected
    for led in (lf, la, lf2, la2, la3):
        led.close()


def test_the_window_slides(monkeypatch) -> None:
    from ledger import Entry

    q = AuthorQuota({"*": KindLimit(1 << 10, 2, 1 << 20)}, window_s=10.0)
    t = QuotaTracker()
    es = [Entry.create(A, seq=s, prev=b"\1" * 32 if s > 1 else b"\0" * 32, lamport=s, kind="metrics",
                       body={"k": s}) for s in (1, 2, 3)]
    for now, e in ((0.0, es[0]), (5.0, es[1])):
        assert t.check(q, e, now=now) is None
        t.record(e, now=now)
    assert isinstance(t.check(q, es[2], now=9.0), QuotaExceeded)
    assert t.check(q, es[2], now=10.5) is None  # the first left the window
    monkeypatch.setattr("ledger.quota.SWEEP_EVERY", 1)  # an author gone quiet leaves nothing behind
    t.record(Entry.create(F, seq=1, prev=b"\0" * 32, lamport=1, kind="hello", body={}), now=100.0, window_s=10.0)
    assert set(t._seen) == {(F.public_key, "*"), (F.public_key, "")}  # its unnamed kinds' window, its budget


def test_quota_config_table() -> None:
    q = quota_from_config({"window_s": 30, "metrics": {"window_entries": 7}})
    assert q.window_s == 30 and q.limit("metrics").window_entries == 7
    assert q.limit("metrics").max_entry_bytes == AuthorQuota().limit("metrics").max_entry_bytes
    assert quota_from_config(None) == AuthorQuota()
    for bad in ({"window_s": -1}, {"metrics": {"window_entries": 0}}, {"metrics": {"rate": 1}}, {"x": 3}):
        with pytest.raises(ConfigError, match="quota"):
            quota_from_config(bad)


def test_a_daemon_keeps_a_flooding_member_to_its_quota(tmp_path: Path) -> None:
    """Node 1 signs 30 metrics entries at once; node 0, configured for 6 per window, stores 6
    of them -- by gossip and by its periodic sync pulls alike -- and counts the refusals."""
    from atdnode.transport import MemoryNetwork

    homes = make_consortium(tmp_path, 2)
    cfg = NodeConfig.load(homes[0])
    cfg.extra["quota"] = {"window_s": 3600, "metrics": {"window_entries": 6}}
    cfg.save(homes[0])
    net = MemoryNetwork(seed=24)

    async def main() -> None:
        d0, d1 = daemon_on(net, homes[0]), daemon_on(net, homes[1])
        async with trio.open_nursery() as nursery:
            a0 = await nursery.start(d0.run, [], [])
            await nursery.start(d1.run, [], [a0[0]])
            flood = [await d1.append("metrics", {"k": k}) for k in range(30)]
            tracker = d0.ledger.ledger.quota_tracker
            await wait_for(lambda: tracker.refused >= 24, "node 0 to refuse the flood beyond its quota")
            pulls = d0.stats["sync_pulls"]
            await wait_for(lambda: d0.stats["sync_pulls"] >= pulls + 2, "two more sync pulls")  # they retry: still 6
            stored = await d0.ledger.run(lambda led: [e.id for e in led.query(kind="metrics", author=flood[0].author)])
            assert stored == [e.id for e in flood[:6]]
            d0.stop()
            d1.stop()

    trio.run(main)
