"""Log files in the node home, rotated by size.

`setup_logging(home, "daemon")` sends the root logger to HOME/logs/daemon.log through a
`RotatingFileHandler`: when the file passes `max_bytes` it becomes daemon.log.1 (the
older ones shift up to `.backups`) and a new one starts, so a long-running node keeps at
most (backups + 1) x max_bytes of logs. Both come from the `[logs]` table of
config.toml::

    [logs]
    max_bytes = 10485760   # 10 MiB per file
    backups = 5
"""
from __future__ import annotations

import logging
import logging.handlers
import os
import sys

from atdnode.node.home import NodeHome

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_limits(home: NodeHome) -> tuple[int, int]:
    """(max_bytes, backups) from config.toml's [logs] table (defaults when absent)."""
    from atdnode.node.handle import NodeHandle

    cfg = NodeHandle.of(home).config  # checks both (atdnode.node.config_schema)
    return cfg.setting("logs.max_bytes"), cfg.setting("logs.backups")


def file_handler(home: NodeHome, name: str) -> logging.Handler:
    """A size-rotating handler for HOME/logs/<name>.log with the node's limits."""
    max_bytes, backups = log_limits(home)
    home.logs_dir.mkdir(parents=True, exist_ok=True)
    h = logging.handlers.RotatingFileHandler(home.logs_dir / f"{name}.log", maxBytes=max_bytes,
                                             backupCount=backups, encoding="utf-8")
    h.setFormatter(logging.Formatter(FORMAT))
    return h


def setup_logging(home: NodeHome, name: str, *, verbose: bool = False, stderr: bool = True) -> None:
    """Root logger -> HOME/logs/<name>.log (rotating) and, unless `stderr` is False, stderr."""
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    handlers = [file_handler(home, name)]
    if stderr:
        s = logging.StreamHandler(sys.stderr)
        s.setFormatter(logging.Formatter(FORMAT))
        handlers.append(s)
    for h in handlers:
        root.addHandler(h)
    # py-libp2p is chatty at INFO; keep its warnings.
    for lib in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(lib).setLevel(logging.WARNING)


SKLEARN_LOGGER = "atd.sklearn"
_shown = {"orig": None}


def _from_sklearn(category: type, filename: str) -> bool:
    return getattr(category, "__module__", "").startswith("sklearn") or f"{os.sep}sklearn{os.sep}" in str(filename)


def _route_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if _from_sklearn(category, filename):
        logging.getLogger(SKLEARN_LOGGER).warning("%s: %s (%s:%s)", category.__name__, message, filename, lineno)
    else:
        _shown["orig"](message, category, filename, lineno, file, line)


def sklearn_warnings_to_log(home: NodeHome | None = None, name: str = "cli") -> logging.Logger:
    """scikit-learn's warnings (ConvergenceWarning, UndefinedMetricWarning, ...) go to the log,
    never to stderr: HOME/logs/<name>.log when `home` is given (a command), else the root
    logger's handlers (the daemon's log). Other warnings are shown as before. Idempotent."""
    import warnings

    log = logging.getLogger(SKLEARN_LOGGER)
    if warnings.showwarning is not _route_warning:
        _shown["orig"] = warnings.showwarning
        warnings.showwarning = _route_warning
    if not log.handlers:
        log.addHandler(logging.NullHandler())  # never Python's last-resort handler (stderr)
    if home is not None:
        target = str(home.logs_dir / f"{name}.log")
        if not any(getattr(h, "baseFilename", None) == target for h in log.handlers):
            log.addHandler(file_handler(home, name))
        log.propagate = False
    return log
