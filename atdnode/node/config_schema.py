"""Every setting of config.toml, with its default and how a value is read: one table.

`KEYS` lists each key once (`section.name`, or a top-level name) with the default its reader
uses when the key is absent (`tests/test_config_cmd.py` checks they agree with the readers);
`commented_defaults(present)` is the reference block every save of config.toml appends: every
section with the keys not set, their defaults commented out. `atdnode.node.config_set.set_key`
(`atd config set KEY VALUE`) parses a value with `parse_value` and has the reader validate it.
This module imports nothing of the readers, so `atdnode.node.config` can use it without a circle.
To add a setting: one `Key(...)` line here (and its reader's check in `atdnode.node.config_set.CHECKS`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from atdnode.errors import ConfigError


@dataclass(frozen=True)
class Key:
    path: str  # "listen" or "logs.max_bytes"
    type: type  # str | int | float | bool | list (of str)
    default: Any
    doc: str


KEYS: tuple[Key, ...] = (
    Key("name", str, "(the home folder's name)", "human-readable node name"),
    Key("role", str, "node", "role announced in hello (node, festa-server, ...)"),
    Key("listen", list, ["/ip4/127.0.0.1/tcp/0"], "libp2p multiaddrs to listen on (deploy/PORTS.md)"),
    Key("bootstrap", list, [], "full multiaddrs (.../p2p/<id>) of peers to dial at start"),
    Key("network.announce", list, [], "multiaddrs other sites dial (NAT / port forward; empty: the listen "
        "addresses, 0.0.0.0 as the host's interface addresses)"),
    Key("logs.max_bytes", int, 10 << 20, "rotate HOME/logs/*.log at this size (>= 1024)"),
    Key("logs.backups", int, 5, "rotated log files kept (0-100)"),
    Key("peers.target", int, 8, "peers the daemon keeps connected"),
    Key("peers.max", int, 16, "hard cap on connected peers (>= target)"),
    Key("peers.low_latency_share", float, 0.5, "share of dials that go to the fastest peers"),
    Key("peers.grace_s", float, 5.0, "a new connection is not pruned this long"),
    Key("peers.redial_after_s", float, 30.0, "a lost peer is not dialled again this soon"),
    Key("peers.rotate_s", float, 60.0, "one peer is swapped for a random member this often"),
    Key("peers.rotate_idle_s", float, 600.0, "... or this often while no dial fails and sync finds nothing new"),
    Key("peers.unreachable_after_s", float, 60.0, "a member whose dials fail this long is one WARNING line "
        "and a dashboard warning"),
    Key("bulk.enabled", bool, True, "encrypted TCP bulk channel for blobs (false: libp2p streams only)"),
    Key("bulk.port", int, 0, "bulk channel port (0: a fresh one per transfer)"),
    Key("models.max_bytes", int, 0, "remove the oldest unserved models above this many bytes (0: no limit)"),
    Key("aggregate.keep", str, "best", "after an aggregation the node uses: best (the consortium's model where it "
        "scores at least its own on its val data) or consortium"),
    Key("quota.author_entries", int, 12_000, "entries one member may add to this node's ledger per quota window "
        "(all kinds together; ledger.quota)"),
    Key("quota.author_bytes", int, 48 << 20, "bytes one member may add to this node's ledger per quota window "
        "(all kinds together)"),
    Key("compute.device", str, "(cuda when present, else cpu)", "device that runs models: cpu, cuda or cuda:N"),
    Key("card.intended_use", str, "", "model card: what the model is for, who uses it, on which patients (free text)"),
    Key("card.out_of_scope_use", str, "", "model card: uses it was not made or checked for (free text)"),
    Key("card.data_description", str, "", "model card: the training data in words: modality, sites, period, "
        "inclusion criteria (free text, never paths)"),
    Key("card.limitations", str, "", "model card: known limitations and failure modes the data owner adds"),
)
BY_PATH = {k.path: k for k in KEYS}
# tables config.toml may hold that another command owns (not set with `atd config set`)
OWNED_ELSEWHERE = {"split": "atd split configure"}


def parse_value(key: Key, text: str) -> Any:
    """VALUE as typed on a command line -> the TOML value of `key` (ConfigError if it is not one)."""
    try:
        if key.type is bool:
            low = text.strip().lower()
            if low not in ("true", "false", "yes", "no", "on", "off", "1", "0"):
                raise ValueError
            return low in ("true", "yes", "on", "1")
        if key.type is int:
            return int(text)
        if key.type is float:
            return float(text)
        if key.type is list:
            s = text.strip()
            if s.startswith("["):
                v = json.loads(s)
                if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                    raise ValueError
                return v
            return [x.strip() for x in s.split(",") if x.strip()]
        return text
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number",
                list: "a comma-separated list or a JSON list of strings"}.get(key.type, "a string")
        raise ConfigError(f"config {key.path}: {text!r} is not {kind}") from None


def lookup(path: str) -> Key:
    if path in BY_PATH:
        return BY_PATH[path]
    table = path.split(".", 1)[0]
    if table in OWNED_ELSEWHERE:
        raise ConfigError(f"config {path}: the [{table}] table is set with `{OWNED_ELSEWHERE[table]}`")
    import difflib

    near = difflib.get_close_matches(path, list(BY_PATH), n=1)
    raise ConfigError(f"config: unknown key {path!r}" + (f" (did you mean {near[0]}?)" if near else "")
                      + f"; known: {', '.join(BY_PATH)}")


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)  # strings and lists of strings: JSON and TOML agree


def commented_defaults(present: dict) -> str:
    """The reference block appended to config.toml: every key not set, its default commented."""
    lines = ["", "# --- every setting, with its default (uncomment to change, or `atd config set KEY VALUE`) ---"]
    section = None
    for k in KEYS:
        table, _, name = k.path.rpartition(".")
        have = present.get(table, {}) if table else present
        if isinstance(have, dict) and name in have:
            continue
        if table != section:
            section = table
            if table:
                lines += ["", f"# [{table}]"]
        default = k.default if not (isinstance(k.default, str) and k.default.startswith("(")) else None
        val = _toml(default) if default is not None else f'"..."  {k.default}'
        lines.append(f"# {name} = {val}    # {k.doc}")
    lines += ["", "# [split]    (split-learning server settings: `atd split configure`)", ""]
    return "\n".join(lines)
