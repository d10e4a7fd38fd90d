"""Members' dial addresses, read from their `hello` entries one member at a time.

The dialer used to read every `hello` of the consortium whenever one changed (and at every
start) and keep every member's address list: with 1,000 members, an O(N) read at each of
N daemon starts and an O(N) table per daemon. It only ever dials a few members, so
`HelloAddresses` reads the hellos of just the members it looks at (one indexed query
each) and keeps those until a hello may have changed (`clear`). Addresses are as
`dialpolicy.addresses_newest_first` gives them (every address, the newest hello's first);
a peer with no hello has the addresses it was given as a bootstrap peer, if any.
"""
from __future__ import annotations

from typing import Callable, Iterable, Protocol, TypeVar

from atdnode.peers.dialpolicy import addresses_newest_first
from ledger import Ledger
from ledger.errors import BadPeerId
from ledger.keys import public_key_from_peer_id


T = TypeVar("T")


class LedgerJobs(Protocol):
    """The daemon's ledger (`atdnode.replication.LedgerAccess`): runs `fn(ledger)` in its thread."""

    async def run(self, fn: Callable[[Ledger], T]) -> T: ...


class HelloAddresses:
    """Addresses of the members a dialer looks at (module doc); `cache[peer]` once read
    (an empty tuple: no hello and no bootstrap address, nothing to dial)."""

    def __init__(self, ledger: LedgerJobs, bootstrap: dict[str, list[str]],
                 members: Callable[[], "set[bytes]"]) -> None:
        self.ledger = ledger
        self.bootstrap = bootstrap  # peer -> addresses given on the command line
        self.members = members  # the daemon's member keys now (hellos of non-members are ignored)
        self.cache: dict[str, tuple[str, ...]] = {}

    def clear(self) -> None:
        """A hello may have changed: read again when next asked."""
        self.cache.clear()

    async def get(self, peers: Iterable[str]) -> dict[str, tuple[str, ...]]:
        """peer -> its addresses (read the ones not cached, in one ledger job)."""
        peers = list(dict.fromkeys(peers))
        missing = [p for p in peers if p not in self.cache]
        if missing:
            members = self.members()

            def read(led: Ledger) -> dict[str, tuple[str, ...]]:
                out = {}
                for peer in missing:
                    try:
                        key = public_key_from_peer_id(peer)
                    except BadPeerId:
                        key = None
                    rows = [] if key is None or key not in members else [
                        (peer, e.body["addrs"]) for e in led.query(kind="hello", author=key)
                        if isinstance(e.body.get("addrs"), list)]
                    out[peer] = addresses_newest_first(rows).get(peer) or tuple(self.bootstrap.get(peer, ()))
                return out

            self.cache.update(await self.ledger.run(read))
        return {p: self.cache[p] for p in peers}
