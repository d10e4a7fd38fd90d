"""Signed plans: the consortium's steps in one file, carried out by every member that accepted.

A plan (TOML) names steps from a fixed set of kinds (`STEP_KINDS`: train, publish, wait,
aggregate, share_features, classify; never code), the members taking part in each, data
spec *names* each member maps to its own data (`[plans.data]` in config.toml), deadlines
and what happens to late members. `propose` signs it as a `plan` entry; each member checks
it and signs `decide` (accept | decline), by hand or by its `[plans]` policy; `follow`
carries out the member's own steps when their inputs arrived, with the same library
functions the CLI commands use, and records each result as a `plan_step` entry; `progress`
shows each member's state per step.
"""
from atdnode.plans.policy import PlanPolicy
from atdnode.plans.runner import Advance, advance, decide, follow, member_names, propose
from atdnode.plans.spec import STEP_KINDS, PlanError, build_plan, check_plan
from atdnode.plans.state import PlanView, find_plan, load_view, progress

__all__ = ["Advance", "PlanError", "PlanPolicy", "PlanView", "STEP_KINDS", "advance", "build_plan", "check_plan",
           "decide", "find_plan", "follow", "load_view", "member_names", "progress", "propose"]
