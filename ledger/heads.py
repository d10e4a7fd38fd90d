"""The heads map of a `Ledger` -- author -> highest seq in its log -- cached, and kept current
by the ledger's own writes.

A daemon reads the heads on every sync pull and every pull it serves; with thousands of
authors a read scans the whole log. `Heads` keeps the map keyed by the ledger's change
token (`Store.change_token`: SQLite's `data_version`, which moves when another connection
commits, and this connection's `total_changes`). A write transaction of the ledger that
begins with the map current records the rows that entered or left the log
(`Store.log_moves`) and turns the map into the new one as it commits (`moved`,
`committed`); only another connection's write (a CLI command) or a reopen makes it scan
again (`read`).

Each new map is a new object -- the old one is never changed, so a reader holding it
(`Ledger.heads(copy=False)`, the sync digest's cache) keeps what it read -- and gets a new
version; the authors whose head changed in the last HEADS_LOG transitions are remembered
(`since`), so a view built on the heads (atdnode.replication.sync_digest) updates only those.
"""
from __future__ import annotations

from collections import deque
from sqlite3 import Connection

from ledger.keys import intern_key
from ledger.store import Store

HEADS_LOG = 32  # transitions of the heads map whose changed authors `since` remembers
_SCAN = "SELECT author, seq FROM entries WHERE state=0"


class Heads:
    """One ledger's cached heads map (module doc). Call every method under the ledger's lock."""

    __slots__ = ("token", "map", "version", "log")

    def __init__(self) -> None:
        self.token: tuple[int, int] | None = None  # the change token `map` is current for
        self.map: dict[bytes, int] | None = None
        self.version = 0  # moves with every new map
        self.log: deque[tuple[int, tuple[bytes, ...]]] = deque(maxlen=HEADS_LOG)  # (version, changed authors)

    def current(self, token: tuple[int, int]) -> bool:
        return self.map is not None and self.token == token

    def read(self, conn: Connection, token: tuple[int, int]) -> dict[bytes, int]:
        """The map for `token`: the cached one, or one scan of the log."""
        if not self.current(token):
            heads: dict[bytes, int] = {}  # the maximum taken here: 2-3x faster than SQL's GROUP BY
            for author, seq in conn.execute(_SCAN):  # (its temp B-tree)
                have = heads.get(author)
                if have is None:
                    heads[intern_key(author)] = seq  # keys shared process-wide (ledger.keys.intern_key)
                elif have < seq:
                    heads[author] = seq
            self.token, self.map = token, heads
            self.version += 1
            self.log.clear()  # a rebuild: what changed since an earlier map is not known
        return self.map

    def moved(self, store: Store, moves: list[tuple[bytes, int, bool]]) -> tuple[dict[bytes, int], tuple] | None:
        """(the map after these log moves, the authors whose head changed), None if none did.
        Call inside the transaction that made them (it reads its rows): an entry that entered
        the log raises its author's head to its seq (a log chain is contiguous from 1, so its
        head is its highest seq); an author with an entry that left the log (a revocation
        cut, a fork) is looked up."""
        heads = self.map
        out = dict(heads)
        gone: set[bytes] = set()
        for author, seq, entered in moves:
            if not entered:
                gone.add(author)
            elif (have := out.get(author)) is None:
                out[intern_key(author)] = seq
            elif have < seq:
                out[author] = seq
        for author in gone:
            seq = store.log_head(author)[0]
            if seq:
                out[intern_key(author)] = seq
            else:
                out.pop(author, None)
        changed = tuple({a for a, _, _ in moves if out.get(a) != heads.get(a)})
        return (out, changed) if changed else None

    def committed(self, token: tuple[int, int], new: tuple[dict[bytes, int], tuple] | None) -> None:
        """The transaction that began with the map current committed, leaving `token`; `new`:
        what `moved` made of its moves (None: the map is unchanged)."""
        if new is not None:
            self.version += 1
            self.log.append((self.version, new[1]))
            self.map = new[0]
        self.token = token

    def since(self, version: int | None) -> set[bytes] | None:
        """The authors whose head differs between the map of `version` and the current one;
        None when not known (no version, a rebuild since, more than HEADS_LOG maps ago)."""
        now, log = self.version, self.log
        if version == now:
            return set()
        if version is None or version > now or not log or log[0][0] > version + 1:
            return None
        changed: set[bytes] = set()
        for v, authors in log:
            if v > version:
                changed.update(authors)
        return changed
