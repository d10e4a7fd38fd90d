"""The peer-selection policy (atdnode.peers.peerset) without a network: which members a daemon
dials, which peers it prunes, how config.toml's [peers] is read, how GossipSub's mesh
degrees follow the bounds."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from atdnode.errors import ConfigError
from atdnode.peers import PeerSet, PeerSetConfig, gossip_degrees, plan_sync
from atdnode.peers.peerset import (SAMPLE_ALL, plan_dials, plan_prunes, plan_rotation, rotation_interval,
                                   sample_candidates)

PEERS = [f"p{i:02d}" for i in range(20)]


def test_no_dials_at_or_above_target_and_never_a_connected_peer() -> None:
    cfg = PeerSetConfig(target=3, max=5)
    rng = random.Random(1)
    assert plan_dials(PEERS, PEERS[:3], {}, cfg, rng) == []
    assert plan_dials(PEERS, PEERS[:7], {}, cfg, rng) == []
    picks = plan_dials(PEERS, PEERS[:1], {}, cfg, rng)
    assert len(picks) == 2 and not set(picks) & {PEERS[0]} and len(set(picks)) == 2
    assert plan_dials(PEERS[:2], PEERS[:2], {}, cfg, rng) == []  # nobody left to dial
    assert sorted(plan_dials(PEERS[:2], [], {}, cfg, rng)) == PEERS[:2]  # fewer candidates than needed


def test_dials_mix_lowest_latency_and_random_members() -> None:
    cfg = PeerSetConfig(target=8, max=16, low_latency_share=0.5)
    rtt = {p: 0.001 * (i + 1) for i, p in enumerate(PEERS)}  # p00 fastest
    chosen = [plan_dials(PEERS, [], rtt, cfg, random.Random(seed)) for seed in range(30)]
    for picks in chosen:
        assert picks[:4] == PEERS[:4]  # the 4 lowest RTTs, every time
        assert len(picks) == 8 and len(set(picks)) == 8
    randoms = {p for picks in chosen for p in picks[4:]}
    assert len(randoms) >= 10  # the other half varies with the draw (not simply the next-fastest)
    assert not randoms & set(PEERS[:4])
    # deterministic for one rng state, whatever the candidates' order
    assert plan_dials(PEERS, [], rtt, cfg, random.Random(7)) == plan_dials(PEERS[::-1], [], rtt, cfg, random.Random(7))


def test_all_random_without_measurements() -> None:
    cfg = PeerSetConfig(target=4, max=8)
    seen = {p for s in range(40) for p in plan_dials(PEERS, [], {}, cfg, random.Random(s))}
    assert len(seen) >= 15


def test_prunes_only_above_max_and_never_below_target() -> None:
    cfg = PeerSetConfig(target=3, max=5, grace_s=0.0)
    assert plan_prunes(PEERS[:5], {}, {}, cfg, now=100.0) == []
    out = plan_prunes(PEERS[:9], {}, {}, cfg, now=100.0)
    assert len(out) == 4 and set(out) <= set(PEERS[:9])
    # max == target: pruning stops exactly at target
    tight = PeerSetConfig(target=4, max=4, grace_s=0.0)
    assert len(plan_prunes(PEERS[:10], {}, {}, tight, now=0.0)) == 6


def test_prunes_the_least_useful_keeps_the_fastest_and_the_young() -> None:
    cfg = PeerSetConfig(target=4, max=5, grace_s=10.0, low_latency_share=0.5)
    conn = PEERS[:8]
    rtt = {p: 0.010 * (i + 1) for i, p in enumerate(conn[:6])}  # p06, p07 unmeasured
    since = {p: 0.0 for p in conn}
    since["p07"] = 95.0  # connected 5 s ago: inside the grace period
    out = plan_prunes(conn, rtt, since, cfg, now=100.0)
    assert len(out) == 3
    assert "p07" not in out  # young
    assert not {"p00", "p01"} & set(out)  # the fastest two (share 0.5 of target 4)
    assert out == ["p06", "p05", "p04"]  # unmeasured first, then the highest RTTs
    # among equals the newest connection goes first (an established topology stays put)
    same = {p: 0.01 for p in conn}
    ages = {p: float(i) for i, p in enumerate(conn)}
    assert plan_prunes(conn, same, ages, PeerSetConfig(target=2, max=5, grace_s=0.0, low_latency_share=0.0),
                       now=100.0) == ["p07", "p06", "p05"]
    # everyone young: nothing pruned yet (the set may sit above max for grace_s)
    assert plan_prunes(conn, {}, {p: 99.0 for p in conn}, cfg, now=100.0) == []
    assert "p06" not in plan_prunes(conn, rtt, since, cfg, now=100.0, keep={"p06"})


def test_rotation_dials_a_random_member_not_connected() -> None:
    picks = {plan_rotation(PEERS, PEERS[:10], random.Random(s)) for s in range(60)}
    assert picks <= set(PEERS[10:]) and len(picks) >= 6
    assert plan_rotation(PEERS[:3], PEERS, random.Random(0)) is None


def test_rotation_re_probes_failing_members_every_other_time() -> None:
    """Members whose dials failed (a partition, say) take about half of the rotations, so a
    healed cut is crossed at once; the other half still re-mix at random. Failing members
    already connected or not candidates are never picked as such."""
    failing = {PEERS[12], PEERS[13], PEERS[0]}  # PEERS[0] is connected: not a pick
    picks = [plan_rotation(PEERS, PEERS[:10], random.Random(s), failing) for s in range(400)]
    share = sum(p in failing for p in picks) / len(picks)
    assert 0.45 < share < 0.65  # 1/2 by the coin, plus their share of the random half (2 of 20)
    assert PEERS[0] not in picks and {p for p in picks if p not in failing} >= set(PEERS[14:20])
    assert plan_rotation(PEERS[:12], PEERS[:10], random.Random(1), {PEERS[15]}) in PEERS[10:12]


def test_rotation_slows_down_only_while_nothing_suggests_it_helps() -> None:
    cfg = PeerSetConfig(rotate_s=60.0, rotate_idle_s=600.0)
    quiet = dict(failing=False, learned=False, members_changed=False)
    steps, last = [], 60.0
    for _ in range(6):
        last = rotation_interval(cfg, last, **quiet)
        steps.append(last)
    assert steps == [120.0, 240.0, 480.0, 600.0, 600.0, 600.0]  # quiet: spaced out step by step
    for reason in quiet:
        assert rotation_interval(cfg, 600.0, **{**quiet, reason: True}) == 60.0  # back to rotate_s at once
    assert rotation_interval(PeerSetConfig(rotate_s=60.0, rotate_idle_s=10.0), 60.0, **quiet) == 60.0  # never faster


def test_peerset_tracks_rtt_and_connection_ages() -> None:
    ps = PeerSet(PeerSetConfig())
    ps.observe_rtt("a", 0.100)
    ps.observe_rtt("a", 0.010)
    assert 0.010 < ps.rtt["a"] < 0.100  # smoothed, not replaced
    ps.observe_connected(["a", "b"], 1.0)
    ps.observe_connected(["a", "b", "c"], 2.0)
    assert ps.since == {"a": 1.0, "b": 1.0, "c": 2.0}
    ps.observe_connected(["c"], 3.0)
    assert ps.since == {"c": 2.0} and "a" in ps.rtt  # RTTs outlive the connection (for re-dials)


def test_gossip_degrees_follow_the_bounds() -> None:
    assert gossip_degrees(PeerSetConfig()) == (3, 2, 6)  # defaults 8/16: a thin mesh (CPU per message)
    assert gossip_degrees(PeerSetConfig(target=3, max=5)) == (3, 2, 5)
    assert gossip_degrees(PeerSetConfig(target=1, max=1)) == (1, 1, 1)
    # a small consortium (every other member fits in the peer set): a thin mesh
    assert gossip_degrees(PeerSetConfig(), members=5) == (2, 1, 2)
    assert gossip_degrees(PeerSetConfig(), members=9) == (2, 1, 2)
    assert gossip_degrees(PeerSetConfig(), members=10) == (3, 2, 6)
    assert gossip_degrees(PeerSetConfig(target=1, max=1), members=2) == (1, 1, 1)
    for t in range(1, 20):
        for m in (t, t + 1, 2 * t, 40):
            for members in (None, 2, t + 1, t + 2, 100):
                d, lo, hi = gossip_degrees(PeerSetConfig(target=t, max=m), members)
                assert 1 <= lo <= d <= hi <= m and d <= t


def test_config_table() -> None:
    assert PeerSetConfig.from_table(None) == PeerSetConfig(target=8, max=16)
    assert PeerSetConfig.from_table({"target": 3, "max": 5}) == PeerSetConfig(target=3, max=5)
    assert PeerSetConfig.from_table({"target": 12}).max == 24  # max defaults to 2 x target (at least 16)
    for bad, word in [({"target": 0}, "target"), ({"target": 4, "max": 3}, "max"), ({"target": "8"}, "target"),
                      ({"low_latency_share": 1.5}, "low_latency_share"), ({"grace_s": -1}, "grace_s"),
                      ({"rotate_s": "1m"}, "rotate_s"), ({"rotate_idle_s": -5}, "rotate_idle_s"),
                      ({"targte": 3}, "targte"), ([1], "[peers]")]:
        with pytest.raises(ConfigError, match=word.replace("[", r"\[").replace("]", r"\]")):
            PeerSetConfig.from_table(bad)


def test_periodic_sync_pulls_a_few_peers_in_turn_covering_all() -> None:
    rng = random.Random(3)
    due: list[str] = []
    peers = PEERS[:7]
    rounds = [plan_sync(due, peers, 2, rng) for _ in range(4)]  # ceil(7 / 2) intervals cover everyone
    assert all(len(r) == 2 and len(set(r)) == 2 for r in rounds)
    assert set().union(*rounds) == set(peers)
    assert sum(len(r) for r in rounds[:3]) == 6 and len(set().union(*rounds[:3])) == 6  # no repeat within a round
    # a peer that left is skipped, never returned; fewer peers than the fanout: all of them
    due[:] = ["gone", PEERS[0]]
    assert plan_sync(due, [PEERS[0]], 2, rng) == [PEERS[0]]
    assert plan_sync([], [], 2, rng) == []
    assert sorted(plan_sync([], PEERS[:1], 3, rng)) == PEERS[:1]


def test_candidates_of_a_large_consortium_come_from_a_uniform_sample() -> None:
    """Up to SAMPLE_ALL members: every acceptable one (as before). Above: a sample, whose
    draws still cover every acceptable member about uniformly, that always holds the
    acceptable `extra` peers, and that falls back to the full pass when acceptable members
    are rare (no pass over 1,000 members per dial round)."""
    small = [f"p{i:02d}" for i in range(SAMPLE_ALL)]
    assert sample_candidates(small, lambda p: p != "p03", 3, random.Random(1)) == [p for p in small if p != "p03"]
    members = [f"p{i:04d}" for i in range(1000)]
    rng = random.Random(2)
    got = sample_candidates(members, lambda p: True, 2, rng, extra=["p0999"])
    assert len(got) == SAMPLE_ALL + 1 or (len(got) == SAMPLE_ALL and "p0999" in got)
    assert "p0999" in got
    counts = Counter(rng.choice(sample_candidates(members, lambda p: p < "p0500", 2, rng)) for _ in range(20_000))
    assert set(counts) <= set(members[:500]) and len(counts) == 500  # only acceptable ones, every one of them
    assert max(counts.values()) < 4 * 20_000 / 500  # no member strongly favoured
    rare = {"p0123", "p0777"}
    assert sorted(sample_candidates(members, rare.__contains__, 2, rng)) == sorted(rare)  # the full pass
