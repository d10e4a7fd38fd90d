"""Per-author quotas on entries merged from the network.

A member is trusted to write, not to write without bound: 200 entries of 500 KB gossiped
in 1.3 s grew every node's ledger by 100 MB. `AuthorQuota` bounds, per author,

* the size of one entry (payload + signature), by kind;
* how many entries and bytes of that author and kind this node stores within any
  `window_s` seconds (local arrival time, a sliding window): generous for `weights`
  announcements, tight for bulk `metrics`. Kinds the table does not name share one
  window per author (`"*"`), so inventing kinds buys no room;
* how many entries and bytes of that author, all kinds together, this node stores per
  window (`author_entries` / `author_bytes`): the budget that bounds what one member can
  make every disk store, whatever kinds it writes.
 `Ledger.merge(quota=...)`
refuses an entry over either bound with `QuotaExceeded` before storing it; it is not
lost -- the author's later entries wait behind it and sync offers it again once the
window has room, so a backlog is accepted at the quota's rate and a flood is cut to it.
Membership entries (`genesis`, `member`) are never refused, and neither are the node's
own entries (`exempt`: a restored home must take back its whole chain at once).

The window is kept in memory (`QuotaTracker`, one per `Ledger`): a restart forgets it,
which only lets one more window's worth in.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from ledger.entry import Entry
from ledger.errors import QuotaExceeded

log = logging.getLogger(__name__)

NEVER_LIMITED = ("genesis", "member")
SWEEP_EVERY = 4096  # records between sweeps of every window


@dataclass(frozen=True)
class KindLimit:
    """Bounds for one kind: one entry's bytes, and entries / bytes per window."""

    max_entry_bytes: int
    window_entries: int
    window_bytes: int

    def __post_init__(self) -> None:
        if min(self.max_entry_bytes, self.window_entries, self.window_bytes) < 1:
            raise ValueError("quota limits must be positive integers")


DEFAULT_LIMITS = {  # per author and kind; counts generous (100 / s), bytes what a real node writes
    "weights": KindLimit(256 << 10, 6000, 32 << 20),    # announcements: blob hash, config, readers
    "aggregate": KindLimit(256 << 10, 6000, 32 << 20),
    "split_secret": KindLimit(600 << 10, 60, 16 << 20),  # a sealed embedder (MAX_SPLIT_ENVELOPE)
    "metrics": KindLimit(64 << 10, 6000, 4 << 20),      # bulk metrics: tight
    "*": KindLimit(256 << 10, 6000, 16 << 20),
}


AUTHOR_ENTRIES = 12_000  # per author and window, all kinds together
AUTHOR_BYTES = 48 << 20  # (above any one kind's window: a member publishing weights is not held back)
_BUDGET = ""  # the tracker's key for an author's all-kinds window
_AUTHOR_KEYS = ("author_entries", "author_bytes")


@dataclass(frozen=True)
class AuthorQuota:
    """Limits per kind (`"*"`: every kind not named, one shared window), the budget per
    author over all kinds (`author_entries` / `author_bytes`); `window_s` the sliding window."""

    limits: dict[str, KindLimit] = field(default_factory=lambda: dict(DEFAULT_LIMITS))
    window_s: float = 60.0
    author_entries: int = AUTHOR_ENTRIES
    author_bytes: int = AUTHOR_BYTES

    def __post_init__(self) -> None:
        if min(self.author_entries, self.author_bytes) < 1:
            raise ValueError("quota.author_entries and quota.author_bytes must be positive integers")

    def limit(self, kind: str) -> KindLimit:
        return self.limits.get(kind) or self.limits.get("*") or DEFAULT_LIMITS["*"]

    def window_key(self, kind: str) -> str:
        """The window an entry of `kind` counts in besides its author's budget: its own for a
        kind the table names, else the one every unnamed kind of that author shares."""
        return kind if kind in self.limits else "*"

    def too_big(self, e: Entry) -> bool:
        """Is `e` over its kind's size limit (a check that needs no window, e.g. before relaying)?"""
        return e.kind not in NEVER_LIMITED and len(e.payload) + len(e.sig) > self.limit(e.kind).max_entry_bytes

    @classmethod
    def from_table(cls, table: dict | None) -> "AuthorQuota":
        """From a config table, e.g. HOME/config.toml ``[quota]``::

            window_s = 60
            author_entries = 12000      # per author, all kinds together
            author_bytes = 50331648
            [quota.metrics]
            max_entry_bytes = 16384
            window_entries = 120
            window_bytes = 1048576

        Kinds not named keep the defaults; a named kind may give any subset of the three.
        ValueError for anything else."""
        if table is None:
            return cls()
        if not isinstance(table, dict):
            raise ValueError("quota must be a table")
        limits = dict(DEFAULT_LIMITS)
        window = table.get("window_s", 60.0)
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not window > 0:
            raise ValueError("quota.window_s must be a positive number")
        budget = {}
        for key in _AUTHOR_KEYS:
            v = table.get(key, getattr(cls, key))
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"quota.{key} must be a positive integer")
            budget[key] = v
        for kind, spec in table.items():
            if kind == "window_s" or kind in _AUTHOR_KEYS:
                continue
            if not isinstance(spec, dict) or set(spec) - {"max_entry_bytes", "window_entries", "window_bytes"}:
                raise ValueError(f"quota.{kind} must be a table of max_entry_bytes / window_entries / window_bytes")
            if any(isinstance(v, bool) or not isinstance(v, int) for v in spec.values()):
                raise ValueError(f"quota.{kind}: limits must be integers")
            base = limits.get(kind, DEFAULT_LIMITS["*"])
            limits[kind] = KindLimit(spec.get("max_entry_bytes", base.max_entry_bytes),
                                     spec.get("window_entries", base.window_entries),
                                     spec.get("window_bytes", base.window_bytes))
        return cls(limits, float(window), **budget)


