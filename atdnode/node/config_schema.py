"""Every setting of config.toml, declared once: its type, default, range or choices, and help.

`KEYS` lists each key once (`section.name`, or a top-level name). From that one declaration:
`NodeConfig.load` checks every declared key a config.toml holds (`check_tables`: a one-line
ConfigError naming the key and what it must be), `NodeConfig.setting(path)` reads a value or
its default, `atd config set KEY VALUE` parses and checks a value (`parse_value`,
`check_value`), `commented_defaults` writes the reference block every save appends, and
`doc_lines` is the table in INTERFACES.md. What one key cannot say alone (peers.max >= target,
a listen address that parses, a CUDA device this machine has) stays with the part that reads
it, run by `atdnode.node.config_set.CHECKS`; `[card]`'s free text is checked here (`check_card`).
This module imports nothing of the readers. netsim declares its scenario keys as `Key`s too
(`netsim.scenario_spec`) and checks them with `problem`: one rule language for both files.

To add a setting: one `Key(...)` line here, then read it with `NodeConfig.setting("table.key")`.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any

from atdnode.errors import ConfigError


@dataclass(frozen=True)
class Key:
    """One declared setting. Also the declaration of a netsim scenario key (`netsim.scenario_spec`
    builds its keys as these and checks them with `problem`): one rule language for both files."""

    path: str  # "listen" or "logs.max_bytes"
    type: type  # str | int | float | bool | list
    default: Any
    doc: str
    low: float | None = None  # int / float: the smallest value allowed; list: the fewest items
    high: float | None = None  # ... and the largest; list: the most items
    choices: tuple[str, ...] = ()  # str (or each item of a list): the values allowed (empty: any)
    blank: bool = False  # str: free text, "" allowed (unset)
    above: float | None = None  # int / float: the value must be greater than this
    below: float | None = None  # ... and less than this
    item: type = str  # list: the type of its items (str, int or float)
    nested: bool = False  # list: a list of non-empty lists of `item`

    @property
    def placeholder(self) -> bool:
        """The default is a description, not a value ("(cuda when present, else cpu)")."""
        return isinstance(self.default, str) and self.default.startswith("(")

    def rule(self) -> str:
        """What a value must be, as a phrase: "an integer from 0 to 100"."""
        if self.type is list:
            what = ("names from " + ", ".join(self.choices) if self.choices
                    else {str: "strings", int: "integers", float: "numbers"}[self.item])
            kind = f"a list of lists of {what}" if self.nested else f"a list of {what}"
            if self.low is not None and self.high is not None:
                return f"{kind} ({self.low:g} to {self.high:g} of them)"
            return f"{kind} (at least {self.low:g})" if self.low is not None else kind
        if self.choices:
            return "one of " + ", ".join(self.choices)
        kind = {bool: "true or false", int: "an integer", float: "a number",
                str: "text" if self.blank else "a non-empty string"}[self.type]
        if self.low is not None and self.high is not None:
            return f"{kind} from {self.low:g} to {self.high:g}"
        bounds = [f"{op} {v:g}" for op, v in ((">=", self.low), (">", self.above), ("<=", self.high),
                                               ("<", self.below)) if v is not None]
        return f"{kind} {' and '.join(bounds)}" if bounds else kind

    def shown_default(self) -> str:
        """The default as the settings tables show it: a TOML value, or the description."""
        return self.default[1:-1] if self.placeholder else f"`{_toml(self.default)}`"


KEYS: tuple[Key, ...] = (
    Key("name", str, "(the home folder's name)", "human-readable node name"),
    Key("role", str, "node", "role announced in hello (node, festa-server, pfesta-server, msd-server)"),
    Key("listen", list, ["/ip4/127.0.0.1/tcp/0"], "libp2p multiaddrs to listen on (deploy/PORTS.md)"),
    Key("bootstrap", list, [], "full multiaddrs (.../p2p/<id>) of peers to dial at start"),
    Key("network.announce", list, [], "multiaddrs other sites dial (NAT / port forward; empty: the listen "
        "addresses, 0.0.0.0 as the host's interface addresses)"),
    Key("logs.max_bytes", int, 10 << 20, "rotate HOME/logs/*.log at this size", low=1024),
    Key("logs.backups", int, 5, "rotated log files kept", low=0, high=100),
    Key("peers.target", int, 8, "peers the daemon keeps connected", low=1),
    Key("peers.max", int, 16, "hard cap on connected peers (>= target)", low=1),
    Key("peers.low_latency_share", float, 0.5, "share of dials that go to the fastest peers", low=0, high=1),
    Key("peers.grace_s", float, 5.0, "a new connection is not pruned this long", low=0),
    Key("peers.redial_after_s", float, 30.0, "a lost peer is not dialled again this soon", low=0),
    Key("peers.rotate_s", float, 60.0, "one peer is swapped for a random member this often", low=0),
    Key("peers.rotate_idle_s", float, 600.0, "... or this often while no dial fails and sync finds nothing new",
        low=0),
    Key("peers.unreachable_after_s", float, 60.0, "a member whose dials fail this long is one WARNING line "
        "and a dashboard warning", low=0),
    Key("bulk.enabled", bool, True, "encrypted TCP bulk channel for blobs (false: libp2p streams only)"),
    Key("bulk.port", int, 0, "bulk channel port (0: a fresh one per transfer)", low=0, high=65535),
    Key("models.max_bytes", int, 0, "remove the oldest unserved models above this many bytes (0: no limit)",
        low=0),
    Key("aggregate.keep", str, "best", "after an aggregation the node uses: best (the consortium's model where it "
        "scores at least its own on its val data) or consortium", choices=("best", "consortium")),
    Key("quota.author_entries", int, 12_000, "entries one member may add to this node's ledger per quota window "
        "(all kinds together; ledger.quota)", low=1),
    Key("quota.author_bytes", int, 48 << 20, "bytes one member may add to this node's ledger per quota window "
        "(all kinds together)", low=1),
    Key("compute.device", str, "(cuda when present, else cpu)", "device that runs models: cpu, cuda or cuda:N"),
    Key("card.intended_use", str, "", "model card: what the model is for, who uses it, on which patients (free text)",
        blank=True),
    Key("card.out_of_scope_use", str, "", "model card: uses it was not made or checked for (free text)", blank=True),
    Key("card.data_description", str, "", "model card: the training data in words: modality, sites, period, "
        "inclusion criteria (free text, never paths)", blank=True),
    Key("card.limitations", str, "", "model card: known limitations and failure modes the data owner adds",
        blank=True),
    Key("plans.auto_accept_from", list, [], "proposers (member names or peer ids) whose plans this node accepts by "
        "itself; others wait for `atd plan accept`"),
    Key("plans.kinds", list, "(every step kind)", "plan step kinds this node carries out; a plan giving it another "
        "kind is declined ([plans.data] maps a plan's data names to this node's data specs)"),
    Key("plans.daemon", bool, True, "the daemon carries out the plans this node accepted (false: only "
        "`atd plan follow` does)"),
)
BY_PATH = {k.path: k for k in KEYS}
# tables config.toml may hold that another command owns (not set with `atd config set`)
OWNED_ELSEWHERE = {"split": "atd split configure"}


def parse_value(key: Key, text: str) -> Any:
    """VALUE as typed on a command line -> the TOML value of `key` (ConfigError if it is not one,
    or not in the key's range or choices)."""
    return check_value(key, _parse(key, text))


def _parse(key: Key, text: str) -> Any:
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


def check_value(key: Key, value: Any) -> Any:
    """`value` if it is what `key` declares, else a one-line ConfigError naming the key."""
    why = problem(key, value)
    if why:
        raise ConfigError(f"config: {key.path} {why}")
    return value


def problem(key: Key, value: Any) -> str | None:
    """None when `value` is what `key` declares, else why not: "must be RULE (got VALUE)"."""
    if key.type is list:
        ok = isinstance(value, list)
        items = value if ok else []
        if ok and key.nested:
            ok = all(isinstance(x, list) and x for x in value)
            items = [y for x in value for y in x] if ok else []
        ok = ok and all(_is(key.item, x, True) for x in items) and _within(key, len(value))
        ok = ok and not (key.choices and any(x not in key.choices for x in items))
    else:
        ok = _is(key.type, value, key.blank) and _within(key, value) and not (key.choices and value not in key.choices)
    return None if ok else f"must be {key.rule()} (got {value!r:.60})"


def _is(t: type, value: Any, blank: bool) -> bool:
    if t is bool:
        return isinstance(value, bool)
    if t is int:
        return type(value) is int
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, str) and (blank or bool(value))


