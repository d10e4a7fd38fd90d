"""Signed plans: the consortium's steps in one file, carried out by every member that accepted.

A plan (TOML) names steps from a fixed set of kinds (`STEP_KINDS`: train, publish, wait,
aggregate, share_features, classify, rounds, split; never code), the members taking part in each, data
spec *names* each member maps to its own data (`[plans.data]` in config.toml), deadlines
and what happens to late members. `propose` signs it as a `plan` entry; each member checks
it and signs `decide` (accept | decline), by hand or by its `[plans]` policy; the node's
daemon (`service`), or `follow` in the foreground, carries out the member's own steps when their inputs arrived, with the same library
functions the CLI commands use, and records each result as a `plan_step` entry; `progress`
shows each member's state per step.
"""
from __future__ import annotations

from atdnode.face import lazy_face

# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"PlanPolicy": "policy", "Advance": "runner", "advance": "runner", "decide": "runner", "follow": "runner",
         "member_names": "runner", "propose": "runner", "watch": "runner", "PlanBusy": "runner", "PlanService": "service", "plan_services": "service", "STEP_KINDS": "spec", "PlanError": "spec",
         "build_plan": "spec", "check_plan": "spec", "PlanView": "state", "find_plan": "state",
         "load_view": "state", "progress": "state",
         "running": "state", "step_inputs": "spec"}
__all__ = [*_FACE]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
