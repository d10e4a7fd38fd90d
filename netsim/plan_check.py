"""The load-time check of a plan scenario (`[scenario] plan`), kept apart from the runner
(`netsim.plan`) so that checking a scenario imports no back-end."""
from __future__ import annotations

import tomllib
from pathlib import Path

from atdnode.errors import AtdError
from netsim.scenario_spec import Scenario, Source

METHOD = "plan"


def read_plan(path: str | Path) -> dict:
    """The parsed plan file; OSError / tomllib.TOMLDecodeError as they come."""
    with open(path, "rb") as f:
        return tomllib.load(f)


DATA_KEYS = ("data", "test_data")  # step options that name data (what a member's policy maps)


def data_names(doc: dict) -> list[str]:
    """The data names the plan's steps use (each node maps them to its own data)."""
    return sorted({s[k] for s in doc.get("steps") or [] if isinstance(s, dict) for k in DATA_KEYS
                   if isinstance(s.get(k), str)})


def check_plan_scenario(c: Source, s: Scenario) -> None:
    """ScenarioError naming the key unless `s`'s plan can run: method "plan" and key `plan` go
    together, the file is a plan every node of the scenario can carry out (`build_plan`'s
    checks with the node names as members), all nodes join in phase 1, no shared base, and the
    scenario's [model] reads images as the plan's ViT does."""
    from atdnode.learning import resolve_config
    from atdnode.plans import PlanError, build_plan

    if METHOD in s.methods and not s.plan:
        raise c.fail("scenario.methods", f'"{METHOD}" carries out a plan file: set [scenario] plan = "FILE"')
    if not s.plan:
        return
    if METHOD not in s.methods:
        raise c.fail("scenario.plan", f'add "{METHOD}" to [scenario] methods to carry the plan out')
    try:
        doc = read_plan(s.plan)
    except FileNotFoundError:
        raise c.fail("scenario.plan", f"{s.plan}: no such plan file") from None
    except OSError as exc:
        raise c.fail("scenario.plan", f"{s.plan}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise c.fail("scenario.plan", f"{s.plan}: not valid TOML ({exc})") from None
    names = set(s.node_names())

    def resolve(ref: str) -> str:
        if ref not in names:
            raise PlanError(f"member {ref!r} is not a node of this scenario (nodes: {', '.join(s.node_names())})")
        return ref

    try:
        build_plan(doc, resolve=resolve, members=names)
    except PlanError as exc:
        raise c.fail("scenario.plan", f"{Path(s.plan).name}: {exc}") from None
    if s.phase_numbers() != [1]:
        raise c.fail("cohorts", "with a plan every cohort joins in phase 1 (the plan orders its own steps)")
    if s.base != "scratch":
        raise c.fail("scenario.base", "a plan names its own start (train steps' init_from): use base = \"scratch\"")
    m = dict(doc.get("model") or {})
    try:
        cfg = resolve_config(m.pop("name", "vit_tiny_patch16_224"), num_heads=m.pop("heads", None), **m)
    except (AtdError, TypeError, ValueError) as exc:  # ValueError: ModelConfigError
        raise c.fail("scenario.plan", f"{Path(s.plan).name}: model: {exc}") from None
    for key in ("img_size", "in_chans"):
        if getattr(cfg, key) != getattr(s.model, key):
            raise c.fail(f"model.{key}", f"{getattr(s.model, key)} differs from the plan's ViT ({getattr(cfg, key)}): "
                                         "netsim writes and scores the nodes' data at the scenario's size")