def _within(key: Key, v: Any) -> bool:
    if not isinstance(v, (int, float)):
        return True
    return ((key.low is None or v >= key.low) and (key.high is None or v <= key.high)
            and (key.above is None or v > key.above) and (key.below is None or v < key.below))


def check_tables(data: dict) -> None:
    """Check every declared key `data` (config.toml as a dict) holds; its tables must be tables.
    Keys nobody declared are left to their readers."""
    for key in KEYS:
        table, _, name = key.path.rpartition(".")
        have = data.get(table, {}) if table else data
        if not isinstance(have, dict):
            raise ConfigError(f"config: [{table}] must be a table")
        if name in have:
            check_value(key, have[name])


def value_in(data: dict, path: str) -> Any:
    """The value of declared key `path` in `data` (config.toml as a dict), checked, or its
    default (None for a default that is a description)."""
    key = BY_PATH[path]
    table, _, name = path.rpartition(".")
    have = data.get(table, {}) if table else data
    if not isinstance(have, dict):
        raise ConfigError(f"config: [{table}] must be a table")
    if name in have:
        return check_value(key, have[name])
    return None if key.placeholder else key.default


# [card]: free text each, checked together by `check_card` (`atd config set`, the model card)
CARD_FIELDS = tuple(k.path.removeprefix("card.") for k in KEYS if k.path.startswith("card."))
CARD_MAX_CHARS = 4000
_CARD_PATH = re.compile(r"(?:^|[\s(\"'])(?:~?/[\w.-]+/|[A-Za-z]:\\)")


