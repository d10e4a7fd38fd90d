"""The layout of a node home directory — the one place that names its paths.

    HOME/
      node.key        Ed25519 private key, raw 32-byte seed, mode 0600 (ledger author + libp2p peer id)
      x25519.key      X25519 private key, raw 32 bytes, mode 0600 (features encrypted to this node)
      config.toml     node config (name, consortium genesis id, listen addrs, bootstrap, role)
      ledger.db       SQLite ledger (WAL)
      blobs/          content-addressed blob store (see atdnode.blobs.store)
      models/         local model registry (see atdnode.models.registry)
      runs/           resumable training checkpoints
      features/       cached CLS features
      cache/          other results kept to skip recomputing them (atdnode.aggregation.own_raw_index)
      logs/           daemon logs
      control.sock    local control endpoint of a running daemon
      daemon.lock     held (flock) by the running daemon: one daemon per home

Everything in a home is private to its owner: the home and its directories are 0700, its
files 0600 (other local users could otherwise read the ledger, models and training data).
`make_dirs` and `require` set the process umask to 0o077 so that whatever the process
creates afterwards (SQLite's ledger.db and its -wal/-shm files, config.toml, models/,
runs/, blobs, logs) gets these modes, and tighten what an older version left readable.
"""
from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from atdnode.errors import ConfigError


@dataclass(frozen=True)
class NodeHome:
    root: Path

    @classmethod
    def at(cls, root: str | Path) -> "NodeHome":
        return cls(Path(root).expanduser().resolve())

    @property
    def key_file(self) -> Path:
        return self.root / "node.key"

    @property
    def x25519_key_file(self) -> Path:
        return self.root / "x25519.key"

    @property
    def config_file(self) -> Path:
        return self.root / "config.toml"

    @property
    def ledger_db(self) -> Path:
        return self.root / "ledger.db"

    @property
    def blobs_dir(self) -> Path:
        return self.root / "blobs"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def features_dir(self) -> Path:
        return self.root / "features"

    @property
    def cache_dir(self) -> Path:
        return self.root / "cache"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def control_socket(self) -> Path:
        return self.root / "control.sock"

    @property
    def announced_file(self) -> Path:
        """The seq up to which the daemon gossiped this node's own entries (atdnode.node.daemon)."""
        return self.root / "announced"

    def is_initialised(self) -> bool:
        return self.key_file.exists() and self.config_file.exists()

    def require(self) -> "NodeHome":
        """Return self, or raise ConfigError when no node was initialised here."""
        if not self.is_initialised():
            raise ConfigError(f"no atd node at {self.root} (run `atd init --home {self.root}` first)")
        self.make_private()
        return self

    def make_dirs(self) -> None:
        private_umask()
        for d in (self.root, self.blobs_dir, self.models_dir, self.runs_dir, self.features_dir, self.logs_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.make_private()

    def make_private(self) -> None:
        """umask 0o077 for this process; the home 0700 and its top-level entries 0700 / 0600.
        (The home's own mode alone keeps other users out of everything below it.)"""
        private_umask()
        _tighten(self.root, 0o700)
        try:
            children = list(self.root.iterdir())
        except OSError:
            return
        for p in children:
            _tighten(p, 0o700 if p.is_dir() and not p.is_symlink() else 0o600)


def private_umask() -> None:
    """Files and directories this process creates from now on are private to its user."""
    os.umask(os.umask(0o077) | 0o077)


def _tighten(path: Path, mode: int) -> None:
    try:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode) or stat.S_ISSOCK(st.st_mode):
            return
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, stat.S_IMODE(st.st_mode) & mode)
    except OSError:
        pass


@contextmanager
def home_lock(home: NodeHome) -> Iterator[None]:
    """Hold HOME/daemon.lock exclusively (flock) for the block; DaemonError if another
    process holds it. The kernel drops the lock when its holder dies, so no stale state."""
    import fcntl

    from atdnode.errors import DaemonError

    path = home.root / "daemon.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            raise DaemonError(f"a daemon already runs for {home.root}" + (f" (pid {holder})" if holder else "")) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
