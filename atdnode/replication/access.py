"""Members-only access: the one gate every serving and pulling path of a node calls.

A node talks only to peers whose libp2p identity is an admitted, non-revoked member of its
consortium *at that moment* (its own ledger's membership). The daemon keeps the gate's
member set current (`update`, after every merge that changed membership), so a revoked
member loses access on its next request, without a restart.

Who calls it:

* stream handlers (ledger sync, blob chunks and manifests, split-learning sessions) are
  wrapped with `guard(handler, what)`: a non-member's stream gets one typed refusal frame
  (`REFUSAL`, msgpack) and is closed before its first request frame is read;
* the blob server re-checks `allows` before every request on a long-lived stream;
* pulling: the daemon syncs and fetches only from `allows(peer)` peers, disconnects
  non-members on connect and never dials them again (`refused`);
* gossip: the daemon's validator drops messages forwarded by non-members.

Bootstrap exception. A node that is not (yet) a member of its own ledger -- a joiner
that knows only the genesis id -- may pull from any peer (`may_pull_from`): merging keeps
only entries of members (`Ledger.merge(members_only=True)`), so what it can receive is the
genesis entry and, once a member serves it after its admission, the log. A member answers a
non-member's sync request with the refusal plus the genesis entry and nothing else.

Refusals are logged once per peer id (`refuse`).
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable, Iterable

import msgpack

from atdnode.transport import Stream, StreamHandler, TransportError

log = logging.getLogger("atd.access")

REFUSED_ERROR = "not a member of this consortium"


def refusal_frame(extra: dict | None = None) -> bytes:
    """The typed refusal every protocol sends a non-member (`t` for sync-style readers,
    `ok`/`error` for blob-style readers, `refused` for anyone)."""
    return msgpack.packb({"t": "refused", "ok": False, "refused": True, "error": REFUSED_ERROR, **(extra or {})},
                         use_bin_type=True)


def is_refusal(msg: object) -> bool:
    return isinstance(msg, dict) and msg.get("refused") is True


class AccessRefused(TransportError):
    """A peer refused us (we are not a member in its ledger), or we refuse a non-member."""


class MembershipGate:
    """The current member set (peer ids) and this node's own standing; cheap, synchronous checks.

    An empty gate with `open_access=True` lets everyone through (tools and benchmarks
    that run a bare `BlobServer` without a ledger).
    """

    def __init__(self, *, self_peer: str, open_access: bool = False) -> None:
        self.self_peer = self_peer
        self.open_access = open_access
        self._members: frozenset[str] = frozenset()
        self.self_is_member = False
        self.refused: set[str] = set()  # peer ids refused at least once (logged once, never dialled)

    def update(self, member_peer_ids: Iterable[str]) -> None:
        """Replace the member set (admitted and not revoked, from the ledger)."""
        self._members = frozenset(member_peer_ids)
        self.self_is_member = self.self_peer in self._members
        self.refused -= self._members  # admitted since: no longer refused

    @property
    def members(self) -> frozenset[str]:
        return self._members

    def allows(self, peer: str) -> bool:
        """May `peer` read from us (and may we pull from it)? Members only."""
        return self.open_access or peer in self._members

    def may_pull_from(self, peer: str) -> bool:
        """Members; and anyone while we are not a member ourselves (bootstrap, see module doc)."""
        return self.allows(peer) or not self.self_is_member

    def refuse(self, peer: str, what: str) -> AccessRefused:
        """Record (and log, once per peer id) that `peer` was refused; returns the typed error."""
        if peer not in self.refused:
            self.refused.add(peer)
            log.warning("refused %s for %s: %s", what, peer, REFUSED_ERROR)
        return AccessRefused(f"{peer} is {REFUSED_ERROR} ({what})")

    async def admit(self, stream: Stream, what: str, *, extra: dict | None = None) -> bool:
        """True if the stream's peer is a member; else send the refusal, close, return False.

        Called before the first request frame is read."""
        if self.allows(stream.remote_peer):
            return True
        self.refuse(stream.remote_peer, what)
        try:
            await stream.write_frame(refusal_frame(extra))
        except TransportError:
            pass
        await stream.close()
        return False

    def guard(self, handler: StreamHandler, what: str,
              extra: Callable[[], Awaitable[dict | None]] | None = None) -> StreamHandler:
        """Wrap a stream handler so non-members are refused before it runs."""

        async def gated(stream: Stream) -> None:
            if self.allows(stream.remote_peer):
                await handler(stream)
                return
            await self.admit(stream, what, extra=await extra() if extra is not None else None)

        return gated


def member_peer_ids(led) -> set[str]:
    """Peer ids of the admitted, non-revoked members of an open `Ledger`."""
    from ledger.keys import peer_id_from_public_key

    return {peer_id_from_public_key(pk) for pk in led.member_keys()}


def ledger_guard(handler: StreamHandler, ledger, what: str) -> StreamHandler:
    """`guard` for a process without a daemon (e.g. a split client serving sync): the member
    set is read from `ledger` (a LedgerAccess) when each stream arrives."""
    gate = MembershipGate(self_peer="")

    async def gated(stream: Stream) -> None:
        gate.update(await ledger.run(member_peer_ids))
        if await gate.admit(stream, what):
            await handler(stream)

    return gated
