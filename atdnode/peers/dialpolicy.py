"""The daemon's dial policy: whom to contact, at which addresses, how often.

Pure bookkeeping (no network, no clock of its own: callers pass `now`), used by
`atdnode.peers.dialer`:

* **Refusals are cheap and final.** A peer that refused us (we are not a member in its
  ledger) is not pulled from or dialled again before an exponential back-off ends
  (`refusal_base` doubling up to `refusal_cap`; `refusal_cap_joining`, shorter, while we are
  not a member in our own ledger: a joiner must notice its admission soon). Any
  membership change this node can see resets every refusal back-off. A node that learns
  it was revoked stops dialling and pulling (`learned_revoked` is True exactly once, for its
  one log line); it still pulls from a peer that connects to it (members dial only
  members: that peer holds its re-admission, which ends the state). Before this, a
  revoked daemon pulled 126,775 times in two minutes.
* **Addresses change, consortia reconnect.** A member's addresses are every address of
  its signed `hello` entries, newest `hello` first (`addresses_newest_first`); the dialer
  tries them in that order, so a stale address never hides the new one. A peer whose
  every address failed is retried with back-off (`dial_base` doubling up to `dial_cap`),
  reset at once when its addresses change (a newer `hello`).
* **Unreachable members are reported.** A member whose dials have failed, with no
  connection since, for longer than `unreachable_after_s` is reported once per episode
  (`observe` returns it) and listed by `unreachable` (status / dashboard) until a
  connection to it is up again.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from atdnode.retry import Backoff

MAX_ADDRS_PER_MEMBER = 8  # addresses kept per member (its newest hellos'); bounds a dial round


MAX_INTERNED_ADDRS = 1 << 16
_interned: dict[tuple[str, ...], tuple[str, ...]] = {}


def _intern(addrs: tuple[str, ...]) -> tuple[str, ...]:
    """One shared tuple per distinct address list in this process (the dialer's table and
    the policy's point at it; all nodes of a simulation share one process)."""
    t = _interned.get(addrs)
    if t is None:
        if len(_interned) >= MAX_INTERNED_ADDRS:
            return addrs
        t = _interned[addrs] = addrs
    return t


def addresses_newest_first(hellos: Iterable[tuple[str, list[str]]]) -> dict[str, tuple[str, ...]]:
    """`(peer, addrs)` of `hello` entries in log order -> every address of each peer, those
    of its newest hello first (duplicates dropped, at most MAX_ADDRS_PER_MEMBER)."""
    out: dict[str, list[str]] = {}
    for peer, addrs in reversed(list(hellos)):
        have = out.setdefault(peer, [])
        for a in addrs:
            if isinstance(a, str) and a not in have and len(have) < MAX_ADDRS_PER_MEMBER:
                have.append(a)
    return {peer: _intern(tuple(have)) for peer, have in out.items()}


@dataclass
class DialPolicy:
    """Back-offs and reachability of the peers a daemon talks to (module doc)."""

    refusal_base: float = 1.0
    refusal_cap: float = 30.0
    refusal_cap_joining: float = 5.0
    dial_base: float = 1.0
    dial_cap: float = 30.0
    unreachable_after_s: float = 60.0
    revoked: bool = False
    refusals: Backoff = field(init=False)
    dials: Backoff = field(init=False)
    refused_count: int = 0  # refusals received (status, tests)
    _revoked_said: bool = False
    _addrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _failing_since: dict[str, float] = field(default_factory=dict)  # peer -> first failed dial since a connection
    _reported: set[str] = field(default_factory=set)  # unreachable peers already reported (this episode)

    def __post_init__(self) -> None:
        self.refusals = Backoff(self.refusal_base, self.refusal_cap)
        self.dials = Backoff(self.dial_base, self.dial_cap)

    # -- refusals -------------------------------------------------------------

    def refused_by(self, peer: str, now: float, *, joining: bool = False) -> float:
        """`peer` refused us; returns how long it is left alone."""
        self.refused_count += 1
        return self.refusals.fail(peer, now, self.refusal_cap_joining if joining else None)

    def membership_changed(self) -> None:
        """Our ledger's member set changed: every refusal may be out of date."""
        self.refusals.clear()

    def learned_revoked(self) -> bool:
        """Mark this node revoked; True only the first time (say so once)."""
        self.revoked = True
        first, self._revoked_said = not self._revoked_said, True
        return first

    def readmitted(self) -> bool:
        """Our ledger shows us a member again; True if we had been revoked."""
        was, self.revoked, self._revoked_said = self.revoked, False, False
        return was

    def may_contact(self, peer: str, now: float, *, connected: bool = False) -> bool:
        """May we pull from / dial `peer` now? Not while it refused us; once revoked, only a
        peer that connected to us (a member that dials us holds our re-admission)."""
        return (connected or not self.revoked) and not self.refusals.blocked(peer, now)

    # -- dials ----------------------------------------------------------------

    def set_addresses(self, peer: str, addrs: Iterable[str]) -> None:
        """The addresses known for `peer`; a change (a newer hello) lifts its dial back-off."""
        new = addrs if isinstance(addrs, tuple) else tuple(addrs)  # (shared with the dialer's table)
        if self._addrs.get(peer) != new:
            self._addrs[peer] = new
            self.dials.clear(peer)

    def addressed(self) -> list[str]:
        """Peers whose addresses were recorded (`set_addresses`): those a dialer has dialled."""
        return list(self._addrs)

    def may_dial(self, peer: str, now: float) -> bool:
        return self.may_contact(peer, now) and not self.dials.blocked(peer, now)

    def dial_failed(self, peer: str, now: float) -> float:
        """Every address of `peer` failed; returns the back-off before the next try."""
        self._failing_since.setdefault(peer, now)
        return self.dials.fail(peer, now)

    def dial_ok(self, peer: str) -> None:
        self.dials.clear(peer)

    # -- reachability ---------------------------------------------------------

    def observe(self, connected: Iterable[str], now: float) -> tuple[list[tuple[str, float]], list[str]]:
        """Feed the connected peers; returns (members now unreachable longer than
        `unreachable_after_s`, reported for the first time this episode, with seconds),
        (reported members reachable again)."""
        back = []
        for peer in set(connected):
            self._failing_since.pop(peer, None)
            self.dials.clear(peer)
            if peer in self._reported:
                self._reported.discard(peer)
                back.append(peer)
        newly = []
        for peer, since in self._failing_since.items():
            if peer not in self._reported and now - since >= self.unreachable_after_s:
                self._reported.add(peer)
                newly.append((peer, now - since))
        return newly, back

    def failing(self) -> set[str]:
        """Members whose dials failed, not connected since (reachability unknown or lost)."""
        return set(self._failing_since)

    def unreachable(self, now: float) -> dict[str, float]:
        """Members unreachable longer than `unreachable_after_s`: peer -> seconds so far."""
        return {p: round(now - s, 1) for p, s in self._failing_since.items() if now - s >= self.unreachable_after_s}

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the state of peers not in `keep` (no longer members)."""
        keep = set(keep)
        for table in (self._failing_since, self._addrs):
            for peer in [p for p in table if p not in keep]:
                del table[peer]
        self._reported &= keep
