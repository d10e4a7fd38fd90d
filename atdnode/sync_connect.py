"""Which side of a new connection pulls (issue 29): one pull per connection when the two
ledgers are in step, both when either holds something the other lacks.

Before this, both ends of every new connection pulled at once; with a peer set of 8
that was ~15 pulls per daemon at start-up, nearly all of them no-ops between ledgers in
step. Now:

* the **leader** -- the end with the smaller peer id (both ends agree without a word) --
  pulls at once, as before;
* the **follower** waits up to `CONNECT_WAIT_S` for a pull *from* that peer to reach its
  sync server (`ConnectPulls.observed`, called by `atdnode.sync.serve_sync` once it has
  compared the requester's digest vector, and where they differ the requester's heads,
  with its own). It skips its own pull only when that comparison showed that the peer
  holds nothing it lacks: equal digest vectors, or every head the peer sent at or below
  its own. Anything else -- the peer is ahead for some author, no pull came in time (an
  older daemon that never leads, a leader in a refusal back-off, a failed stream), or the
  follower is not a member itself (a joiner) -- and it pulls as before.

Measured (bench/memsim_bench.py, 1,000 established daemons with churn and a partition):
start-up pulls per daemon 15.5 -> 7.7, whole run 27.7 -> 21.2 (seed 1).

Correct under churn and partitions: a pull is skipped only on evidence gathered *after*
the connection came up (a waiter sees only observations made after it started), and the
evidence says exactly what a pull would have fetched: nothing. A leader that lacks
something fetches it with its own pull; a follower that lacks something sees it in the
leader's heads and pulls. Entries appended after the comparison travel by gossip (the
connection is up), and the periodic sync repairs what gossip misses, as always.

The same evidence confirms the follower's own chain head (`atdnode.own_chain`, issue 24):
a member whose heads are nowhere ahead of ours holds no own entry of ours past our head.
"""
from __future__ import annotations

import trio

CONNECT_WAIT_S = 3.0  # a follower waits this long for the leader's pull before pulling itself


class _Waiter:
    __slots__ = ("event", "ahead")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.ahead = True  # until a comparison says otherwise: pull


class ConnectPulls:
    """The connection-pull rule of one daemon (module doc). State is only the waiters of
    connections made in the last `wait_s` seconds: nothing per member."""

    def __init__(self, me: str, wait_s: float = CONNECT_WAIT_S) -> None:
        self.me = me
        self.wait_s = wait_s
        self._waiting: dict[str, list[_Waiter]] = {}

    def leads(self, peer: str) -> bool:
        """Does this end pull first on a new connection to `peer`? (smaller peer id)"""
        return self.me < peer

    def observed(self, peer: str, ahead: bool) -> None:
        """`peer`'s pull reached our sync server and was compared with our ledger; `ahead`:
        its heads showed something we lack (or could not be compared)."""
        for w in self._waiting.pop(peer, ()):
            w.ahead = ahead
            w.event.set()

    async def peer_has_nothing_new(self, peer: str) -> bool:
        """Wait (at most `wait_s`) for a pull from `peer` made from now on; True when it
        showed that `peer` holds nothing we lack, False otherwise (then pull)."""
        w = _Waiter()
        self._waiting.setdefault(peer, []).append(w)
        try:
            with trio.move_on_after(self.wait_s):
                await w.event.wait()
        finally:
            if not w.event.is_set():  # timed out or cancelled: forget this waiter
                rest = [x for x in self._waiting.get(peer, ()) if x is not w]
                if rest:
                    self._waiting[peer] = rest
                else:
                    self._waiting.pop(peer, None)
        return w.event.is_set() and not w.ahead


def ahead_of(mine: dict[bytes, int], theirs: dict) -> bool:
    """Does a requester with heads `theirs` (well-formed: author bytes -> int) hold an entry
    beyond `mine` (a higher head, or an author we have no entry of)?"""
    return any(seq > mine.get(author, 0) for author, seq in theirs.items())
