"""The daemon carries out this node's plans: a service in the daemon's nursery (`NodeDaemon.services`).

`PlanService.run` notices `plan` entries that name this node and hands each, in turn, to
`atdnode.plans.runner.advance` in a worker thread (`trio.to_thread`, one at a time per node:
a capacity-1 limiter, so at most one plan step runs here at once and the trio loop never
waits on it). `advance` is the one implementation of a member's part: it applies the node's
`[plans]` policy (auto-accept from trusted proposers, step kinds, data names; else the plan
waits for `atd plan accept`), carries out the own steps whose inputs arrived and records
each result as a `plan_step` entry. The same per-plan lock as `atd plan follow`
(`runner.follower_lock`) keeps a follower and the daemon from running one plan twice.

When it looks. Nothing is signed before the daemon's own chain head is confirmed (the
daemon's safe-restart rule). Then a tick every `poll_s` (IDLE_POLL_S) is a stat of the
ledger file (`ledger_stamp`); a plan is advanced when the ledger changed (an entry merged,
a decision signed by `atd plan accept`), every tick while an accepted plan of this node
still waits for inputs (their blobs arrive without a ledger change), and every
LEDGER_RECHECK_S in any case (deadlines pass without a change). A plan is not looked at
again once this node's part is over: every own step has a result, it declined or refused
the plan, or the plan's last deadline passed without a decision here.

Restart. Finished means "this member's `plan_step` is on the ledger"; a daemon killed
during a step finds the step unfinished after its restart and `advance` carries it out
again, reusing what the killed run signed (atdnode.plans.steps), so nothing is redone
that finished and no conflicting entry is signed.

`[plans] daemon = false` in config.toml leaves plans to `atd plan follow` (a foreground
process on the node's home).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import trio

from atdnode import bodies
from atdnode.errors import AtdError
from atdnode.node import NodeHome
from atdnode.plans.policy import PlanPolicy
from atdnode.plans.runner import Advance, PlanBusy, advance, follower_lock
from atdnode.plans.state import load_view
from atdnode.replication import IDLE_POLL_S, LEDGER_RECHECK_S, ledger_stamp
from ledger import Ledger

log = logging.getLogger("atd.plans")


def plan_services(home: NodeHome, config: Any) -> list:
    """The daemon's plan service, unless config.toml says `[plans] daemon = false`. A malformed
    `[plans]` table does not stop the daemon: the service logs why it runs no plan."""
    try:
        if not PlanPolicy.from_config(config).daemon:
            return []
    except AtdError:
        pass
    return [PlanService(home)]


class PlanService:
    """Carries out this node's accepted plans inside its daemon (module doc). `install(daemon)`
    and `async run(daemon)`: the daemon's service interface."""

    def __init__(self, home: NodeHome, *, poll_s: float = IDLE_POLL_S, recheck_s: float = LEDGER_RECHECK_S) -> None:
        self.home = home
        self.poll_s, self.recheck_s = poll_s, recheck_s
        self.limiter = trio.CapacityLimiter(1)  # one plan step at a time on this node
        self.over: set[str] = set()  # plans whose part here is over: never looked at again
        self.active: set[str] = set()  # accepted plans with own steps still waiting for inputs
        self.last: dict[str, Advance] = {}  # plan id -> what its last advance saw and did
        self._warned: set[str] = set()
        self._wake = trio.Event()

    def install(self, daemon: Any) -> None:
        daemon.merge_observers.append(lambda _ids: self._wake.set())  # entries merged: look now

    async def run(self, daemon: Any) -> None:
        await daemon.replica.head_confirmed.wait()  # the daemon signs nothing before (module doc)
        me = daemon.identity.peer_id
        stamp, recheck_at = None, 0.0
        while True:
            now = trio.current_time()
            new = ledger_stamp(self.home.ledger_db)
            if new != stamp or self.active or now >= recheck_at:
                stamp, recheck_at = new, now + self.recheck_s
                for plan in await daemon.ledger.run(lambda led: self._candidates(led, me)):
                    await self._advance(plan)
            with trio.move_on_after(self.poll_s):
                await self._wake.wait()
            self._wake = trio.Event()

    def _candidates(self, led: Ledger, me: str) -> list[str]:
        """Ids of the plans naming this node whose part here is not over, oldest first."""
        out = []
        for e in led.query(kind=bodies.PLAN_KIND):
            pid = e.id.hex()
            if pid in self.over or not bodies.fits(e) or me not in e.body.get("members", []):
                continue
            out.append(pid)
        return out

    async def _advance(self, plan: str) -> None:
        try:
            adv, last = await trio.to_thread.run_sync(self._advance_locked, plan, limiter=self.limiter,
                                                      abandon_on_cancel=True)
        except PlanBusy:  # `atd plan follow` carries it out here now
            self.active.discard(plan)
            return
        except Exception as exc:  # noqa: BLE001 - a malformed [plans] table, a busy disk: one line per
            # distinct reason; the daemon and the other plans go on, and this one is tried again
            self._warn(f"plan {plan[:16]}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            return
        self.last[plan] = adv
        if adv.finished or (adv.decision is None and time.time() > last):
            self.over.add(plan)
            self.active.discard(plan)
            log.info("plan %s: this node's part is over (%s)", plan[:16],
                     adv.refused or adv.decision or "not accepted before the last deadline")
        elif adv.decision == "accept":
            self.active.add(plan)
        else:
            self.active.discard(plan)  # waits for `atd plan accept`: the ledger stamp moves then

    def _advance_locked(self, plan: str) -> tuple[Advance, float]:
        """`advance` under the plan's lock (PlanBusy when a follower holds it), and the plan's last deadline."""
        with follower_lock(self.home, plan):
            adv = advance(self.home, plan)
        with Ledger.open(self.home.ledger_db) as led:
            view = load_view(led, plan, check=False)
        return adv, max((view.deadline(s) for s in view.steps), default=0)

    def _warn(self, line: str) -> None:
        if line not in self._warned:
            self._warned.add(line)
            log.warning("%s", line)
