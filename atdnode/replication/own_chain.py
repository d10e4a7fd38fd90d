"""Restores never fork: when a node may trust its own chain head, and how
a fork that one node saw reaches the others.

A daemon signs nothing until a member confirmed its own chain head (daemon.py).
"Confirmed" used to mean "one pull from a member finished"; a restored home whose own
entries did not all arrive in that pull (a per-author quota dropped them while the node
did not yet know it was a member) then signed at a seq it had already used, and every
other node froze it. Now:

* the sync server ends its answer with ``"yours": n`` -- the highest seq of the
  requester's own key in its log (`held_for`) -- and the daemon confirms its head only
  when its own log reaches that seq (`confirms`); otherwise it pulls again (the confirm
  loop) until it does. The node's own entries bypass every quota and waiting cap on merge
  (`LedgerAccess(own=...)`, `ledger.merge`), so one pull brings them all back;
* a node that holds fork evidence for an author serves it by sync (`fork_evidence`): a
  requester whose log still runs through the fork point (its head for that author is at
  or past the freeze seq, so it took one side of the fork into its log) receives the
  conflicting rows and freezes that author too, so no node keeps a diverged view. The
  forked node itself learns it as well and stops signing.

Limit: a node confirms against one member; if that member itself lacks some of the node's
entries (it was partitioned from the node's other peers), the node can still sign over
them -- and the fork is then found and spread by `fork_evidence`.
"""
from __future__ import annotations

from ledger import Ledger, public_key_from_peer_id
from ledger.errors import BadPeerId

MAX_EVIDENCE_AUTHORS = 64  # per answer: bounded work for a requester that lags on many forks


def held_for(led: Ledger, peer_id: str) -> int:
    """Highest seq of `peer_id`'s key in this ledger's log (0 when none or not a key). From
    the cached `heads()` the sync answer reads anyway: no extra query per served pull."""
    return held_by(led.heads(), peer_id)


def held_by(heads: dict[bytes, int], peer_id: str) -> int:
    """`held_for` from a heads map already read."""
    try:
        return heads.get(public_key_from_peer_id(peer_id), 0)
    except BadPeerId:
        return 0


def confirms(own_head: int, yours: object) -> bool:
    """Does a pull whose end marker said `yours` confirm an own log head of `own_head`?
    True when this node's log reaches every own entry the peer holds. A peer that sent no
    ``yours`` (an older version) confirms as before."""
    if yours is None:
        return True
    return isinstance(yours, int) and not isinstance(yours, bool) and own_head >= yours


def fork_evidence(led: Ledger, theirs: dict[bytes, int]) -> list:
    """Entries proving the forks this ledger knows of to a requester with log heads
    `theirs`: for each frozen author whose head there is at or past the freeze seq F,
    every stored row of that author at F-1 and F (two different entries at F, or one at F
    that does not link to F-1). Nothing for requesters that already stopped before F."""
    lagging = [(a, f) for a, f in sorted(led.forks().items()) if theirs.get(a, 0) >= f]
    return [e for a, f in lagging[:MAX_EVIDENCE_AUTHORS] for e in led.rows_between(a, max(1, f - 1), f)]
