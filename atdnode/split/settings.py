"""The `[split]` table of a server node's config.toml: what a split-learning service offers.

    [split]
    tasks = [{name = "digit", kind = "classification", num_outputs = 10},
             {name = "ink", kind = "segmentation", loss_weight = 0.5}]
    body = {img_size = 16, patch_size = 4, in_chans = 1, embed_dim = 32, depth = 2, num_heads = 2}
    rounds = 4            # training rounds (FESTA: phase 1; phase2_rounds more with the body frozen)
    steps_per_round = 4   # batches per client per round
    unifying_rounds = 2   # heads / tails averaged per task every n rounds
    part_weighting = "uniform"  # that average: "uniform" (the papers) or "samples" (by sample count)
    head = "fixed"        # p-FESTA ablation: "fixed" (the paper's) or "learnable" embedder
    pos_embed = true      # p-FESTA ablation: false = the embedder adds no position table
    batch_size = 16
    clients = 1           # round 1 opens once this many clients joined (p-FESTA / MSD: and uploaded) ...
    start_timeout = 300   # ... or once this many seconds passed with at least one
    round_timeout = 120   # a client that has not finished a round by then is dropped
    max_samples = 50000   # largest dataset a client may announce (the server stores its uploads)
    msd = {steps = 200, batch_size = 128}   # MSDConfig overrides
    accept = "members"    # p-FESTA / MSD: which members that join the server accepts as clients:
                          # "members" (the daemon signs the acceptance of every consortium member
                          # that joins and asks) or "manual" (only those its operator accepted
                          # with `atd split accept PEER...`)

Every key is optional (defaults below: a tiny digits setting). `SplitSettings.offer()` is
the public part a server announces in its signed `service` entry and tells each client.
It holds nothing about the p-FESTA / MSD embedder: that is the clients' secret (`secret.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from atdnode.node import NodeConfig, NodeHome
from atdnode.errors import ConfigError

CONFIG_KEY = "split"
ACCEPT_POLICIES = ("members", "manual")  # who a p-FESTA / MSD server accepts as clients (module doc)
EMBEDDER_HEADS = ("fixed", "learnable")  # p-FESTA's embedder: protocols.pfesta.HEADS, named here without torch
MAX_FRAME_DEFAULT = 64 << 20  # largest split frame accepted (a batch of ViT-B features is ~20 MB)


class SplitConfigError(ConfigError):
    """The `[split]` table or a split option is invalid; the message names the key."""


DEFAULT_TASKS = ({"name": "digit", "kind": "classification", "num_outputs": 10, "loss_weight": 1.0},
                 {"name": "ink", "kind": "segmentation", "num_outputs": 1, "loss_weight": 0.5},
                 {"name": "severity", "kind": "regression", "num_outputs": 1, "loss_weight": 0.5})
# the wire form of protocols.split_parts.SPLIT_MODEL (kept here: importing torch is slow)
DEFAULT_BODY = {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 2,
                "num_heads": 2, "mlp_ratio": 2.0}


@dataclass(frozen=True)
class SplitSettings:
    """A split service's settings (JSON/TOML values only; see the module docstring)."""

    tasks: tuple[dict, ...] = DEFAULT_TASKS
    body: dict = field(default_factory=lambda: dict(DEFAULT_BODY))
    rounds: int = 4
    steps_per_round: int = 4
    unifying_rounds: int = 2
    phase2_rounds: int = 0
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.05
    seed: int = 0
    class_token: bool = False
    part_weighting: str = "uniform"
    head: str = "fixed"
    pos_embed: bool = True
    clients: int = 1
    start_timeout: float = 300.0
    round_timeout: float = 120.0
    upload_chunk: int = 256
    max_samples: int = 50_000  # per client: p-FESTA / MSD servers store every uploaded sample
    max_frame: int = MAX_FRAME_DEFAULT
    msd: dict = field(default_factory=dict)
    accept: str = "members"

    def __post_init__(self) -> None:
        from protocols.msd import MSDConfig
        from protocols.split_parts import TaskSpec, split_config

        ints = {"rounds": 0, "steps_per_round": 1, "unifying_rounds": 1, "phase2_rounds": 0, "batch_size": 1,
                "seed": 0, "clients": 1, "upload_chunk": 1, "max_samples": 1,
                "max_frame": 1 << 16}
        for key, low in ints.items():
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise SplitConfigError(f"split.{key} must be an integer >= {low}, got {v!r}")
        for key in ("lr", "weight_decay", "start_timeout", "round_timeout"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise SplitConfigError(f"split.{key} must be a finite number >= 0, got {v!r}")
        if self.round_timeout <= 0:
            raise SplitConfigError("split.round_timeout must be > 0")
        if self.rounds + self.phase2_rounds < 1:
            raise SplitConfigError("split.rounds + split.phase2_rounds must be >= 1")
        if self.part_weighting not in ("uniform", "samples"):
            raise SplitConfigError(f"split.part_weighting must be 'uniform' or 'samples', got {self.part_weighting!r}")
        if not isinstance(self.class_token, bool):
            raise SplitConfigError("split.class_token must be true or false")
        if self.head not in EMBEDDER_HEADS:
            raise SplitConfigError(f"split.head must be one of {', '.join(EMBEDDER_HEADS)}, got {self.head!r}")
        if not isinstance(self.pos_embed, bool):
            raise SplitConfigError("split.pos_embed must be true or false")
        if self.accept not in ACCEPT_POLICIES:
            raise SplitConfigError(f"split.accept must be one of {', '.join(ACCEPT_POLICIES)}, got {self.accept!r}")
        try:
            specs = [TaskSpec.from_dict(t) for t in self.tasks]
        except (KeyError, TypeError, ValueError) as e:
            raise SplitConfigError(f"split.tasks: {e}") from None
        if not specs or len({t.name for t in specs}) != len(specs):
            raise SplitConfigError("split.tasks needs at least one task, with unique names")
        if not isinstance(self.body, dict) or set(self.body) - set(DEFAULT_BODY):
            raise SplitConfigError(f"split.body keys must be among {sorted(DEFAULT_BODY)}")
        try:
            split_config(self.body)
        except (TypeError, ValueError) as e:
            raise SplitConfigError(f"split.body: {e}") from None
        if not isinstance(self.msd, dict):
            raise SplitConfigError("split.msd must be a table of MSDConfig fields")
        try:
            MSDConfig(**self.msd)
        except (TypeError, ValueError) as e:
            raise SplitConfigError(f"split.msd: {e}") from None

    # --- typed views ---------------------------------------------------------------------

    def vit_config(self):
        """The body's shape: a `ModelConfig` (`protocols.split_parts.split_config`)."""
        from protocols.split_parts import split_config

        return split_config(self.body)

    def task_specs(self) -> list:
        from protocols.split_parts import TaskSpec

        return [TaskSpec.from_dict(t) for t in self.tasks]

    def msd_config(self):
        from protocols.msd import MSDConfig

        return MSDConfig(**self.msd)

    def plan(self, algorithm: str):
        """The FESTA / p-FESTA campaign's round schedule (`protocols.split_rounds.RoundPlan`,
        the in-process drivers' too): FESTA adds its frozen-body phase 2."""
        from protocols.split_rounds import RoundPlan

        return RoundPlan(self.rounds, self.steps_per_round, self.unifying_rounds,
                         self.phase2_rounds if algorithm == "festa" else 0)

    def total_rounds(self, algorithm: str) -> int:
        """Rounds of a campaign: the plan's (FESTA adds its frozen-body phase 2); MSD has one round."""
        return 1 if algorithm == "msd" else self.plan(algorithm).total

    def offer(self, algorithm: str) -> dict[str, Any]:
        """What a server announces (service entry) and tells each client (offer/welcome);
        p-FESTA's also names its ablation switches (``head``, ``pos_embed``)."""
        from protocols.split_parts import split_dict

        ablation = {"head": self.head, "pos_embed": self.pos_embed} if algorithm == "pfesta" else {}
        return {"algorithm": algorithm, **ablation, "tasks": [t.to_dict() for t in self.task_specs()],
                "body": split_dict(self.vit_config()), "rounds": self.rounds,
                "phase2_rounds": self.phase2_rounds if algorithm == "festa" else 0,
                "total_rounds": self.total_rounds(algorithm), "steps_per_round": self.steps_per_round,
                "unifying_rounds": self.unifying_rounds, "batch_size": self.batch_size,
                "class_token": self.class_token, "part_weighting": self.part_weighting,
                "lr": self.lr, "upload_chunk": self.upload_chunk, "max_frame": self.max_frame,
                "round_timeout": self.round_timeout}

    # --- persistence ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["tasks"] = [dict(t) for t in self.tasks]
        out["body"] = dict(self.body)
        out["msd"] = dict(self.msd)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitSettings:
        if not isinstance(d, dict):
            raise SplitConfigError("[split] must be a table")
        known = {f.name for f in fields(cls)}
        if "embedder_seed" in d:
            raise SplitConfigError("split.embedder_seed is gone: the p-FESTA / MSD embedder is a secret the "
                                   "clients make (p-FESTA §III-B); remove the key from config.toml")
        unknown = sorted(set(d) - known)
        if unknown:
            raise SplitConfigError(f"unknown split setting(s): {', '.join(unknown)}")
        kw = dict(d)
        if "tasks" in kw:
            if not isinstance(kw["tasks"], (list, tuple)) or not all(isinstance(t, dict) for t in kw["tasks"]):
                raise SplitConfigError("split.tasks must be a list of tables")
            kw["tasks"] = tuple(dict(t) for t in kw["tasks"])
        for key in ("start_timeout", "round_timeout", "lr", "weight_decay"):
            if isinstance(kw.get(key), int) and not isinstance(kw.get(key), bool):
                kw[key] = float(kw[key])
        return cls(**kw)

    @classmethod
    def load(cls, home: NodeHome) -> SplitSettings:
        """The node's `[split]` table (defaults where absent)."""
        return cls.from_dict(NodeConfig.load(home).extra.get(CONFIG_KEY, {}))

    def save(self, home: NodeHome) -> None:
        cfg = NodeConfig.load(home)
        cfg.extra[CONFIG_KEY] = self.to_dict()
        cfg.save(home)

    def updated(self, **changes: Any) -> SplitSettings:
        """A copy with `changes` (None values ignored), validated."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def parse_task(text: str) -> dict:
    """`NAME:KIND[:OUTPUTS[:LOSS_WEIGHT]]` (e.g. `digit:classification:10`, `ink:segmentation::0.5`)."""
    parts = text.split(":")
    if len(parts) < 2 or len(parts) > 4 or not parts[0]:
        raise SplitConfigError(f"task {text!r}: expected NAME:KIND[:OUTPUTS[:LOSS_WEIGHT]]")
    out: dict[str, Any] = {"name": parts[0], "kind": parts[1]}
    try:
        if len(parts) > 2 and parts[2]:
            out["num_outputs"] = int(parts[2])
        if len(parts) > 3 and parts[3]:
            out["loss_weight"] = float(parts[3])
    except ValueError:
        raise SplitConfigError(f"task {text!r}: OUTPUTS must be an integer and LOSS_WEIGHT a number") from None
    from protocols.split_parts import TaskSpec

    try:
        return TaskSpec.from_dict(out).to_dict()
    except ValueError as e:
        raise SplitConfigError(str(e)) from None
