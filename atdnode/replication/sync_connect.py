"""Which end of a new connection pulls: one pull per connection when the two
ledgers are in step, both when the dialled end holds something the dialler lacks.

Before this, both ends of every new connection pulled at once; with a peer set of 8
that was ~15 pulls per daemon at start-up, nearly all of them no-ops between ledgers in
step. Now, by the connection's direction (`Transport.dialled`):

* the **dialling end** pulls at once, as before. It is the end that chose to connect:
  a node starting, restarting or rejoining after a partition -- the one likely to lack
  something -- and a joiner's bootstrap dial;
* the **dialled end** (when it is a member itself) waits up to `CONNECT_WAIT_S` for that
  pull to reach its sync server (`ConnectPulls.observed`, called by
  `atdnode.replication.sync.serve_sync` once it has compared the requester's digest vector, and
  where they differ the requester's heads, with its own). It skips its own pull only when
  that comparison showed that the dialler holds nothing it lacks: equal digest vectors,
  or every head the dialler sent at or below its own. Anything else and it pulls: the
  dialler is ahead for some author (it pulls at once then, without waiting out the
  rest), or no request came in time (an older daemon, a dialler in a refusal back-off or
  one that does not pull at all, such as a split client; a failed stream), or the
  direction is unknown (`dialled` is None: both ends pull, as before), or the dialled
  end is not a member (a joiner, or a node that learned it was revoked: it pulls from
  whoever connects, which is how a re-admitted node hears of it).

Correct under churn, partitions and revocations: a pull is skipped only on evidence
gathered *after* the connection came up (a waiter is registered when the connection is
announced, before any request on it can be served, and sees only observations made
from then on), and the evidence says exactly what a pull would have fetched: nothing.
A dialler that lacks something fetches it with its own pull; a dialled end that lacks
something sees it in the dialler's heads and pulls. Entries appended after the
comparison travel by gossip (the connection is up), and the periodic sync repairs what
gossip misses, as always. A revoked member learns of its revocation as before whichever
end dials: by gossip, or by its own pull from a member that still serves it (when it
dials, at once; when it is dialled, as soon as the dialler's request shows the
revocation entry it lacks); a member that refuses it serves it nothing either way.

The same evidence confirms the dialled end's own chain head (`atdnode.replication.own_chain`, issue
24): a member whose heads are nowhere ahead of ours holds no own entry of ours past our
head.
"""
from __future__ import annotations

import trio

CONNECT_WAIT_S = 3.0  # the dialled end waits this long for the dialler's pull before pulling itself


class Waiter:
    """One dialled connection's wait for the dialler's request (`ConnectPulls.expect`)."""

    __slots__ = ("event", "ahead")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.ahead = True  # until a comparison says otherwise: pull


class ConnectPulls:
    """The connection-pull rule of one daemon (module doc). State is only the waiters of
    connections made in the last `wait_s` seconds: nothing per member."""

    def __init__(self, wait_s: float = CONNECT_WAIT_S) -> None:
        self.wait_s = wait_s
        self._waiting: dict[str, list[Waiter]] = {}

    @staticmethod
    def waits(dialled: bool | None, member: bool) -> bool:
        """Does this end wait for the other's pull on a new connection? Only a member that
        was dialled (`Transport.dialled` False); None (unknown) pulls at once."""
        return dialled is False and member

    def expect(self, peer: str) -> Waiter:
        """Start waiting for a request from `peer` (synchronously, when the connection is
        announced: before any request on it can reach our sync server)."""
        w = Waiter()
        self._waiting.setdefault(peer, []).append(w)
        return w

    def observed(self, peer: str, ahead: bool) -> None:
        """`peer`'s pull reached our sync server and was compared with our ledger; `ahead`:
        its heads showed something we lack (or could not be compared)."""
        for w in self._waiting.pop(peer, ()):
            w.ahead = ahead
            w.event.set()

    async def peer_has_nothing_new(self, peer: str, w: Waiter) -> bool:
        """Wait (at most `wait_s`) for `w`'s request from `peer`; True when it showed that
        `peer` holds nothing we lack, False otherwise (then pull)."""
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
