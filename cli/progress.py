"""The CLI's progress bars: rich on stderr, drawn only when stderr is a terminal.

`bars()` installs a reporter for the library's `atdnode.progress` tasks for the duration of a
command, so every long step (averaging, features, fits, rounds, fetches) shows a bar with its
total; pipes, `--json` runs and tests get none (set ATD_PROGRESS=1 to force the bars,
ATD_PROGRESS=0 to turn them off).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from atdnode import progress


def enabled(quiet: bool = False) -> bool:
    force = os.environ.get("ATD_PROGRESS")
    if force in ("0", "1"):
        return force == "1"
    return not quiet and sys.stderr.isatty()


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
def bars(quiet: bool = False) -> Iterator[None]:
    """Draw the library's progress tasks on stderr for the duration (when `enabled`)."""
    if not enabled(quiet):
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
