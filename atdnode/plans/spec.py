"""What a plan may say: the fixed set of step kinds, their options, and the checks every member runs.

A plan file (TOML) names the consortium's steps; `build_plan` turns it into the body of a
signed `plan` entry (member names resolved to peer ids), `check_plan` checks a body against
the consortium's membership. The proposer runs both before signing; every receiving member
runs `check_plan` again before it acts on a plan (members can be adversaries). A step is
never code: its kind is one of `STEP_KINDS` and its options are the ones listed for that kind,
each with its type. Steps refer to earlier steps by id (their results are the inputs).

    name = "vgs"
    deadline = 1800                      # default per-step deadline, seconds after the proposal
    [model]                              # the ViT every train step builds (atd train's options)
    name = "vit_tiny_patch16_224"; img_size = 16; patch_size = 8; embed_dim = 32; depth = 1; heads = 2
    [[steps]]
    id = "base"; kind = "train"; members = ["node1"]; data = "base"; epochs = 3; lr = 3e-3
    [[steps]]
    id = "base_pub"; kind = "publish"; members = ["node1"]; model = "base"
    [[steps]]
    id = "h"; kind = "aggregate"; members = ["node1"]; mode = "horizontal"; inputs = ["base_pub", "pub"]

`data` is a data spec *name*: each member maps it to its own data in config.toml
(`[plans.data] base = "digits?shard=1/3"`); a plan never carries a path.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from atdnode.errors import AtdError
from protocols.vit_config import STEMS

NUM = (int, float)


class PlanError(AtdError):
    """A plan (file or signed entry) names something a node cannot carry out: an unknown step kind
    or option, a member outside the consortium, a reference to an unknown or later step."""


_COMMON = {"id": (str,), "kind": (str,), "members": (list,), "deadline": (int,), "after": (list,)}
_ENSEMBLE = {"pca_components": (int,), "mlp_hidden": (str,), "mlp_max_iter": (int,), "rf_trees": (int,),
             "seed": (int,), "prior": (str,)}
# kind -> its options with their types. Options naming other steps are in STEP_REFS.
STEP_KINDS: dict[str, dict[str, tuple[type, ...]]] = {
    "train": {"data": (str,), "epochs": (int,), "lr": NUM, "batch_size": (int,), "seed": (int,),
              "augment": (bool,), "weight_decay": NUM, "warmup_epochs": NUM, "init_from": (str,)},
    "publish": {"model": (str,), "part": (str,)},
    "wait": {"inputs": (list,)},
    "aggregate": {"mode": (str,), "inputs": (list,), "groups": (dict,), "weighting": (str,),
                  "group_weighting": (str,), "classifier": (str,), "q": NUM, "data": (str,),
                  "features": (list,), **_ENSEMBLE},
    "share_features": {"to": (list,), "data": (str,)},
    "classify": {"data": (str,), "split": (str,)},
    # an `atd rounds` campaign (FedAvg / FedWAvg / a robust aggregator) among the step's members
    "rounds": {"data": (str,), "rounds": (int,), "aggregator": (str,), "byzantine": (int,), "q": NUM,
               "local_epochs": (int,), "batch_size": (int,), "lr": NUM, "seed": (int,), "round_deadline": NUM,
               "min_peers": (int,), "absent_grace": NUM, "name": (str,)},
    # `atd split join`: each member joins the split-learning campaign of `server` (a member
    # running a festa-server / pfesta-server / msd-server role) for `task`
    "split": {"server": (str,), "task": (str,), "data": (str,), "test_data": (str,), "rounds": (int,),
              "seed": (int,), "lr": NUM},
}
REQUIRED = {"train": ("data",), "publish": ("model",), "wait": ("inputs",), "aggregate": ("mode",),
            "share_features": ("to",), "classify": ("data",), "rounds": ("data", "rounds"),
            "split": ("server", "task", "data")}
# option -> the kinds of step it may name (its results are this step's inputs)
STEP_REFS = {"init_from": ("publish",), "model": ("train",), "inputs": ("publish", "aggregate", "share_features",
                                                                          "wait"),
             "features": ("share_features",), "after": tuple(STEP_KINDS)}
MODEL_KEYS = {"name": (str,), "img_size": (int,), "patch_size": (int,), "embed_dim": (int,), "depth": (int,),
              "heads": (int,), "in_chans": (int,), "mlp_ratio": NUM, "stem": (str,)}
MODES = ("horizontal", "vertical", "hierarchical")
LATE = ("proceed",)
DEFAULT_DEADLINE = 3600
MAX_STEPS = 64


def _typed(where: str, name: str, value: Any, types: tuple[type, ...]) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise PlanError(f"{where}: {name} must be {'/'.join(t.__name__ for t in types)}, got {type(value).__name__}")


def _refs(step: Mapping) -> list[tuple[str, str]]:
    """(option, step id) for every other step this step names."""
    out = []
    for opt in STEP_REFS:
        v = step.get(opt)
        if isinstance(v, str):
            out.append((opt, v))
        elif isinstance(v, list):
            out += [(opt, x) for x in v]
    for ids in (step.get("groups") or {}).values():
        out += [("groups", x) for x in ids]
    return out


def step_inputs(step: Mapping) -> list[str]:
    """Ids of the steps whose results `step` needs, in the order it names them."""
    return list(dict.fromkeys(ref for _, ref in _refs(step)))


def check_plan(body: Mapping, members: set[str]) -> None:
    """PlanError (one line) unless `body` is a plan every member can carry out: known step kinds
    and options of the right types, each step's members inside the consortium (`members`: peer
    ids of current members) and listed in the plan, references to earlier steps of the kinds
    they need, unique step ids."""
    steps = body.get("steps")
    if not isinstance(steps, list) or not steps:
        raise PlanError("a plan needs at least one step")
    if len(steps) > MAX_STEPS:
        raise PlanError(f"a plan has at most {MAX_STEPS} steps, this one {len(steps)}")
    if body.get("late") not in LATE:
        raise PlanError(f"late must be one of {', '.join(LATE)}, got {body.get('late')!r}")
    plan_members = body.get("members") or []
    outsiders = sorted(set(plan_members) - members)
    if outsiders:
        raise PlanError(f"member {outsiders[0]} is not in the consortium")
    seen: dict[str, str] = {}
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            raise PlanError(f"step {i + 1} must be a table")
        sid = step.get("id")
        where = f"step {sid if isinstance(sid, str) else i + 1}"
        kind = step.get("kind")
        if kind not in STEP_KINDS:
            raise PlanError(f"{where}: unknown step kind {kind!r} (known: {', '.join(STEP_KINDS)})")
        allowed = {**_COMMON, **STEP_KINDS[kind]}
        for name, value in step.items():
            if name not in allowed:
                raise PlanError(f"{where}: {kind} steps have no option {name!r}")
            _typed(where, name, value, allowed[name])
        if not isinstance(sid, str) or not sid or sid in seen:
            raise PlanError(f"{where}: every step needs a unique id")
        for name in REQUIRED[kind]:
            if name not in step:
                raise PlanError(f"{where}: {kind} steps need {name!r}")
        who = step.get("members")
        if not who or not all(isinstance(m, str) for m in who):
            raise PlanError(f"{where}: members must list at least one member")
        for m in who:
            if m not in plan_members:
                raise PlanError(f"{where}: member {m} is not in the plan's members")
            if m not in members:
                raise PlanError(f"{where}: member {m} is not in the consortium")
        for m in [*(step.get("to") or []), *([step["server"]] if "server" in step else [])]:
            if m not in members:
                raise PlanError(f"{where}: member {m} is not in the consortium")
        groups = step.get("groups") or {}
        if not all(isinstance(v, list) and v and all(isinstance(x, str) for x in v) for v in groups.values()):
            raise PlanError(f"{where}: groups must map each group name to a list of step ids")
        for opt, ref in _refs(step):
            if ref not in seen:
                raise PlanError(f"{where}: {opt} names {ref!r}, not an earlier step")
            if seen[ref] not in STEP_REFS.get(opt, ("publish", "aggregate")):
                raise PlanError(f"{where}: {opt} names {ref!r}, a {seen[ref]} step")
        if kind == "aggregate" and step["mode"] not in MODES:
            raise PlanError(f"{where}: mode must be one of {', '.join(MODES)}")
        if kind == "aggregate" and (step["mode"] == "hierarchical") != bool(step.get("groups")):
            raise PlanError(f"{where}: groups go with (and only with) mode hierarchical")
        if kind == "publish" and not set(who) <= set(_members_of(steps, step["model"])):
            raise PlanError(f"{where}: a member publishes only a model it trained in {step['model']!r}")
        seen[sid] = kind
    model = body.get("model")
    if model is not None:
        if not isinstance(model, dict):
            raise PlanError("model must be a table")
        for name, value in model.items():
            if name not in MODEL_KEYS:
                raise PlanError(f"model: unknown key {name!r}")
            _typed("model", name, value, MODEL_KEYS[name])
            if name == "stem" and value not in STEMS:
                raise PlanError(f"model: stem must be one of {', '.join(STEMS)}, got {value!r}")


def _members_of(steps: list, sid: str) -> list[str]:
    return next((s.get("members") or [] for s in steps if isinstance(s, dict) and s.get("id") == sid), [])


def build_plan(doc: Mapping, *, resolve, members: set[str], now: int | None = None) -> dict:
    """The body of a `plan` entry for the parsed plan file `doc`: member references resolved to
    peer ids by `resolve(name) -> peer id`, deadlines filled in, checked with `check_plan`."""
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise PlanError("a plan file needs a name")
    known = {"name", "deadline", "late", "model", "steps"}
    extra = sorted(set(doc) - known)
    if extra:
        raise PlanError(f"plan file: unknown key {extra[0]!r}")
    default = doc.get("deadline", DEFAULT_DEADLINE)
    _typed("plan file", "deadline", default, (int,))
    steps = []
    for raw in doc.get("steps") or []:
        if not isinstance(raw, dict):
            raise PlanError("plan file: steps must be tables ([[steps]])")
        step = dict(raw)
        if isinstance(step.get("server"), str):
            step["server"] = resolve(step["server"])
        for key in ("members", "to"):
            if key in step:
                _typed(f"step {step.get('id')}", key, step[key], (list,))
                step[key] = [resolve(str(m)) for m in step[key]]
        step.setdefault("deadline", default)
        steps.append(step)
    who = list(dict.fromkeys(m for s in steps for m in s.get("members") or []))
    body = {"name": name, "created": int(time.time() if now is None else now), "late": doc.get("late", "proceed"),
            "members": who, "steps": steps}
    if "model" in doc:
        body["model"] = dict(doc["model"])
    check_plan(body, members)
    return body