class QuotaTracker:
    """The sliding windows of what each author stored lately, per (author, kind window) and
    per author over all kinds; `check` then `record`."""

    def __init__(self) -> None:
        self._seen: dict[tuple[bytes, str], deque[tuple[float, int]]] = {}
        self._sums: dict[tuple[bytes, str], int] = {}
        self._logged: dict[bytes, float] = {}
        self._records = 0
        self._quota: AuthorQuota | None = None
        self.refused = 0

    def _window(self, key: tuple[bytes, str], now: float, window_s: float) -> deque[tuple[float, int]]:
        q = self._seen.setdefault(key, deque())
        while q and q[0][0] <= now - window_s:
            self._sums[key] = self._sums.get(key, 0) - q.popleft()[1]
        if not q:
            self._seen.pop(key, None)
            self._sums.pop(key, None)
        return q

    def check(self, quota: AuthorQuota, e: Entry, *, now: float | None = None) -> QuotaExceeded | None:
        """The refusal for `e` if storing it would break its author's quota, else None."""
        if e.kind in NEVER_LIMITED:
            return None
        self._quota = quota
        now = time.monotonic() if now is None else now
        lim = quota.limit(e.kind)
        size = len(e.payload) + len(e.sig)
        where = dict(author=e.author, seq=e.seq, entry_id=e.id)
        err: QuotaExceeded | None = None
        if size > lim.max_entry_bytes:
            err = QuotaExceeded(f"{e.kind} entry of {size} bytes is over this node's limit of "
                                f"{lim.max_entry_bytes} bytes for that kind", **where)
        else:
            key = (e.author, quota.window_key(e.kind))
            q = self._window(key, now, quota.window_s)
            total = (e.author, _BUDGET)
            t = self._window(total, now, quota.window_s)
            if len(q) + 1 > lim.window_entries or self._sums.get(key, 0) + size > lim.window_bytes:
                what = e.kind if key[1] != "*" else "its kinds without a quota of their own"
                err = QuotaExceeded(f"author is over this node's quota for {what} ({lim.window_entries} "
                                    f"entries / {lim.window_bytes} bytes per {quota.window_s:g} s); "
                                    "refused for now", **where)
            elif len(t) + 1 > quota.author_entries or self._sums.get(total, 0) + size > quota.author_bytes:
                err = QuotaExceeded(f"author is over this node's budget per member ({quota.author_entries} entries / "
                                    f"{quota.author_bytes} bytes per {quota.window_s:g} s, all kinds); "
                                    "refused for now", **where)
        if err is not None:
            self.refused += 1
            if now - self._logged.get(e.author, -1e18) >= quota.window_s:  # once per window per author
                self._logged[e.author] = now
                log.warning("quota: refusing entries from the network: %s", err)
        return err

    def record(self, e: Entry, *, now: float | None = None, window_s: float = 60.0,
               quota: AuthorQuota | None = None) -> None:
        """Count a stored `e` in its windows (`quota`'s -- default: the last one `check` used --
        for which kinds share one)."""
        if e.kind in NEVER_LIMITED:
            return
        now = time.monotonic() if now is None else now
        self._records += 1
        if self._records % SWEEP_EVERY == 0:  # authors that went quiet: their windows are dropped
            for k in list(self._seen):
                self._window(k, now, window_s)
        size = len(e.payload) + len(e.sig)
        quota = quota or self._quota
        kind = e.kind if quota is None else quota.window_key(e.kind)
        for key in ((e.author, kind), (e.author, _BUDGET)):
            self._seen.setdefault(key, deque()).append((now, size))
            self._sums[key] = self._sums.get(key, 0) + size
