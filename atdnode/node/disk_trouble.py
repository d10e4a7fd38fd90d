"""One log line per episode of disk trouble, then a back-off (never a traceback or a hot loop).

Shared by every daemon loop that writes (gossip merges, sync pulls, hello appends, held-entry
expiry, blob fetches): `await trouble("merging gossip", exc)` logs ERROR once per episode (an
episode ends after 60 s without trouble), counts `stats["disk_errors"]` and sleeps 5 s.
"""
from __future__ import annotations

import errno
import logging

import trio

log = logging.getLogger("atd.daemon")

EPISODE_S = 60.0  # trouble within this long of the last one is the same episode (no new line)
BACKOFF_S = 5.0  # the caller waits this long before its next try


class DiskTrouble:
    """Rate-limited reporting of disk errors for one daemon; counts into the shared `stats`."""

    def __init__(self, stats: dict[str, int]) -> None:
        self.stats = stats
        self._quiet_until = 0.0

    async def __call__(self, what: str, exc: BaseException) -> None:
        now = trio.current_time()
        full = getattr(exc, "errno", None) == errno.ENOSPC or "full" in str(exc).lower()
        if now >= self._quiet_until:
            log.error("%s failed: %s%s; backing off", what, "disk full" if full else "disk error",
                      f" ({str(exc)[:120]})" if not full else "")
        self._quiet_until = now + EPISODE_S
        self.stats["disk_errors"] = self.stats.get("disk_errors", 0) + 1
        await trio.sleep(BACKOFF_S)
