"""The layout of a node home directory — the one place that names its paths.

    HOME/
      node.key        Ed25519 private key, raw 32-byte seed, mode 0600 (ledger author + libp2p peer id)
      x25519.key      X25519 private key, raw 32 bytes, mode 0600 (features encrypted to this node)
      config.toml     node config (name, consortium genesis id, listen addrs, bootstrap, role)
      ledger.db       SQLite ledger (WAL)
      blobs/          content-addressed blob store (see atdnode.blobstore)
      models/         local model registry (see atdnode.registry)
      runs/           resumable training checkpoints
      features/       cached CLS features
      logs/           daemon logs
      control.sock    local control endpoint of a running daemon
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def control_socket(self) -> Path:
        return self.root / "control.sock"

    def is_initialised(self) -> bool:
        return self.key_file.exists() and self.config_file.exists()

    def require(self) -> "NodeHome":
        """Return self, or raise ConfigError when no node was initialised here."""
        if not self.is_initialised():
            raise ConfigError(f"no atd node at {self.root} (run `atd init --home {self.root}` first)")
        return self

    def make_dirs(self) -> None:
        for d in (self.root, self.blobs_dir, self.models_dir, self.runs_dir, self.features_dir, self.logs_dir):
            d.mkdir(parents=True, exist_ok=True)