def check_card(table: object) -> dict[str, str]:
    """The `[card]` table (the model card's free text, shown to outsiders) checked: {field: text},
    "" when unset. A field is refused (ConfigError naming the key) when it is not a string, is
    longer than `CARD_MAX_CHARS`, or holds what looks like a local file path (`/...`, `~/...`,
    `C:\\...`): the data is described, never located."""
    if table is None:
        table = {}
    if not isinstance(table, dict):
        raise ConfigError("config: [card] must be a table")
    unknown = sorted(set(table) - set(CARD_FIELDS))
    if unknown:
        raise ConfigError(f"config: unknown key card.{unknown[0]} (known: {', '.join(CARD_FIELDS)})")
    out = {}
    for f in CARD_FIELDS:
        v = table.get(f, "")
        if not isinstance(v, str):
            raise ConfigError(f"config: card.{f} must be text, got {type(v).__name__}")
        if len(v) > CARD_MAX_CHARS:
            raise ConfigError(f"config: card.{f} is {len(v)} characters (at most {CARD_MAX_CHARS})")
        if _CARD_PATH.search(v):
            raise ConfigError(f"config: card.{f} names a file path; the card describes the data, never where it is")
        out[f] = v.strip()
    return out


# INTERFACES.md's settings section is this table (tests/test_config_cmd.py checks it is current):
# `python -m atdnode.node.config_schema INTERFACES.md` rewrites it in place.
DOC_BEGIN = "<!-- config.toml settings: generated by `python -m atdnode.node.config_schema INTERFACES.md`; do not edit -->"
DOC_END = "<!-- end of config.toml settings -->"


def doc_markdown() -> str:
    """The settings as a Markdown table, between DOC_BEGIN and DOC_END."""
    return "\n".join([DOC_BEGIN, "", *doc_rows(KEYS), "", DOC_END])


def doc_rows(keys: Iterable[Key]) -> list[str]:
    """A Markdown table of `keys`: key, type, default, allowed values, meaning (also the
    scenario keys' table, `netsim.scenario_doc`)."""
    out = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    return out + [f"| `{k.path}` | {k.type.__name__} | {k.shown_default()} | {k.rule()} | {k.doc} |" for k in keys]


def update_doc(text: str) -> str:
    """`text` with its settings section (DOC_BEGIN ... DOC_END) rewritten from `KEYS`."""
    from atdnode.docsections import replace_section

    return replace_section(text, DOC_BEGIN, DOC_END, doc_markdown(), "config.toml settings")


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
        default = None if k.placeholder else k.default
        val = _toml(default) if default is not None else f'"..."  {k.default}'
        lines.append(f"# {name} = {val}    # {k.doc} ({k.rule()})")
    lines += ["", "# [split]    (split-learning server settings: `atd split configure`)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    from atdnode.docsections import rewrite_main

    rewrite_main(update_doc, "atdnode.node.config_schema")
