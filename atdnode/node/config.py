"""`NodeConfig`: the node's settings in HOME/config.toml (read with tomllib, written with tomli_w).

Unknown keys are kept in `extra` and written back unchanged, so other parts can add
settings without this module knowing them. None values are omitted from the file.
Every save appends a commented reference of the settings not set, with their defaults
(`atdnode.node.config_schema`); `atdnode.node.config_set.set_key` is `atd config set`.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

import tomli_w

from atdnode.errors import ConfigError
from atdnode.node.config_schema import check_tables, commented_defaults, value_in
from atdnode.node.home import NodeHome

DEFAULT_LISTEN = ["/ip4/127.0.0.1/tcp/0"]
_KNOWN = ("name", "genesis_id", "consortium", "listen", "bootstrap", "role")


@dataclass
class NodeConfig:
    name: str = "node"
    genesis_id: str | None = None  # hex id of the consortium's genesis entry
    consortium: str | None = None  # the consortium name (founders know it at init; joiners learn it)
    listen: list[str] = field(default_factory=lambda: list(DEFAULT_LISTEN))
    bootstrap: list[str] = field(default_factory=list)
    role: str = "node"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ConfigError naming the first field with a wrong type or value."""
        for key in ("name", "role"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ConfigError(f"config: {key} must be a non-empty string")
        for key in ("genesis_id", "consortium"):
            v = getattr(self, key)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"config: {key} must be a string")
        if self.genesis_id is not None:
            try:
                ok = len(bytes.fromhex(self.genesis_id)) == 32
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError("config: genesis_id must be 64 hex digits")
        for key in ("listen", "bootstrap"):
            v = getattr(self, key)
            if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
                raise ConfigError(f"config: {key} must be a list of multiaddr strings")
        if not isinstance(self.extra, dict):
            raise ConfigError("config: extra must be a table")
        check_tables(self.to_dict())  # every declared setting: its type and range (config_schema)

    def setting(self, path: str) -> Any:
        """The value of the declared setting `path` ("logs.max_bytes"), or its default; checked
        when this config was made (`atdnode.node.config_schema.KEYS`)."""
        return value_in(self.to_dict(), path)

    def bulk_options(self) -> dict[str, Any]:
        """The `[bulk]` table: `enabled` (default true: encrypted TCP bulk channel for blobs;
        false: blobs move over libp2p streams only) and `port` (default 0: a fresh port per
        transfer; fixed: one transfer at a time on it). Keyword arguments of BlobService."""
        return {"bulk": self.setting("bulk.enabled"), "bulk_port": self.setting("bulk.port")}

    def announce(self) -> list[str]:
        """`[network] announce`: the multiaddrs other members dial (`atdnode.node.advertise`);
        empty: the listen addresses, an unspecified one expanded to the host's interfaces."""
        from atdnode.node.addrs import check_announce

        return [check_announce(a, "config network.announce") for a in self.setting("network.announce")]

    def compute_device(self) -> str | None:
        """The `[compute]` table's `device` (`cpu`, `cuda` or `cuda:N`; absent: None, meaning
        CUDA when present). Checked and turned into a torch.device by atdnode.learning.device."""
        return self.setting("compute.device")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        for key in _KNOWN:
            v = getattr(self, key)
            if v is not None:
                d[key] = v
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NodeConfig":
        known = {k: d[k] for k in _KNOWN if k in d}
        extra = {k: v for k, v in d.items() if k not in _KNOWN}
        return cls(**known, extra=extra)

    @classmethod
    def load(cls, home: NodeHome) -> "NodeConfig":
        try:
            with open(home.config_file, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{home.config_file} is missing (run `atd init --home {home.root}` first)") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{home.config_file} is not valid TOML: {exc}") from None
        return cls.from_dict(data)

    def save(self, home: NodeHome) -> None:
        """Write config.toml atomically (temp file + rename)."""
        self.validate()
        home.root.mkdir(parents=True, exist_ok=True)
        tmp = home.config_file.with_name(f".config.toml.tmp{os.getpid()}")

        data = self.to_dict()
        with open(tmp, "wb") as f:
            tomli_w.dump(data, f)
            f.write(commented_defaults(data).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, home.config_file)

