"""Trying again later: one exponential back-off for every loop that dials, fetches or asks again.

`Backoff(base, cap)` keeps, per key (a peer, a blob, a server), the failures in a row: the
n-th one blocks the key for ``base * 2**(n-1)`` seconds, at most `cap` (a per-failure `cap`
and `at_least` adjust one failure, e.g. a shorter cap while joining, a longer floor after a
disk error); a success (`clear`) starts the next episode at `base` again. Time is whatever
clock the caller passes (`trio.current_time()` in the daemon, a number in tests), so the
policy is tested without waiting.

`retry(attempt, ...)` is the loop for one operation: call it until it succeeds, sleeping the
back-off's waits between failures, and re-raise the last failure once the next wait would end
past the deadline (Flower's `RetryInvoker` is the model: one policy, written once).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class Backoff:
    """Per-key exponential back-off (see the module docstring)."""

    def __init__(self, base: float, cap: float) -> None:
        self.base, self.cap = base, cap
        self._state: dict[str, tuple[float, float]] = {}  # key -> (blocked until, last delay)

    def fail(self, key: str, now: float, cap: float | None = None, *, at_least: float = 0.0) -> float:
        """Record a failure of `key` at `now`; returns the delay it is now blocked for."""
        limit = self.cap if cap is None else cap
        prev = self._state.get(key, (0.0, 0.0))[1]
        delay = min(max(limit, at_least), max(at_least, self.base if prev <= 0 else prev * 2))
        self._state[key] = (now + delay, delay)
        return delay

    def blocked(self, key: str, now: float) -> bool:
        state = self._state.get(key)
        return state is not None and now < state[0]

    def until(self, key: str, default: float) -> float:
        """When `key`'s current wait ends (`default` for a key without failures)."""
        state = self._state.get(key)
        return default if state is None else state[0]

    def clear(self, key: str | None = None) -> None:
        """Forget `key`'s failures (every key's with None)."""
        if key is None:
            self._state.clear()
        else:
            self._state.pop(key, None)

    def __contains__(self, key: str) -> bool:
        return key in self._state


async def retry(attempt: Callable[[], Awaitable[T]], *, base: float, cap: float, deadline: float,
                retry_on: tuple[type[BaseException], ...]) -> T:
    """`await attempt()` until it returns, waiting `base`, 2*`base`, ... (at most `cap`) s
    after each failure of a `retry_on` type; the last failure is re-raised when the next wait
    would end past `deadline` (trio time)."""
    import trio

    waits = Backoff(base, cap)
    while True:
        try:
            return await attempt()
        except retry_on:
            now = trio.current_time()
            delay = waits.fail("", now)
            if now + delay > deadline:
                raise
        await trio.sleep(delay)
