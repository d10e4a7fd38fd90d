"""The bounded peer set: which members a daemon stays connected to.

A daemon no longer dials every member. It keeps between `target` and `max` connections
(config.toml `[peers] target = 8, max = 16`), chosen from the members' signed `hello`
entries (their addresses):

* below `target` it dials `target - connected` members it is not connected to: a share
  (`low_latency_share`, default one half) of the lowest round-trip times measured earlier,
  the rest drawn at random (random links keep the graph an expander, so gossip and sync
  reach every member; low-latency links make the common path fast);
* above `max` (inbound connections arrive unasked) it disconnects the least useful peers
  down to `max`, never below `target`: peers without a measured RTT or with the highest
  one first, the newest connection first among equals (so an established topology
  stays put and a dialler that finds a full node moves on), keeping the lowest-RTT share;
* a peer that drops is replaced on the next maintenance tick (the daemon wakes on every
  connect and on every new hello, each second while it has members to dial, and every 5 s
  once it holds `target` peers or every member it knows: `atdnode.peers.dialer.IDLE_TICK_S`);
* every `rotate_s` one random member not connected is dialled and the least useful peer
  dropped (`plan_rotation`): sets at `target` would otherwise never change, and two
  sides of a healed partition, each at `target` within itself, would never meet again.
  A rotation costs a connection set-up on both sides (Noise handshake, identify, pubsub
  hello, a sync pull each way): in an idle consortium of 100 daemons about a third of
  their CPU. So a node rotates every `rotate_s` only while a rotation may buy
  something (`rotation_interval`): some member's dials failed and it was not reached
  since (a partition or a member away: the rotation then re-probes such a member every
  other time, so a healed cut is crossed at the next rotation), a peer it did not prune
  went away and left the set under `target` (a cut link), periodic sync pulls brought
  entries gossip had not (the graph misses something; a new connection's pull does not
  count, `atdnode.peers.dialer.RotationPace`), or the member set changed (a new hello alone does
  not count). With
  none of these its rotations space out, each interval twice the one before, up to
  `rotate_idle_s` (default 600 s); any of them pulls the next rotation forward to
  `rotate_s` after the last one.

RTTs are measured cheaply from work the daemon does anyway: the time a dial takes and the
time a sync stream takes to open (one multistream round trip), smoothed (EWMA).

GossipSub's mesh follows the peer set (`gossip_degrees`): D = min(target, 3), so the mesh
never asks for more peers than the set holds and D_high <= max. D is below libp2p's
default of 6 on purpose: py-libp2p costs ~1-2 ms of CPU per received RPC and a node
receives each message about D times, so on 10 daemons D = 3 halved the CPU per gossiped
entry (62-77 -> 33-37 ms for all ten, bench/daemon_bench.py, same machine and load) with
every entry still delivered; sync covers what a thinner mesh misses.

Everything here is pure (no network, no clock of its own): the daemon
(`atdnode.peers.dialer.PeerDialer.discovery_loop`) feeds it connections, hellos and measurements.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from atdnode.errors import ConfigError

DEFAULT_TARGET = 8
DEFAULT_MAX = 16
RTT_ALPHA = 0.3  # weight of a new RTT sample in the moving average
SAMPLE_ALL = 64  # up to this many members, a dial round looks at every one (see sample_candidates)


@dataclass(frozen=True)
class PeerSetConfig:
    """Bounds of the peer set; `from_table` reads config.toml's `[peers]` table."""

    target: int = DEFAULT_TARGET
    max: int = DEFAULT_MAX
    low_latency_share: float = 0.5  # of the dials (and of the peers protected from pruning)
    grace_s: float = 5.0  # a new connection is not pruned this long (it syncs and learns hellos first)
    redial_after_s: float = 30.0  # a peer we dialled, pruned or lost is not dialled again this soon
    rotate_s: float = 60.0  # one peer is swapped for a random member this often (re-mixing) ...
    rotate_idle_s: float = 600.0  # ... or this often while nothing suggests a rotation helps (rotation_interval)
    unreachable_after_s: float = 60.0  # a member whose dials fail this long is one WARNING line

    def __post_init__(self) -> None:
        if type(self.target) is not int or self.target < 1:
            raise ConfigError("config: peers.target must be an integer >= 1")
        if type(self.max) is not int or self.max < self.target:
            raise ConfigError("config: peers.max must be an integer >= peers.target")
        if not isinstance(self.low_latency_share, (int, float)) or not 0.0 <= self.low_latency_share <= 1.0:
            raise ConfigError("config: peers.low_latency_share must be a number in [0, 1]")
        for key in ("grace_s", "redial_after_s", "rotate_s", "rotate_idle_s", "unreachable_after_s"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1e6:
                raise ConfigError(f"config: peers.{key} must be a number of seconds >= 0")

    @classmethod
    def from_table(cls, table: Any) -> "PeerSetConfig":
        """From config.toml's `[peers]` table (None: defaults). ConfigError on a bad value."""
        if table is None:
            return cls()
        if not isinstance(table, dict):
            raise ConfigError("config: [peers] must be a table")
        keys = ("target", "max", "low_latency_share", "grace_s", "redial_after_s", "rotate_s", "rotate_idle_s",
                "unreachable_after_s")
        unknown = set(table) - set(keys)
        if unknown:
            raise ConfigError(f"config: unknown key peers.{sorted(unknown)[0]} (known: {', '.join(keys)})")
        target = table.get("target", DEFAULT_TARGET)
        top = table.get("max", max(DEFAULT_MAX, 2 * target) if type(target) is int else DEFAULT_MAX)
        return cls(**{**{k: table[k] for k in keys if k in table}, "max": top})


def small_consortium(cfg: PeerSetConfig, members: int) -> bool:
    """Every other member fits in the peer set: each node holds all of them, and its own
    messages reach each member in one hop (flood publish). See `gossip_degrees`."""
    return members - 1 <= cfg.target


def gossip_degrees(cfg: PeerSetConfig, members: int | None = None) -> tuple[int, int, int]:
    """GossipSub (D, D_low, D_high) for a peer set: D = min(target, 3) (each extra mesh peer
    is one more duplicate of every message to receive; see the module doc), D_low = D - 1
    (at least 1), D_high = min(max, 2 D) but at least D.

    A small consortium (`small_consortium`) gets D = D_high = min(target, 2), D_low = 1: its
    relays only cover a member whose link to an entry's author is down (the rest
    of that mode, no opportunistic grafting and no IHAVE gossip, is in
    `atdnode.transport._libp2p.gossip_mesh.SmallConsortiumMixin`)."""
    if members is not None and small_consortium(cfg, members):
        d = min(cfg.target, 2)
        return d, 1, d
    d = min(cfg.target, 3)
    return d, max(1, d - 1), max(d, min(cfg.max, 2 * d))


@dataclass
class PeerSet:
    """What the daemon knows about its peers: smoothed RTTs and when each connected."""

    cfg: PeerSetConfig
    rtt: dict[str, float] = field(default_factory=dict)  # peer -> seconds (EWMA), kept after a disconnect
    since: dict[str, float] = field(default_factory=dict)  # connected peer -> first seen connected
    pruned: int = 0
    dialled: int = 0

    def observe_rtt(self, peer: str, seconds: float) -> None:
        old = self.rtt.get(peer)
        self.rtt[peer] = seconds if old is None else (1 - RTT_ALPHA) * old + RTT_ALPHA * seconds

    def observe_connected(self, connected: Iterable[str], now: float) -> None:
        """Record the currently connected peers (first-seen times; departed peers forgotten)."""
        now_set = set(connected)
        for p in list(self.since):
            if p not in now_set:
                del self.since[p]
        for p in now_set:
            self.since.setdefault(p, now)


def sample_candidates(members: Sequence[str], ok: Callable[[str], bool], need: int, rng: random.Random,
                      extra: Iterable[str] = ()) -> list[str]:
    """The members a dial round chooses from (`plan_dials`, `plan_rotation`), without a pass
    over every member of a large consortium (with 1,000 members that pass, every
    round of every daemon, was a large part of start-up): with at most SAMPLE_ALL members,
    every one `ok` accepts, as before; else those `ok` accepts among a uniform random sample
    of max(8 * need, SAMPLE_ALL) members, and among `extra` (the peers with a known RTT that
    the low-latency share picks from, the failing ones a rotation retries), so a uniform
    choice from the result is a uniform choice among acceptable members. A sample with
    fewer than `need` acceptable members falls back to the full pass (a consortium mostly
    connected, refused or backing off)."""
    if len(members) <= SAMPLE_ALL:
        return [p for p in members if ok(p)]
    k = min(len(members), max(8 * need, SAMPLE_ALL))
    sample = [members[i] for i in rng.sample(range(len(members)), k)]
    out = list(dict.fromkeys(p for p in (*sample, *extra) if ok(p)))
    return out if len(out) >= need else [p for p in members if ok(p)]


def plan_dials(candidates: Iterable[str], connected: Iterable[str], rtt: Mapping[str, float],
               cfg: PeerSetConfig, rng: random.Random) -> list[str]:
    """Members to dial now: none at or above `target`; else `target - len(connected)` of
    the `candidates` not connected, the `low_latency_share` of them with the lowest known
    RTT and the rest at random. Deterministic for a given `rng` state (candidates sorted)."""
    conn = set(connected)
    need = cfg.target - len(conn)
    if need <= 0:
        return []
    pool = sorted(set(candidates) - conn)
    n_fast = int(round(need * cfg.low_latency_share))
    fast = sorted((p for p in pool if p in rtt), key=lambda p: (rtt[p], p))[:n_fast]
    rest = [p for p in pool if p not in fast]
    rng.shuffle(rest)
    return fast + rest[:need - len(fast)]


def plan_prunes(connected: Iterable[str], rtt: Mapping[str, float], since: Mapping[str, float],
                cfg: PeerSetConfig, *, now: float, keep: Iterable[str] = ()) -> list[str]:
    """Peers to disconnect: none at or below `max`; else up to `len - max` least useful
    ones (so never below `target`). Never chosen: the lowest-RTT `low_latency_share *
    target` peers, connections younger than `grace_s` (at `now`; they may leave the set
    above `max` until they age) and `keep`. Of the rest: unknown RTT before known, higher
    RTT before lower, the newest connection before older ones."""
    conn = sorted(set(connected))
    excess = len(conn) - cfg.max
    if excess <= 0:
        return []
    n_fast = int(round(cfg.target * cfg.low_latency_share))
    protected = set(sorted((p for p in conn if p in rtt), key=lambda p: (rtt[p], p))[:n_fast]) | set(keep)
    protected |= {p for p in conn if now - since.get(p, now) < cfg.grace_s}
    victims = [p for p in conn if p not in protected]

    def badness(p: str) -> tuple:
        known = p in rtt
        return (not known, rtt.get(p, 0.0), since.get(p, 0.0), p)

    victims.sort(key=badness, reverse=True)
    return victims[:excess]


def plan_rotation(candidates: Iterable[str], connected: Iterable[str], rng: random.Random,
                  failing: Iterable[str] = ()) -> str | None:
    """The member to dial in a rotation: one not connected, at random (None: none left).
    Every other time (a coin flip) one of the `failing` candidates (dials failed, not reached
    since) if any: after a partition heals, the next rotation crosses the cut; a member that
    is away for good takes only half of the rotations."""
    pool = sorted(set(candidates) - set(connected))
    suspects = sorted(set(failing) & set(pool))
    if suspects and rng.random() < 0.5:
        return rng.choice(suspects)
    return rng.choice(pool) if pool else None


def rotation_interval(cfg: PeerSetConfig, last: float, *, failing: bool, learned: bool, members_changed: bool) -> float:
    """Seconds from one rotation to the next, `last` the interval before it (module doc):
    `rotate_s` while a rotation may buy something -- some member's dials are `failing` (or a
    link was cut), sync pulls `learned` entries gossip had not brought, the member set
    changed -- else twice `last`, up to `rotate_idle_s` (never below `rotate_s`): quiet
    rotations space out step by step, so a partition that begins soon after one still
    finds the others rotating often."""
    if failing or learned or members_changed:
        return cfg.rotate_s
    return max(cfg.rotate_s, min(2 * last, cfg.rotate_idle_s))


def plan_sync(due: list[str], connected: Iterable[str], fanout: int, rng: random.Random) -> list[str]:
    """The peers the next periodic sync pulls from: up to `fanout` connected ones, taken in
    turn from `due` (a shuffled round of the connected peers, consumed from its end and
    refilled when used up; the caller keeps it between calls), so every peer is pulled from
    once per round of ceil(peers / fanout) intervals and the cost of an interval does not
    grow with the peer set. Peers gone since the round was drawn are skipped."""
    live = set(connected)
    picks: list[str] = []
    for refill in (False, True):
        if refill:
            due[:] = sorted(live)
            rng.shuffle(due)
        while due and len(picks) < fanout:
            peer = due.pop()
            if peer in live and peer not in picks:
                picks.append(peer)
        if len(picks) >= fanout:
            break
    return picks
