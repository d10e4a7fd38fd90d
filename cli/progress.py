"""The CLI's progress: rich bars on stderr when it is a terminal, plain lines otherwise.

`bars()` installs a reporter for the library's `atdnode.progress` tasks for the duration of a
command, so every long step (averaging, features, fits, rounds, fetches) shows a bar with its
total. Outside a terminal (a log, a pipe, a service manager) commands that call
`bars(lines=True)` (`atd aggregate`, `atd classify`: a minute or more) print plain lines
instead (`LineReporter`: each step when it starts, every LINE_EVERY_S while it runs, and
when it ends, with the time taken); `--json` runs print none. ATD_PROGRESS=1 forces the
bars, ATD_PROGRESS=lines the lines, ATD_PROGRESS=0 turns both off.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from atdnode import progress


LINE_EVERY_S = 10.0  # a running step's line at most this often


def enabled(quiet: bool = False) -> bool:
    force = os.environ.get("ATD_PROGRESS")
    if force in ("0", "1", "lines"):
        return force == "1"
    return not quiet and sys.stderr.isatty()


def lines_enabled(quiet: bool = False) -> bool:
    """Plain progress lines for a command that asks for them, where no bar is drawn."""
    force = os.environ.get("ATD_PROGRESS")
    if force in ("0", "1", "lines"):
        return force == "lines"
    return not quiet and not sys.stderr.isatty()


class LineReporter:
    """`atdnode.progress.Reporter` as plain lines on stderr (module doc)."""

    def __init__(self, *, every: float = LINE_EVERY_S, clock=None) -> None:
        import time

        self.every, self.clock = every, clock or time.monotonic
        self._tasks: dict[int, list] = {}  # handle -> [description, unit, started, last line, completed, total]
        self._next = 0

    def _say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    @staticmethod
    def _amount(done: float, total: float | None, unit: str) -> str:
        if unit == "bytes":
            return f"{done / 1e6:.1f}" + (f" of {total / 1e6:.1f} MB" if total else " MB")
        return f"{done:g}" + (f"/{total:g}" if total else "")

    def start(self, description: str, total: float | None, unit: str) -> Any:
        handle, self._next = self._next, self._next + 1
        now = self.clock()
        self._tasks[handle] = [description, unit, now, now, 0.0, total]
        self._say(f"{description} ...")
        return handle

    def update(self, handle: Any, completed: float, total: float | None) -> None:
        t = self._tasks.get(handle)
        if t is None:
            return
        t[4], t[5] = completed, total
        now = self.clock()
        if now - t[3] >= self.every:
            t[3] = now
            self._say(f"{t[0]}: {self._amount(completed, total, t[1])} ({now - t[2]:.0f} s)")

    def finish(self, handle: Any) -> None:
        t = self._tasks.pop(handle, None)
        if t is not None:
            amount = f", {self._amount(t[4], t[5], t[1])}" if t[4] or t[5] else ""
            self._say(f"{t[0]}: done{amount} in {self.clock() - t[2]:.1f} s")


class RichReporter:
    """`atdnode.progress.Reporter` on one rich Progress (stderr)."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def start(self, description: str, total: float | None, unit: str) -> Any:
        return self.bar.add_task(description, total=total, unit=unit, note="")

    def note(self, handle: Any, text: str) -> None:
        self.bar.update(handle, note=text)

    def update(self, handle: Any, completed: float, total: float | None) -> None:
        self.bar.update(handle, completed=completed, total=total)

    def finish(self, handle: Any) -> None:
        t = next((task for task in self.bar.tasks if task.id == handle), None)
        if t is not None and t.total is not None and t.completed >= t.total:
            self.bar.stop_task(handle)


@contextmanager
def bars(quiet: bool = False, *, lines: bool = False) -> Iterator[None]:
    """Draw the library's progress tasks on stderr for the duration (when `enabled`); with
    `lines`, print them as plain lines where no bar is drawn (`lines_enabled`)."""
    if not enabled(quiet):
        if lines and lines_enabled(quiet):
            with progress.use(LineReporter()):
                yield
            return
        yield
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, ProgressColumn,
                               TextColumn, TimeElapsedColumn)

    class Amount(ProgressColumn):
        """Bytes as sizes, everything else as N/M."""

        def __init__(self) -> None:
            super().__init__()
            self.sizes, self.count = DownloadColumn(), MofNCompleteColumn()

        def render(self, task):
            return (self.sizes if task.fields.get("unit") == "bytes" else self.count).render(task)

    bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(), Amount(), TimeElapsedColumn(),
                   TextColumn("{task.fields[note]}", markup=False), console=Console(stderr=True), transient=False)
    with bar, progress.use(RichReporter(bar)):
        yield


def while_polling(fn, poll, *, interval: float = 0.25):
    """`fn()` in a worker thread while the calling thread runs `poll()` every `interval` s
    (to move a bar); `fn`'s result, or its exception re-raised here."""
    import threading

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    while th.is_alive():
        th.join(interval)
        poll()
    if "error" in box:
        raise box["error"]
    return box["result"]
