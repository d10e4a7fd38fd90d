"""A plan file as a netsim scenario: the signed plan of `atd plan`, carried out by netsim's nodes.

`[scenario] plan = "FILE"` (relative to the scenario file; `atd netsim run SCENARIO --plan
FILE`) with method "plan" runs the plan file (README: Plans) on the scenario's back-end with
the functions `atd plan` calls, and nothing else: the founder (the scenario's first node)
proposes it (`atdnode.plans.propose`) and accepts it if it takes part (`decide`); every node's
`[plans]` policy accepts plans from the founder by itself and maps every data name the plan
uses to the node's own share of the scenario's data (its `npz:` spec: training split for
train and aggregate steps, test split for classify steps); then each live node advances the
plan (`advance`, what `atd plan follow` repeats) while the daemons replicate the entries and
fetch the blobs, until every live node is finished or `[scenario] deadline_s` has passed.
The plan names members by the scenario's node names; its `[model]` is the ViT its train steps
build, so the scenario's `[model]` must read images at the same size (`netsim.plan_check`).

Report (`report["plan"]`): per step and member its state, results, metrics, who it went on
without and its seconds (`atdnode.plans.progress`, each member's row as its own ledger holds
it); the method's phase result (`report["methods"]["plan"]`) is netsim's usual evaluation
(`netsim.baselines.evaluate_phase`): each node's resulting model -- the model of its last
finished step that names one (a train, publish, aggregate or classify step) -- on its own
test split and on the pooled test set; every aggregate the plan signed is re-verified on its
author (`atd aggregate --verify`), as netsim's VGS-ATD runner does.

Time: on the memory back-end the plan's clock is the simulated one -- a step's deadline passes
after that many simulated seconds (`advance(now=...)`) -- and compute does not advance it;
`ready_s` is the simulated time (the followers poll every POLL_S while steps run, as `atd plan
follow` polls) plus the critical path of the steps' measured compute. On the process back-end
both are wall time. Faults (`[[faults]]`) apply to vgs-atd only.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
import trio

from atdnode.errors import AtdError
from atdnode.node import NodeConfig, NodeHome
from ledger import Ledger
from netsim.baselines import PhaseResult, evaluate_phase
from netsim.faults import pick_bootstrap
from netsim.learn import global_probs
from netsim.nodedata import ScenarioData, node_spec
from netsim.plan_check import METHOD, data_names, read_plan
from netsim.scenario_spec import Scenario

POLL_S = 0.5  # between two rounds of `advance` while a step ran; doubled while none did, up to MAX_POLL_S
MAX_POLL_S = {False: 30.0, True: 2.0}  # simulated clock | wall clock


class PlanRunner:
    """Carries out the plan of `scn` on `cluster` (`memnet.MemCluster` or `procnet.ProcCluster`
    over the scenario's nodes); `run` returns (phase result, the plan's report)."""

    def __init__(self, scn: Scenario, data: ScenarioData, cluster, work: Path, *, log=print,
                 real_clock: bool = False) -> None:
        self.scn, self.data, self.cluster, self.log, self.real_clock = scn, data, cluster, log, real_clock
        self.doc = read_plan(scn.plan)
        self.names = list(data.nodes)
        self.founder = cluster.names[0]  # make_consortium: the first node founds the consortium
        self.homes: dict[str, NodeHome] = cluster.c.homes
        used = data_names(self.doc)
        for name, nd in data.nodes.items():  # the node's [plans] policy: `atd config set` would write the same
            spec = node_spec(nd, work / "data" / f"{name}.npz")
            cfg = NodeConfig.load(self.homes[name])
            # `run` is each node's one follower (`atd plan follow`, on the scenario's clock): a
            # daemon that carries out accepted plans by itself leaves them to it (daemon = false)
            cfg.extra["plans"] = {"auto_accept_from": [self.founder], "daemon": False, "data": {d: spec for d in used}}
            cfg.save(self.homes[name])

    async def run(self) -> tuple[PhaseResult, dict]:
        from atdnode.plans import decide, load_view, propose

        res = PhaseResult(METHOD, 1)
        async with self.cluster.running():
            await self._start()
            before = {n: dict(self.cluster.link_bytes(n)) for n in self.names}
            plan = propose(self.homes[self.founder], self.doc)
            with Ledger.open(self.homes[self.founder].ledger_db) as led:
                view = load_view(led, plan)
            if self.cluster.peer_ids[self.founder] in view.body["members"]:
                decide(self.homes[self.founder], plan, "accept")
            self.log(f"plan {self.doc['name']!r} ({plan[:12]}) proposed by {self.founder}")
            t0 = trio.current_time()
            finished = await self._follow(plan, view.body["created"], t0)
            elapsed = trio.current_time() - t0
            if hasattr(self.cluster, "refresh_all"):  # process back-end: the daemons' counters
                await self.cluster.refresh_all()
            res.bytes = {n: {k: self.cluster.link_bytes(n)[k] - before[n][k] for k in ("sent", "received")}
                         for n in self.names}
        rows = self._rows(plan)
        if not finished:
            res.notes.append(f"the plan was not finished after deadline_s ({self.scn.deadline_s:g} s): "
                             + ", ".join(f"{r['member']} {r['step']}" for r in rows if r["state"] == "waiting"))
        res.compute_s = sum(r["seconds"] or 0.0 for r in rows)
        res.ready_s = elapsed if self.real_clock else elapsed + critical_path(view.steps, rows)
        res.notes.append(f"plan {self.doc['name']!r}: {sum(r['state'] == 'done' for r in rows)} of {len(rows)} "
                         "member steps done; " + (f"took {elapsed:.1f} s (wall clock)" if self.real_clock else
                                                  f"network time {elapsed:.2f} s (simulated)"))
        models = resulting_models(view.steps, rows)
        res.outcomes = {n: _outcome(n, rows, models) for n in self.names}
        res.verified = self._verify(view.steps, rows)
        res.notes.append(f"aggregate entries verified: {res.verified['verified']}/{res.verified['aggregates']}")
        evaluate_phase(res, self.data, 1, {n: self._predictor(n, m) for n, m in models.items()})
        return res, {"file": str(self.scn.plan), "name": self.doc["name"], "id": plan, "proposer": self.founder,
                     "complete": finished, "steps": rows, "models": models}

    # ---------------------------------------------------------------- following

    async def _start(self) -> None:
        """Every node's daemon up; then wait (step deadline) until every node's ledger names every
        node: plans name members, and sealed features need each recipient's announced key."""
        from atdnode.plans import member_names

        for n in self.names:
            await self.cluster.start(n, pick_bootstrap(self.cluster, n, self.scn.topology.degree, self.scn.seed))
        want = set(self.names)

        def named(n: str) -> bool:
            with Ledger.open(self.homes[n].ledger_db) as led:
                return want <= set(member_names(led).values())

        with trio.move_on_after(self.scn.step_deadline_s):
            while not all(named(n) for n in self.names):
                await trio.sleep(0.1)

    async def _follow(self, plan: str, created: int, t0: float) -> bool:
        """`advance` on every live node in turn until each is finished (True) or deadline_s passed."""
        from sklearn.exceptions import ConvergenceWarning

        from atdnode.plans import PlanError, advance

        poll = POLL_S
        while True:
            now = None if self.real_clock else created + (trio.current_time() - t0)
            ran, finished = False, True
            for n in (n for n in self.names if self.cluster.alive(n)):
                with warnings.catch_warnings():  # a capped MLP iteration count is a setting, not news
                    warnings.simplefilter("ignore", ConvergenceWarning)
                    try:
                        adv = advance(self.homes[n], plan, now=now)
                    except PlanError:  # the plan has not reached this node yet (`atd plan follow` waits too)
                        finished = False
                        continue
                for sid in adv.ran:
                    self.log(f"plan: {n} recorded step {sid}")
                ran, finished = ran or bool(adv.ran), finished and adv.finished
            if finished:
                return True
            if trio.current_time() - t0 > self.scn.deadline_s:
                return False
            poll = POLL_S if ran else min(2 * poll, MAX_POLL_S[self.real_clock])
            await trio.sleep(poll)

    # ---------------------------------------------------------------- results

    def _rows(self, plan: str) -> list[dict]:
        """`progress` rows (and the model each step recorded), each member's as its own ledger
        holds them, with member names for peer ids."""
        from atdnode.plans import load_view, progress

        by_id = {p: n for n, p in self.cluster.peer_ids.items()}
        mine: dict[tuple[str, str], dict] = {}
        order: list[dict] = []
        for n in [self.founder] + [n for n in self.names if n != self.founder]:
            with Ledger.open(self.homes[n].ledger_db) as led:
                try:
                    view = load_view(led, plan, check=False)
                except AtdError:  # the plan never reached this node: the founder's rows say so
                    continue
            rows = [dict(r, model=(view.results.get((r["step"], r["member"])) or {}).get("model"))
                    for r in progress(view)]
            order = order or rows
            mine.update({(r["step"], r["member"]): r for r in rows if by_id.get(r["member"]) == n})
        return [dict(mine.get((r["step"], r["member"]), r), member=by_id.get(r["member"], r["member"]),
                     missing=[by_id.get(m, m) for m in r["missing"]]) for r in order]

    def _verify(self, steps: list[dict], rows: list[dict]) -> dict[str, int]:
        """Re-verify every aggregate the plan signed on its author (`atd aggregate --verify`)."""
        from atdnode.aggregation import verify_aggregate

        kinds = {s["id"]: s["kind"] for s in steps}
        done = [(r["member"], e) for r in rows if kinds[r["step"]] == "aggregate" and r["state"] == "done"
                for e in r["results"]]
        ok = 0
        for node, entry in done:
            try:
                verify_aggregate(self.homes[node], entry)
                ok += 1
            except AtdError as exc:
                self.log(f"plan: {node}'s aggregate {entry[:12]} did not verify: {exc}")
        return {"aggregates": len(done), "verified": ok}

    def _predictor(self, n: str, model_id: str):
        """The probabilities `atd classify` takes its prediction from (the arg-max), in the
        scenario's label space."""
        from atdnode.blobs import BlobStore
        from atdnode.learning import class_probabilities, resolve_device
        from atdnode.models import ModelRegistry

        store, record = BlobStore(self.homes[n].blobs_dir), ModelRegistry(self.homes[n]).get(model_id)
        space = self.data.label_space

        def pred(images: torch.Tensor) -> np.ndarray:
            names, probs, _ = class_probabilities(store, record, images, device=resolve_device(None))
            return global_probs(probs, names, space)

        return pred


