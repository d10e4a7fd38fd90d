"""`atd config set KEY VALUE`: one setting of config.toml, written only if its reader accepts it.

The value is parsed and checked against the key's declaration (`atdnode.node.config_schema`:
type, range, choices), written, and the file is loaded again (which checks every declared
key); then the part of atd that reads the section checks what one key cannot say alone (the
function the daemon calls at start: `PeerSetConfig.from_table` for peers.max >= target,
`addrs.check_listen` / `check_bootstrap`, `parse_device`, `NodeConfig.announce`, the model
card's `check_card`, the plans' `PlanPolicy.load`). On a refusal the old file is put
back, so a bad value changes nothing.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from atdnode.node.config import NodeConfig
from atdnode.node.config_schema import check_card, lookup, parse_value
from atdnode.errors import AtdError, ConfigError
from atdnode.node.home import NodeHome


def _check_listen(home: NodeHome) -> None:
    from atdnode.node.addrs import check_bootstrap, check_listen

    cfg = NodeConfig.load(home)
    for a in cfg.listen:
        check_listen(a, "listen")
    for a in cfg.bootstrap:
        check_bootstrap(a, "bootstrap")


def _check_peers(home: NodeHome) -> None:
    from atdnode.peers import PeerSetConfig

    PeerSetConfig.from_table(NodeConfig.load(home).extra.get("peers"))


def _check_network(home: NodeHome) -> None:
    NodeConfig.load(home).announce()


def _check_compute(home: NodeHome) -> None:
    from atdnode.learning import parse_device

    dev = NodeConfig.load(home).compute_device()
    if dev is not None:
        parse_device(dev)  # the form, and that this machine has it


def _check_card(home: NodeHome) -> None:
    check_card(NodeConfig.load(home).extra.get("card"))


def _check_plans(home: NodeHome) -> None:
    from atdnode.plans import PlanPolicy

    PlanPolicy.load(home)


def _check_quota(home: NodeHome) -> None:  # the window and the per-kind tables ([quota.KIND])
    from ledger import AuthorQuota

    try:
        AuthorQuota.from_table(NodeConfig.load(home).extra.get("quota"))
    except ValueError as exc:
        raise ConfigError(f"config: {exc}") from None


# what one key's declaration cannot say, checked by the part that reads the section ("" = top-level
# keys); each loads config.toml, which checks every declared key (atdnode.node.config_schema)
CHECKS: dict[str, Callable[[NodeHome], None]] = {
    "": _check_listen, "peers": _check_peers, "compute": _check_compute, "network": _check_network,
    "card": _check_card, "plans": _check_plans, "quota": _check_quota,
}


def set_key(home: NodeHome, path: str, text: str) -> Any:
    """`atd config set PATH VALUE`: parse VALUE with the key's type, write config.toml, run the
    reading part's own validation; on a refusal the old file is put back. Returns the value."""
    key = lookup(path)
    value = parse_value(key, text)
    cfg = NodeConfig.load(home)
    old = home.config_file.read_bytes()
    table, _, name = key.path.rpartition(".")
    if table:
        t = cfg.extra.setdefault(table, {})
        if not isinstance(t, dict):
            raise ConfigError(f"config: [{table}] must be a table")
        t[name] = value
    else:
        setattr(cfg, name, value)
    try:
        cfg.save(home)
        NodeConfig.load(home)
        CHECKS.get(table, lambda h: None)(home)
    except AtdError:  # ConfigError, DeviceError, ...: the reader refused it
        tmp = home.config_file.with_name(f".config.toml.old{os.getpid()}")
        tmp.write_bytes(old)
        os.replace(tmp, home.config_file)
        raise
    return value
