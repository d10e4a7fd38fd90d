"""What the data owner says on the model card, in words (`[card]` of config.toml).

`card_statement(home)` reads the free-text fields of `[card]` (`atdnode.node.config_schema`:
intended use, out-of-scope use, data description, limitations). A card is shown to
outsiders, so a field is refused (ConfigError naming the key) when it is not a string, is
longer than `MAX_CHARS`, or holds what looks like a local file path (`/...`, `~/...`,
`C:\\...`): the data is described, never located.
"""
from __future__ import annotations

import re

from atdnode.errors import ConfigError
from atdnode.node import NodeHome

FIELDS = ("intended_use", "out_of_scope_use", "data_description", "limitations")
MAX_CHARS = 4000
_PATH = re.compile(r"(?:^|[\s(\"'])(?:~?/[\w.-]+/|[A-Za-z]:\\)")


def check_statement(table: object) -> dict[str, str]:
    """The `[card]` table checked (see the module docstring): {field: text}, "" when unset."""
    if table is None:
        table = {}
    if not isinstance(table, dict):
        raise ConfigError("config: [card] must be a table")
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise ConfigError(f"config: unknown key card.{unknown[0]} (known: {', '.join(FIELDS)})")
    out = {}
    for f in FIELDS:
        v = table.get(f, "")
        if not isinstance(v, str):
            raise ConfigError(f"config: card.{f} must be text, got {type(v).__name__}")
        if len(v) > MAX_CHARS:
            raise ConfigError(f"config: card.{f} is {len(v)} characters (at most {MAX_CHARS})")
        if _PATH.search(v):
            raise ConfigError(f"config: card.{f} names a file path; the card describes the data, never where it is")
        out[f] = v.strip()
    return out


def card_statement(home: NodeHome) -> dict[str, str]:
    """`check_statement` of this node's `[card]` table."""
    from atdnode.node import NodeConfig

    return check_statement(NodeConfig.load(home).extra.get("card"))
