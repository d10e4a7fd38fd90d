"""A warning that can repeat many times is logged once, then counted.

`warn_once(logger, key, text)`: the first call for `key` in this process logs `text` at
WARNING with a note that repeats are counted; later calls log at DEBUG and are counted; a
WARNING with the count since the last one is logged at most every `EVERY_S` seconds, and
once more when the process exits (if any were counted since). `counts()` gives the totals.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time

EVERY_S = 600.0

_lock = threading.Lock()
_state: dict[str, dict] = {}  # key -> {"total", "pending", "last", "logger", "text"}


def warn_once(logger: logging.Logger, key: str, text: str, *, clock=time.monotonic) -> None:
    now = clock()
    with _lock:
        st = _state.get(key)
        if st is None:
            _state[key] = {"total": 1, "pending": 0, "last": now, "logger": logger, "text": text}
            first, summary = True, 0
        else:
            st["total"] += 1
            st["pending"] += 1
            first = False
            summary = st["pending"] if now - st["last"] >= EVERY_S else 0
            if summary:
                st["pending"], st["last"] = 0, now
    if first:
        logger.warning("%s (further warnings like it are counted, not repeated)", text)
        return
    logger.debug("%s", text)
    if summary:
        logger.warning("%s: %d more like it (%d in all)", key, summary, _state[key]["total"])


def counts() -> dict[str, int]:
    with _lock:
        return {k: v["total"] for k, v in _state.items()}


def _flush() -> None:
    with _lock:
        pending = [(k, v) for k, v in _state.items() if v["pending"]]
    for key, st in pending:
        try:
            st["logger"].warning("%s: %d more like it (%d in all)", key, st["pending"], st["total"])
        except Exception:  # noqa: BLE001 - logging torn down at exit: nothing left to tell
            pass


atexit.register(_flush)
