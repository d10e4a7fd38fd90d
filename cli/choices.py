"""Choice options: an option whose value is one of a fixed set of names is an enumeration.

`choice(name, names)` makes that enumeration from the registry that defines the names
(`protocols.weightings`, `netsim.scenario_choices`, `atdnode.split`'s settings, ...), so
`--help` lists the choices (`--mode <horizontal|vertical|hierarchical>`) and any other value
is a one-line usage error naming them, before the command runs. Members are strings
(`StrEnum`): the library, the ledger and JSON take them as the names they are. The CLI reads
only registries that load neither torch nor numpy (`cli.app` loads neither at start-up;
tests/test_module_shape.py). What one option cannot say alone (a weighting that applies to
some modes only) stays a cross-check of the command, one line.
"""
from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class Choice(StrEnum):
    """A member reads as its name everywhere: str(), format(), repr(), ==, JSON, and pickles
    as the plain string (a worker process needs no enumeration made at run time)."""

    def __repr__(self) -> str:
        return repr(self.value)

    def __reduce_ex__(self, protocol):
        return str, (self.value,)


def choice(name: str, names: Iterable[str]) -> type[Choice]:
    """The enumeration `name` of `names`, in their order (a registry dict gives its keys)."""
    return Choice(name, {n: n for n in names}, module=__name__)
