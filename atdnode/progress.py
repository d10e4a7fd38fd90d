"""Progress of long steps: reported by library code, drawn by whoever runs it.

Library code says what it is doing and how much there is::

    with progress.task("averaging weight sets", total=len(blobs)) as t:
        for b in blobs:
            ...
            t.advance()

Nothing is drawn unless a front end installed a reporter (`progress.use(reporter)`): the
CLI installs a rich bar on stderr when stderr is a terminal (`cli.progress`); the daemon,
netsim and tests install nothing, so the calls cost a function call each. A reporter is
any object with `start(description, total, unit) -> handle`, `update(handle, completed,
total)` and `finish(handle)`, and optionally `note(handle, text)` (a short status such as a
running loss, shown beside the task's bar). The total is part of the contract: a task that advances past its
total is a bug (`tests/test_progress.py` runs the library's tasks under a reporter that
checks it).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Protocol


class Reporter(Protocol):
    def start(self, description: str, total: float | None, unit: str) -> Any: ...

    def update(self, handle: Any, completed: float, total: float | None) -> None: ...

    def finish(self, handle: Any) -> None: ...


_lock = threading.Lock()
_reporter: Reporter | None = None


class Task:
    """One reported step; `advance(n)` / `update(completed)` from any thread."""

    __slots__ = ("_rep", "_handle", "completed", "total")

    def __init__(self, rep: Reporter | None, handle: Any, total: float | None) -> None:
        self._rep, self._handle, self.completed, self.total = rep, handle, 0.0, total

    def note(self, text: str) -> None:
        """A short status for the task (e.g. `loss 0.41`), where the reporter shows one."""
        if self._rep is not None and hasattr(self._rep, "note"):
            self._rep.note(self._handle, text)

    def advance(self, n: float = 1) -> None:
        self.update(self.completed + n)

    def update(self, completed: float, total: float | None = None) -> None:
        """Set the amount done (and, once it is known, the total)."""
        self.completed = completed
        if total is not None:
            self.total = total
        if self._rep is not None:
            self._rep.update(self._handle, completed, self.total)


@contextmanager
def task(description: str, total: float | None, *, unit: str = "") -> Iterator[Task]:
    """Report one step of `total` units (None: unknown); the handle is finished on exit."""
    rep = _reporter
    handle = rep.start(description, total, unit) if rep is not None else None
    t = Task(rep, handle, total)
    try:
        yield t
    finally:
        if rep is not None:
            rep.finish(handle)


def active() -> bool:
    """True while a reporter is installed (a step may skip work that only feeds a bar)."""
    return _reporter is not None


@contextmanager
def use(reporter: Reporter | None) -> Iterator[None]:
    """Install `reporter` for the duration (process-wide: one front end per process)."""
    global _reporter
    with _lock:
        prev, _reporter = _reporter, reporter
    try:
        yield
    finally:
        with _lock:
            _reporter = prev


class RunEta:
    """The remaining time of a run of `epochs` epochs of `per_epoch` units each, from the
    rate so far (monotonic clock): `advance(n)` counts units done and returns the text shown
    beside a progress bar ("run ETA 2m 10s"); `epoch_done()` marks an epoch finished."""

    def __init__(self, *, epochs: int, per_epoch: int, clock=None) -> None:
        import time

        self._clock = clock or time.monotonic
        self.total = max(0, epochs) * max(0, per_epoch)
        self.per_epoch = max(0, per_epoch)
        self.done = 0
        self.epochs = 0
        self.t0 = self._clock()

    def advance(self, n: int) -> str:
        self.done = min(self.total, self.done + n)
        return self.text()

    def epoch_done(self) -> None:
        self.epochs += 1
        self.done = min(self.total, self.epochs * self.per_epoch)

    def remaining_s(self) -> float | None:
        """Seconds left at the rate so far; None before any unit is done."""
        if self.done <= 0:
            return None
        return (self._clock() - self.t0) / self.done * (self.total - self.done)

    def text(self) -> str:
        left = self.remaining_s()
        if left is None:
            return "run ETA ..."
        m, s = divmod(int(round(left)), 60)
        h, m = divmod(m, 60)
        return "run ETA " + (f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s" if m else f"{s}s")
