"""A room's public face, loaded on first use (PEP 562).

Each sub-package of `atdnode` (a room) lists in its `__init__` the names other rooms, the CLI
and netsim may import from it, as a table ``name -> "module"`` (the name as the module defines
it), ``name -> "module:attr"`` (a face name for an attribute whose own name would be
ambiguous at the face, or would be shadowed by a submodule of that name), or
``name -> "module:"`` (the module itself, for one used as a namespace: ``control.request``). ``from atdnode.blobs import BlobStore`` then imports
`atdnode.blobs.store` when first asked: importing a face costs nothing (no torch, no import
circle between rooms whose modules do not form one). `tests/test_layering.py` checks every
table entry resolves and that code outside a room imports only its face.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_face(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for the package `package` whose face is `table`."""

    def __getattr__(name: str) -> Any:
        spec = table.get(name)
        if spec is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attr = spec.partition(":")
        value = importlib.import_module(f"{package}.{module}")
        if not spec.endswith(":"):
            value = getattr(value, attr or name)
        setattr(sys.modules[package], name, value)  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(table) | set(vars(sys.modules[package])))

    return __getattr__, __dir__
