"""What the data owner says on the model card, in words (`[card]` of config.toml).

`card_statement(home)` reads the free-text fields of `[card]` (intended use, out-of-scope
use, data description, limitations), checked by `atdnode.node.config_schema.check_card`
(the settings' own rules, which `atd config set` also applies): a card is shown to
outsiders, so a field that is not a string, is too long, or holds what looks like a local
file path is refused (ConfigError naming the key): the data is described, never located.
"""
from __future__ import annotations

from atdnode.node import NodeHome, check_card


def card_statement(home: NodeHome) -> dict[str, str]:
    """`check_card` of this node's `[card]` table: {field: text}, "" when unset."""
    from atdnode.node import NodeConfig

    return check_card(NodeConfig.load(home).extra.get("card"))