def resulting_models(steps: list[dict], rows: list[dict]) -> dict[str, str]:
    """Node -> the model of its last finished step (plan order) that names one."""
    order = {s["id"]: i for i, s in enumerate(steps)}
    out: dict[str, str] = {}
    for r in sorted(rows, key=lambda r: order[r["step"]]):
        if r["state"] == "done" and r.get("model"):
            out[r["member"]] = r["model"]
    return out


def critical_path(steps: list[dict], rows: list[dict]) -> float:
    """Seconds of compute on the longest chain of finished member steps: a member's step starts
    when its own previous step and every member's result of each input step are done."""
    from atdnode.plans import step_inputs

    secs = {(r["step"], r["member"]): float(r["seconds"] or 0.0) for r in rows if r["state"] in ("done", "failed")}
    end: dict[tuple[str, str], float] = {}
    last: dict[str, float] = {}
    for s in steps:
        ins = step_inputs(s)
        for (sid, m), t in secs.items():
            if sid != s["id"]:
                continue
            start = max([last.get(m, 0.0), *(v for (d, _), v in end.items() if d in ins)])
            end[(sid, m)] = last[m] = start + t
    return max(end.values(), default=0.0)


def _outcome(node: str, rows: list[dict], models: dict[str, str]) -> str:
    mine = [r for r in rows if r["member"] == node]
    if not mine:
        return "takes no part in the plan"
    if mine[0]["decision"] == "decline":
        return "declined the plan"
    done = sum(r["state"] == "done" for r in mine)
    failed = [r for r in mine if r["state"] == "failed"]
    waiting = [r["step"] for r in mine if r["state"] == "waiting"]
    out = f"{done}/{len(mine)} step(s) done"
    out += "".join(f"; {r['step']} failed: {r['reason']}" for r in failed)
    out += f"; still waiting: {', '.join(waiting)}" if waiting else ""
    return out + ("" if node in models else "; no model")


