"""A plan as this node's ledger shows it: the plan, each member's decision, each member's step results.

Only entries that fit their body spec count, and only a member's own entries speak for it:
a decision or step result is the first `plan_decision` / `plan_step` its author signed for
that plan (and step); later ones are ignored, so nobody can flip a result after others used it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from atdnode import bodies
from atdnode.plans.spec import PlanError, check_plan, step_inputs
from ledger import Entry, Ledger, peer_id_from_public_key

ACCEPT, DECLINE = "accept", "decline"
DONE, FAILED = "done", "failed"


@dataclass
class PlanView:
    """The plan entry `id` and what the members signed about it."""

    id: str
    author: str
    body: dict
    decisions: dict[str, dict] = field(default_factory=dict)  # peer id -> plan_decision body
    results: dict[tuple[str, str], dict] = field(default_factory=dict)  # (step id, peer id) -> plan_step body

    @property
    def steps(self) -> list[dict]:
        return self.body["steps"]

    def step(self, sid: str) -> dict:
        return next(s for s in self.steps if s["id"] == sid)

    def decision(self, peer: str) -> str | None:
        d = self.decisions.get(peer)
        return d["decision"] if d else None

    def deadline(self, step: dict) -> int:
        return self.body["created"] + int(step.get("deadline", 0))


def members_of(led: Ledger) -> set[str]:
    """Peer ids of the consortium's current (admitted, not revoked) members."""
    ms = led.membership()
    return {peer_id_from_public_key(k) for k in ms.members if ms.is_member(k)}


def find_plan(led: Ledger, ref: str) -> Entry:
    """The `plan` entry with id (or unique prefix) `ref`; PlanError if none or several."""
    ref = ref.strip().lower()
    hits = [e for e in led.query(kind=bodies.PLAN_KIND) if e.id.hex().startswith(ref)] if len(ref) >= 4 else []
    if len(hits) != 1:
        raise PlanError(f"no plan {ref!r} on this node's ledger" if not hits else f"plan {ref!r} is ambiguous")
    return hits[0]


def load_view(led: Ledger, ref: str, *, check: bool = True) -> PlanView:
    """The plan `ref` with every member's decision and step results; with `check`, PlanError
    if the signed plan is not one this node can carry out (`check_plan`)."""
    entry = find_plan(led, ref)
    body = bodies.body_of(entry)
    if check:
        check_plan(body, members_of(led))
    view = PlanView(id=entry.id.hex(), author=peer_id_from_public_key(entry.author), body=body)
    for e in led.query(kind=bodies.PLAN_DECISION_KIND):
        if bodies.fits(e) and e.body["plan"] == view.id and e.body["decision"] in (ACCEPT, DECLINE):
            view.decisions.setdefault(peer_id_from_public_key(e.author), e.body)
    sids = {s.get("id") for s in body.get("steps", [])}
    for e in led.query(kind=bodies.PLAN_STEP_KIND):
        if bodies.fits(e) and e.body["plan"] == view.id and e.body["step"] in sids and \
                e.body["status"] in (DONE, FAILED):
            view.results.setdefault((e.body["step"], peer_id_from_public_key(e.author)), e.body)
    return view


def progress(view: PlanView) -> list[dict]:
    """Per step, per member: decision and state (`done`, `failed`, `declined`, `waiting`)."""
    rows = []
    for step in view.steps:
        for m in step["members"]:
            res = view.results.get((step["id"], m))
            dec = view.decision(m)
            state = res["status"] if res else "declined" if dec == DECLINE else "waiting"
            rows.append({"step": step["id"], "kind": step["kind"], "member": m, "decision": dec or "undecided",
                         "state": state, "results": res["results"] if res else [],
                         "reason": (res or {}).get("reason", ""), "missing": (res or {}).get("missing", []),
                         "metrics": (res or {}).get("metrics", {}), "seconds": (res or {}).get("seconds")})
    return rows


def running(view: PlanView, now: float | None = None) -> set[tuple[str, str]]:
    """(step id, peer id) of the steps a member is carrying out now, as far as this ledger can
    tell: the member accepted, the step is its first own step without a result (a member
    carries out its own steps in plan order), and every input the runner waits for is here --
    its own earlier result for its own model or `after` steps, else from each member of the
    input step a result, a decline, or the input step's deadline passed (`now`, default the
    clock). Whether the member already fetched the input blobs is not on the ledger: a step
    it still fetches for counts as running."""
    import time

    t = time.time() if now is None else now
    out = set()
    for m, dec in view.decisions.items():
        if dec["decision"] != ACCEPT:
            continue
        step = next((s for s in view.steps if m in s["members"] and (s["id"], m) not in view.results), None)
        if step is not None and all(_input_here(view, step, m, sid, t) for sid in step_inputs(step)):
            out.add((step["id"], m))
    return out


def _input_here(view: PlanView, step: dict, m: str, sid: str, now: float) -> bool:
    dep = view.step(sid)
    if sid == step.get("model") or (sid in step.get("after", ()) and m in dep["members"]):
        return (sid, m) in view.results
    return now >= view.deadline(dep) or all((sid, x) in view.results or view.decision(x) == DECLINE
                                            for x in dep["members"])
