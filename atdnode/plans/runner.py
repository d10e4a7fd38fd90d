"""Proposing, deciding and following a plan on one node.

`propose` checks a plan file and signs it as a `plan` entry. `decide` signs this member's
`plan_decision` (once: a second, different decision is refused). `advance` does, once, every
one of this member's steps whose inputs are present and records each result (or failure,
one line) as a `plan_step` entry. The node's daemon calls it (atdnode.plans.service);
`follow` repeats it in the foreground until every own step has a result (a node whose
daemon does not carry out plans); `watch` only reads every member's progress.

Finished means "this member's `plan_step` for the step is on the ledger", so a follower
killed at any point and started again skips finished steps; the library calls behind a
step resume or find what they already signed (atdnode.plans.steps). Nothing runs on a node
that has not accepted. A step waits for its inputs until the deadline of the step that
makes them; then (late = "proceed") it goes on with what arrived and records who is
missing; members that declined or failed are missing at once. A step with no input at all
after that deadline fails with one line, so no member waits forever on another.

A member carries out its own steps in the plan's order; `after` orders a step after other
members' steps. The node's daemon replicates the entries and fetches the blobs; everything here works on
the home's ledger and stores, as the CLI commands do.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from atdnode import bodies
from atdnode.blobs import BlobStore
from atdnode.node import NodeHome, NodeIdentity
from atdnode.plans.policy import PlanPolicy
from atdnode.plans.spec import PlanError, build_plan, check_plan, step_inputs
from atdnode.plans.state import ACCEPT, DECLINE, DONE, FAILED, PlanView, load_view, members_of, progress
from atdnode.plans.steps import Inputs, run_step
from ledger import Ledger, peer_id_from_public_key

log = logging.getLogger("atd.plans")
EXPECTED_KIND = {"publish": "weights", "aggregate": "aggregate", "share_features": "features"}


def member_names(led: Ledger) -> dict[str, str]:
    """Peer id -> name, from admissions and `hello` entries (a member's own hello wins)."""
    out = {}
    for key, st in led.membership().members.items():
        if st.name:
            out[peer_id_from_public_key(key)] = st.name
    for e in led.query(kind="hello"):
        if isinstance(e.body.get("name"), str):
            out[peer_id_from_public_key(e.author)] = e.body["name"]
    return out


def _resolver(led: Ledger, members: set[str]) -> Callable[[str], str]:
    names = member_names(led)

    def resolve(ref: str) -> str:
        if ref in members:
            return ref
        hits = sorted({p for p, n in names.items() if n == ref} or
                      {p for p in members if len(ref) >= 6 and (p.startswith(ref) or p.endswith(ref))})
        if len(hits) > 1:
            raise PlanError(f"member {ref!r} is ambiguous")
        if not hits:
            raise PlanError(f"member {ref!r} is not in the consortium")
        return hits[0]

    return resolve


def propose(home: NodeHome, doc: dict) -> str:
    """Check the parsed plan file `doc` against the consortium and sign it; the plan's id (hex).
    PlanError (one line) for an unknown step kind, a member outside the consortium, etc."""
    ident = NodeIdentity.load(home)
    with Ledger.open(home.ledger_db) as led:
        members = members_of(led)
        body = build_plan(doc, resolve=_resolver(led, members), members=members)
        return bodies.append(led, ident.signer, bodies.PLAN_KIND, body).id.hex()


def decide(home: NodeHome, plan: str, decision: str, reason: str = "") -> dict:
    """Sign this member's decision on `plan` (accept | decline); the decision in force.
    Accepting a plan this node cannot carry out (an invalid plan, a step kind or data name its
    policy lacks) is refused with PlanError; deciding twice returns the first decision, or
    PlanError when it differs."""
    if decision not in (ACCEPT, DECLINE):
        raise PlanError(f"decision must be accept or decline, got {decision!r}")
    ident = NodeIdentity.load(home)
    with Ledger.open(home.ledger_db) as led:
        view = load_view(led, plan, check=decision == ACCEPT)
        me = ident.peer_id
        if me not in view.body["members"]:
            raise PlanError(f"this node takes no part in plan {view.id[:16]}")
        prior = view.decisions.get(me)
        if prior:
            if prior["decision"] != decision:
                raise PlanError(f"this node already signed {prior['decision']} for plan {view.id[:16]}")
            return prior
        if decision == ACCEPT:
            why = PlanPolicy.load(home).refusal(_own_steps(view, me))
            if why:
                raise PlanError(f"cannot accept: {why}")
        body = {"plan": view.id, "decision": decision, **({"reason": reason[:200]} if reason else {})}
        bodies.append(led, ident.signer, bodies.PLAN_DECISION_KIND, body)
        return body


def _own_steps(view: PlanView, me: str) -> list[dict]:
    return [s for s in view.steps if me in s["members"]]


@dataclass
class Advance:
    """What one `advance` saw and did."""

    plan: str
    decision: str | None
    ran: list[str] = field(default_factory=list)  # step ids finished (or failed) now
    waiting: list[str] = field(default_factory=list)  # own steps still without a result
    refused: str = ""  # why this node will not carry the plan out

    @property
    def finished(self) -> bool:
        return self.decision == DECLINE or bool(self.refused) or not self.waiting


def _auto_decision(home: NodeHome, led: Ledger, view: PlanView, me: str, policy: PlanPolicy) -> str | None:
    """The decision this node's policy takes by itself (None: wait for `atd plan accept`)."""
    names = member_names(led)
    trusted = set(policy.auto_accept_from)
    if view.author != me and view.author not in trusted and names.get(view.author) not in trusted:
        return None
    return DECLINE if policy.refusal(_own_steps(view, me)) else ACCEPT


def _gather(led: Ledger, store: BlobStore, view: PlanView, me: str, sid: str, now: float) -> tuple[list[str], list[str], bool]:
    """(result entry ids of step `sid` usable here, members left out, still waiting)."""
    dep = view.step(sid)
    late = now >= view.deadline(dep)
    ids, missing, waiting = [], [], False
    for m in dep["members"]:
        res = view.results.get((sid, m))
        if res is None or res["status"] == FAILED:
            if res is not None or view.decision(m) == DECLINE or late:
                missing.append(m)
            else:
                waiting = True
            continue
        mine, ok = [], True
        for rid in res["results"]:
            try:
                e = led.get(rid) if len(rid) == 64 else None
            except ValueError:  # not hex: nothing that could ever arrive
                ok = False
                break
            want = EXPECTED_KIND.get(dep["kind"])
            if e is not None and want and (peer_id_from_public_key(e.author) != m or e.kind != want):
                ok = False  # a result that is not what the step makes (another's entry): never used
                break
            if e is None or (isinstance(e.body.get("blob"), str) and not store.has(e.body["blob"]) and
                             (e.kind != "features" or me in (e.body.get("recipients") or []))):
                ok = False
                waiting = waiting or not late
                break
            if e.kind == "features" and me not in (e.body.get("recipients") or []):
                continue  # sealed to others: not an input here
            mine.append(rid)
        if ok:
            ids += mine
        else:
            missing.append(m)
    return ids, missing, waiting


def advance(home: NodeHome, plan: str, *, policy: PlanPolicy | None = None, now: float | None = None) -> Advance:
    """Do, once, every own step of `plan` whose inputs are present (module doc)."""
    ident = NodeIdentity.load(home)
    me = ident.peer_id
    policy = policy or PlanPolicy.load(home)
    store = BlobStore(home.blobs_dir)
    with Ledger.open(home.ledger_db) as led:
        view = load_view(led, plan, check=False)
        out = Advance(plan=view.id, decision=view.decision(me))
        if me not in view.body.get("members", []):
            out.refused = "this node takes no part in the plan"
            return out
        try:
            check_plan(view.body, members_of(led))
        except PlanError as exc:  # a member checks what another signed before acting on it
            out.refused = f"invalid plan: {exc}"
            if out.decision is None:
                bodies.append(led, ident.signer, bodies.PLAN_DECISION_KIND,
                              {"plan": view.id, "decision": DECLINE, "reason": out.refused[:200]})
                out.decision = DECLINE
            return out
        if out.decision is None:
            auto = _auto_decision(home, led, view, me, policy)
            if auto is not None:
                why = policy.refusal(_own_steps(view, me)) or ""
                bodies.append(led, ident.signer, bodies.PLAN_DECISION_KIND,
                              {"plan": view.id, "decision": auto, **({"reason": why[:200]} if why else {})})
                out.decision = auto
    out.waiting = [s["id"] for s in _own_steps(view, me) if (s["id"], me) not in view.results]
    if out.decision != ACCEPT:
        return out
    for step in _own_steps(view, me):
        if (step["id"], me) in view.results:
            continue
        t = time.time() if now is None else now
        with Ledger.open(home.ledger_db) as led:
            view = load_view(led, view.id, check=False)
            if (step["id"], me) in view.results:
                continue
            entries, own, missing, waiting = {}, {}, [], False
            for sid in step_inputs(step):
                if (sid, me) in view.results:
                    own[sid] = view.results[(sid, me)]
                if sid == step.get("model") or (sid in step.get("after", ()) and me in view.step(sid)["members"]):
                    # this member's own model, or its own earlier step: only its own result counts
                    waiting = waiting or sid not in own
                    continue
                ids, miss, wait = _gather(led, store, view, me, sid, t)
                entries[sid], waiting = ids, waiting or wait
                missing += miss
        if waiting:
            break  # a member carries out its own steps in plan order
        declined = [m for m in step["members"] if view.decision(m) == DECLINE]
        _run_and_record(home, ident, view, step, Inputs(entries=entries, own=own, missing=sorted(set(missing)),
                                                        declined=declined), policy)
        out.ran.append(step["id"])
    with Ledger.open(home.ledger_db) as led:
        view = load_view(led, view.id, check=False)
    out.waiting = [s["id"] for s in _own_steps(view, me) if (s["id"], me) not in view.results]
    return out


def _run_and_record(home: NodeHome, ident: NodeIdentity, view: PlanView, step: dict, inputs: Inputs,
                    policy: PlanPolicy) -> None:
    body = {"plan": view.id, "step": step["id"], "results": [], "missing": inputs.missing, "started": time.time()}
    log.info("plan %s: step %s starts", view.id[:16], step["id"])
    try:
        own_failed = [sid for sid, b in inputs.own.items() if b["status"] == FAILED]
        if own_failed:
            raise PlanError(f"this node's step {own_failed[0]!r} failed")
        got = run_step(home, view.body, step, inputs, policy)
        body.update(status=DONE, results=got.results, metrics=got.metrics,
                    **({"model": got.model} if got.model else {}))
    except Exception as exc:  # noqa: BLE001 - a step's failure is recorded, one line, never lost
        log.warning("plan %s step %s failed: %s", view.id[:16], step["id"], exc)
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        body.update(status=FAILED, reason=line[:200])
    body["seconds"] = round(time.time() - body["started"], 3)
    with Ledger.open(home.ledger_db) as led:
        if (step["id"], ident.peer_id) not in load_view(led, view.id, check=False).results:
            bodies.append(led, ident.signer, bodies.PLAN_STEP_KIND, body)
            log.info("plan %s: step %s %s in %.1f s", view.id[:16], step["id"], body["status"], body["seconds"])


class PlanBusy(PlanError):
    """Another process (a follower, or the daemon) carries out this plan on this home now."""


@contextmanager
def follower_lock(home: NodeHome, plan: str) -> Iterator[None]:
    """One follower per plan and home (flock; released when its holder dies)."""
    path = home.root / f".plan-{plan[:16]}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PlanBusy(f"plan {plan[:16]} is already being followed on this node") from None
        yield
    finally:
        os.close(fd)


PLAN_ARRIVAL_S = 120.0  # how long `follow` waits for a plan proposed elsewhere to arrive (no timeout given)


def follow(home: NodeHome, plan: str, *, poll: float = 0.25, timeout: float | None = None,
           on_step: Callable[[Advance], None] | None = None) -> Advance:
    """`advance` until every own step has a result, the node declined, or `timeout` s passed
    (then the last Advance, with steps still waiting). A plan not yet on this node's ledger is
    waited for (`timeout`, else PLAN_ARRIVAL_S; then PlanError). Bounded: a step's inputs are waited for
    only until their deadline."""
    end = None if timeout is None else time.monotonic() + timeout
    arrive = time.monotonic() + (timeout if timeout is not None else PLAN_ARRIVAL_S)
    while True:  # a plan proposed elsewhere may not have reached this node yet
        try:
            with Ledger.open(home.ledger_db) as led:
                view = load_view(led, plan, check=False)
            plan, last = view.id, max(view.deadline(s) for s in view.steps)
            break
        except PlanError:
            if time.monotonic() > arrive:
                raise
            time.sleep(poll)
    with follower_lock(home, plan):
        while True:
            adv = advance(home, plan)
            if adv.ran and on_step:
                on_step(adv)
            if adv.finished or (end is not None and time.monotonic() > end):
                return adv
            if adv.decision is None and time.time() > last:  # never decided: the plan is over without it
                adv.refused = "not accepted before the plan's last deadline"
                return adv
            if not adv.ran:
                time.sleep(poll)


def watch(home: NodeHome, plan: str, *, poll: float = 0.5, timeout: float | None = None,
          on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Progress rows (`state.progress`) of `plan` as this node's ledger shows them, once every
    member's every step has a result or the member declined, or once the plan's last deadline
    passed, or after `timeout` s (rows still `waiting` then). `on_row` sees each row once, when it gets its result. Reads only: the
    members' daemons (or followers) carry the plan out."""
    end = None if timeout is None else time.monotonic() + timeout
    seen: set[tuple[str, str]] = set()
    while True:
        with Ledger.open(home.ledger_db) as led:
            view = load_view(led, plan, check=False)
        rows = progress(view)
        for r in rows:
            if r["state"] != "waiting" and (r["step"], r["member"]) not in seen:
                seen.add((r["step"], r["member"]))
                if on_row:
                    on_row(r)
        if all(r["state"] != "waiting" for r in rows) or time.time() > max(view.deadline(s) for s in view.steps):
            return rows
        if end is not None and time.monotonic() > end:
            return rows
        time.sleep(poll)
