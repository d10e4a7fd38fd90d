"""A member's own rules for plans, from the `[plans]` table of its config.toml.

    [plans]
    auto_accept_from = ["node1"]     # proposers (names or peer ids) whose plans this node accepts
                                     # by itself when following them; others wait for `atd plan accept`
    kinds = ["train", "publish", "wait", "aggregate", "share_features", "classify", "rounds", "split"]
                                     # step kinds this node carries out (default: all); a plan giving
                                     # it another kind is declined, never run
    daemon = true                    # the daemon carries out accepted plans (false: `atd plan follow`)
    [plans.data]                     # data spec names a plan may use -> this node's own data
    base = "digits?shard=1/3&limit=300"

A plan never carries a path: a step names data by `data = "base"`, and each member reads it
through this table. A name missing here makes the node decline (or fail) that step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from atdnode.errors import ConfigError
from atdnode.node import NodeConfig, NodeHome
from atdnode.plans.spec import STEP_KINDS


@dataclass(frozen=True)
class PlanPolicy:
    """A member's `[plans]` table: whose plans it accepts by itself, which step kinds it runs,
    and its data for each data name a plan may use (module doc)."""

    auto_accept_from: tuple[str, ...] = ()
    kinds: tuple[str, ...] = tuple(STEP_KINDS)
    data: dict[str, str] = field(default_factory=dict)
    daemon: bool = True  # the daemon carries out the accepted plans (false: `atd plan follow` does)

    @classmethod
    def load(cls, home: NodeHome) -> "PlanPolicy":
        """The policy in HOME/config.toml (ConfigError naming a malformed key)."""
        return cls.from_config(NodeConfig.load(home))

    @classmethod
    def from_config(cls, config: NodeConfig) -> "PlanPolicy":
        """The policy in the `[plans]` table of `config` (ConfigError naming a malformed key)."""
        t = config.extra.get("plans", {})
        if not isinstance(t, dict):
            raise ConfigError("config: [plans] must be a table")
        auto, kinds, data = t.get("auto_accept_from", []), t.get("kinds", list(STEP_KINDS)), t.get("data", {})
        if not isinstance(auto, list) or not all(isinstance(x, str) for x in auto):
            raise ConfigError("config: plans.auto_accept_from must be a list of member names or peer ids")
        if not isinstance(kinds, list) or not all(k in STEP_KINDS for k in kinds):
            raise ConfigError(f"config: plans.kinds must list step kinds from {', '.join(STEP_KINDS)}")
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ConfigError("config: [plans.data] must map data names to data specs")
        if not isinstance(t.get("daemon", True), bool):
            raise ConfigError("config: plans.daemon must be true or false")
        return cls(auto_accept_from=tuple(auto), kinds=tuple(kinds), data=dict(data), daemon=t.get("daemon", True))

    def refusal(self, steps: list[dict]) -> str | None:
        """Why this node will not carry out `steps` (its own steps of a plan), or None."""
        for s in steps:
            if s["kind"] not in self.kinds:
                return f"step {s['id']}: this node does not run {s['kind']} steps (config plans.kinds)"
            for key in ("data", "test_data"):
                if key in s and s[key] not in self.data:
                    return f"step {s['id']}: data name {s[key]!r} is not mapped in config [plans.data]"
        return None

    def data_spec(self, name: str) -> str:
        if name not in self.data:
            raise ConfigError(f"data name {name!r} is not mapped in config [plans.data]")
        return self.data[name]
