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
import sys

from atdnode.errors import ConfigError
from atdnode.home import NodeHome

DEFAULT_MAX_BYTES = 10 << 20
DEFAULT_BACKUPS = 5
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_limits(home: NodeHome) -> tuple[int, int]:
    """(max_bytes, backups) from config.toml's [logs] table (defaults when absent)."""
    from atdnode.config import NodeConfig

    table = NodeConfig.load(home).extra.get("logs", {})
    if not isinstance(table, dict):
        raise ConfigError("config: [logs] must be a table")
    max_bytes = table.get("max_bytes", DEFAULT_MAX_BYTES)
    backups = table.get("backups", DEFAULT_BACKUPS)
    if type(max_bytes) is not int or max_bytes < 1024:
        raise ConfigError("config: logs.max_bytes must be an integer >= 1024")
    if type(backups) is not int or not 0 <= backups <= 100:
        raise ConfigError("config: logs.backups must be an integer from 0 to 100")
    return max_bytes, backups


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
