"""A node opened once: `NodeHandle` is a node home whose parts — its config, its ledger, its blob
store, its model registry — are each opened on first use and then kept for as long as the handle
lives, so one command opens each once however many library functions it walks through.

`open_node(home)` opens the node at `home` (which `atd init` made; ConfigError otherwise); the CLI
opens one per command (`cli.options.node_home`) and passes it down. A handle is a `NodeHome` (the
same paths), so it goes wherever a home goes; a function given a plain home works on a handle of
its own (`NodeHandle.of`), as before. `close()` (or leaving its `with` block) closes the ledger.

The blob store and the registry live in rooms above this one (atdnode.blobs, atdnode.models): each
keeps its part on the handle through `part` (`BlobStore.of(home)`, `ModelRegistry.of(home)`), so
the handle imports neither and the layering holds.
The config is read once: a command that changes config.toml (`atd config set`) reads it again
with `NodeConfig.load`.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from ledger import Ledger

from atdnode.node.config import NodeConfig
from atdnode.node.home import NodeHome

T = TypeVar("T")


class NodeHandle(NodeHome):
    """A node home with its parts opened once, on first use (see the module docstring)."""

    @classmethod
    def of(cls, home: NodeHome) -> "NodeHandle":
        """`home` itself when it is a handle, else a new handle on the same folder."""
        return home if isinstance(home, NodeHandle) else cls(home.root)

    @classmethod
    @contextmanager
    def using(cls, home: NodeHome) -> Iterator["NodeHandle"]:
        """`home`'s handle for a block: `home` itself when it is a handle (its owner closes it),
        else one opened for the block and closed after it."""
        if isinstance(home, NodeHandle):
            yield home
            return
        with cls(home.root) as node:
            yield node

    @cached_property
    def config(self) -> NodeConfig:
        """config.toml, loaded and checked once (ConfigError naming the key otherwise)."""
        return NodeConfig.load(self)

    @cached_property
    def ledger(self) -> Ledger:
        """The ledger, opened once; `close()` closes it."""
        return Ledger.open(self.ledger_db)

    def part(self, make: Callable[[NodeHome], T]) -> T:
        """What `make(self)` returns, made on the first call with this `make` and kept."""
        parts = self.__dict__.setdefault("_parts", {})
        if make not in parts:
            parts[make] = make(self)
        return parts[make]

    def close(self) -> None:
        """Close the ledger if it was opened (a later use opens it again)."""
        led = self.__dict__.pop("ledger", None)
        if led is not None:
            led.close()

    def __enter__(self) -> "NodeHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __eq__(self, other: object) -> bool:  # the same node as a plain home on the same folder
        return isinstance(other, NodeHome) and other.root == self.root

    __hash__ = NodeHome.__hash__  # equal to the plain home: the same hash

    def __reduce__(self):  # the folder travels (to a DDP rank, a worker process), never open parts
        return (type(self), (self.root,))


def open_node(home: str | Path | NodeHome) -> NodeHandle:
    """The node at `home` (ConfigError, one line, when `atd init` made none there), opened once."""
    return NodeHandle.at(home.root if isinstance(home, NodeHome) else home).require()