def run_plan(scn: Scenario, data: ScenarioData, work: Path, *, progress=lambda _m: None
             ) -> tuple[PhaseResult, dict, list[str]]:
    """The plan of `scn` on its back-end: (phase result, the plan's report, notes)."""
    t = scn.topology
    notes = ["faults apply to vgs-atd only: the plan ran without them"] if scn.faults else []
    if scn.backend == "memory":
        from atdnode.blobs import volatile_disk
        from netsim.memnet import MemCluster, simulate

        cluster = MemCluster(work / "homes", list(data.nodes), seed=scn.seed, network=scn.network,
                             sync_interval=t.sync_interval_s, poll_interval=t.poll_interval_s, max_peers=t.max_peers,
                             roles=scn.node_roles())
        runner = PlanRunner(scn, data, cluster, work, log=progress)
        with volatile_disk():  # simulated homes: no fsync (atdnode.blobs.fs)
            res, info = simulate(runner.run, seed=scn.seed)
        return res, info, notes
    from netsim.procnet import ProcCluster, run_trio

    cluster = ProcCluster(work / "procs", list(data.nodes), seed=scn.seed, network=scn.network,
                          sync_interval=t.sync_interval_s, roles=scn.node_roles())
    runner = PlanRunner(scn, data, cluster, work, log=progress, real_clock=True)
    res, info = run_trio(runner.run)
    if cluster.netns is None:
        notes.append("process back-end: bytes are what each daemon's transport counted (gossip and libp2p stream "
                      "frames); the blobs the daemons fetched by themselves moved over their bulk TCP channel, "
                      "outside these counters")
    return res, info, notes + cluster.notes
