"""The VGS-ATD scenario runner on the in-memory back-end (real daemons, simulated network).

Phase by phase, the nodes of the cohorts that join in that phase start their daemons and
bootstrap to nodes already up; faults scheduled for the phase are applied first. Then the
phase's mode runs (each step is a `vgs_ops.NodeOps` call: the library function behind
the matching CLI command; weights and features travel only as signed entries + blobs):

horizontal   node-to-node transfer inside each joining group — the group's first node
             trains (from the group's current extractor if the group exists), the others
             start from its published weights with `freeze_blocks` blocks frozen — every
             node publishes its full weights, and every member averages them once
             (`atd aggregate --mode horizontal`): the global model predicts directly.
vertical     a shared base (the group's current extractor, published by a member, or the
             first joiner's own) is fine-tuned by each joiner, which publishes its
             extractor only; every member fuses base + joiners' extractors; then every
             node extracts CLS features with its fused extractor, seals them to every
             other node, and fits one PCA -> MLP + RF + SVM ensemble over the union of the
             label spaces from all the features it can open.
hierarchical each new group first does its own horizontal round; then every group's
             extractor is published and every node combines the group extractors with
             `sqrt-classes` / `model-count` weights (`protocols.hierarchical`) — existing
             groups are reused, never retrained — followed by the shared-features
             ensemble as in vertical mode.

Every wait (for a peer's entry and blob) has the scenario's `step_deadline_s`; a wait
that runs out is recorded and the step goes on with what arrived. Times: network time is
the simulated time a phase took (compute does not advance the simulated clock); compute
is measured per step; "ready" is the phase's network time plus its critical path of
compute (steps of different nodes in one stage run in parallel on real hardware).
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import trio

from atdnode.data import LabeledImages
from atdnode.features import extract_features
from atdnode.training import TrainOptions
from netsim.baselines import PhaseResult, evaluate_phase
from netsim.faults import FaultOutcome, apply_fault, pick_bootstrap
from netsim.learn import model_config, predict, to_global
from netsim.nodedata import ScenarioData, write_node_npz
from netsim.scenario import Scenario
from netsim.vgs_ops import EnsembleCache, NodeOps, Pub, Step


@dataclass
class NodeState:
    model_id: str | None = None  # the node's current model (global / fused / combined)
    kind: str = "none"  # global | ensemble | none
    ensemble: object | None = None
    ens_classes: list[str] = field(default_factory=list)
    outcome: str = "not started"


@dataclass
class Group:
    name: str
    members: list[str]
    classes: set[str]


class VgsRunner:
    """Runs the VGS-ATD phases of `scn` on `cluster` (a `memnet.MemCluster` whose homes hold
    the scenario's nodes); produces one `PhaseResult` per phase."""

    def __init__(self, scn: Scenario, data: ScenarioData, cluster, workdir: Path, *, log=print,
                 real_clock: bool = False) -> None:
        self.scn, self.data, self.cluster, self.log = scn, data, cluster, log
        self.real_clock = real_clock
        self.ops: dict[str, NodeOps] = {}
        # The data spec (a path) enters weight-set metadata, so its length changes blob sizes:
        # a fixed-length temp directory keeps runs of one scenario byte-for-byte comparable.
        self.data_dir = Path(tempfile.mkdtemp(prefix="atd-netsim-data-"))
        for name, nd in data.nodes.items():
            spec = f"npz:{write_node_npz(nd, self.data_dir / f'{name}.npz')}"
            self.ops[name] = NodeOps(name, cluster.c.homes[name], seed=scn.seed, spec=spec,
                                     cfg=model_config(scn.model, len(nd.classes)))
        self.state = {n: NodeState() for n in data.nodes}
        self.groups: dict[str, Group] = {}
        self.cache = EnsembleCache(seed=scn.seed, pca_components=scn.ensemble.pca_components,
                                   mlp_max_iter=scn.ensemble.mlp_epochs)
        self.fault_log: list[dict] = []
        self._crit: dict[str, float] = {}
        self._out_at: dict[str, float] = {}
        self._res: PhaseResult | None = None

    # ---------------------------------------------------------------- phases

    async def run(self) -> list[PhaseResult]:
        out = []
        try:
            async with self.cluster.running():
                for p in sorted({d.phase for d in self.data.nodes.values()}):
                    out.append(await self._phase(p))
        finally:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        return out

    async def _phase(self, p: int) -> PhaseResult:
        mode = self.scn.phase(p).mode
        res = self._res = PhaseResult("vgs-atd", p)
        res.notes.append(f"mode {mode}")
        self._crit, self._out_at = {}, {}
        await self._refresh()
        before = {n: dict(self.cluster.link_bytes(n)) for n in self.data.nodes}
        t0 = trio.current_time()
        for f in (f for f in self.scn.faults if f.at_phase == p):
            o: FaultOutcome = await apply_fault(self.cluster, f, t0=t0, seed=self.scn.seed, degree=self.scn.topology.degree)
            self.fault_log.append({"phase": p, **o.to_dict()})
            for n in (f.node,) if f.node else ():
                if f.kind in ("kill", "leave"):
                    self.state[n].outcome = f"{'killed' if f.kind == 'kill' else 'left'} before phase {p}"
        joiners = [n for n, d in self.data.nodes.items() if d.phase == p]
        await self._start(joiners)
        for n in joiners:
            g = self.data.nodes[n].group
            grp = self.groups.setdefault(g, Group(g, [], set()))
            if n not in grp.members:
                grp.members.append(n)
            grp.classes |= set(self.data.nodes[n].classes)
        self.log(f"vgs-atd phase {p} ({mode}): {len(joiners)} node(s) join")
        await getattr(self, f"_{mode}")(p, joiners)
        await self._refresh()
        res.bytes = {n: {"sent": self.cluster.link_bytes(n)["sent"] - before[n]["sent"],
                         "received": self.cluster.link_bytes(n)["received"] - before[n]["received"]}
                     for n in self.data.present(p)}
        elapsed = trio.current_time() - t0
        if self.real_clock:  # compute ran on the same clock: the phase took what it took
            res.ready_s = elapsed
            res.notes.append(f"phase took {elapsed:.1f} s (wall clock)")
        else:
            res.ready_s = elapsed + max(self._crit.values(), default=0.0)
            res.notes.append(f"network time {elapsed:.2f} s (simulated)")
        for n in self.data.present(p):
            res.outcomes[n] = self.state[n].outcome
        evaluate_phase(res, self.data, p, {n: self._predictor(n) for n in self.data.present(p)
                                          if self.cluster.alive(n) and self.state[n].kind != "none"})
        return res

    async def _start(self, names: list[str]) -> None:
        for n in names:
            await self.cluster.start(n, pick_bootstrap(self.cluster, n, self.scn.topology.degree, self.scn.seed))
            self.state[n].outcome = "joined"
        with trio.move_on_after(60):
            while any(self.cluster.alive(n) and not self.cluster.peers(n) for n in names) and len(self.alive()) > 1:
                await trio.sleep(0.05)

    async def _refresh(self) -> None:
        if hasattr(self.cluster, "refresh_all"):  # process back-end: fetch the daemons' counters
            await self.cluster.refresh_all()

    def alive(self, names: list[str] | None = None) -> list[str]:
        pool = names if names is not None else list(self.data.nodes)
        return [n for n in pool if self.cluster.alive(n)]

    # ---------------------------------------------------------------- bookkeeping

    def _did(self, node: str, step: Step, after: list[Pub] = ()) -> Step:
        """Account a step's compute on the critical path: it starts when `node` is free and
        the publications it used were out; what it publishes is out when it ends."""
        start = max([self._crit.get(node, 0.0), *(self._out_at.get(p.entry, 0.0) for p in after)])
        self._crit[node] = start + step.seconds
        self._res.compute_s += step.seconds
        if step.pub is not None:
            self._out_at[step.pub.entry] = self._crit[node]
        return step

    async def _wait(self, node: str, pubs: list[Pub], what: str) -> list[Pub]:
        """Get each pub to `node` within the step deadline: its signed entry by gossip / sync,
        then its blob over the blob protocol from the publisher (what `atd fetch` does;
        any connected holder when the publisher is down). Returns the pubs it got."""
        end = trio.current_time() + self.scn.step_deadline_s
        ops = self.ops[node]
        got, why = [], {}
        for p in pubs:  # in publication order, so runs are reproducible
            if p.node == node:
                got.append(p)
                continue
            with trio.move_on_at(end):
                while self.cluster.alive(node) and not ops.has_entry(p):
                    await trio.sleep(0.1)
            if not ops.has_entry(p):
                why[p.node] = "its entry never arrived" if self.cluster.alive(node) else "this node is down"
                continue
            status = await self.cluster.fetch(node, p.blob, p.manifest, [p.node], max(0.0, end - trio.current_time()))
            if status in ("ok", "held"):
                got.append(p)
            else:
                why[p.node] = status
        if why:
            self._res.notes.append(f"{node}: no {what} from " + "; ".join(f"{k} ({v})" for k, v in why.items()))
        return got

    def _train_opts(self, init: Pub | None, freeze: int, node: str) -> TrainOptions:
        t = self.scn.train
        return TrainOptions(epochs=t.epochs, batch_size=t.batch_size, lr=t.lr, weight_decay=t.weight_decay,
                            warmup_epochs=0.5, init_from=init.blob if init else None, freeze_blocks=freeze,
                            seed=self.scn.seed + sum(map(ord, node)), augment=t.augment)

    # ---------------------------------------------------------------- shared steps

    async def _train_publish(self, node: str, init: Pub | None, part: str) -> Pub | None:
        """Wait for `init`, train from it (freezing K blocks) and publish `part`."""
        if init is not None:
            if not await self._wait(node, [init], "the initial weights"):
                self.state[node].outcome = f"no initial weights from {init.node}"
                return None
        freeze = self.scn.train.freeze_blocks if init is not None else 0
        step = self._did(node, self.ops[node].train(self._train_opts(init, freeze, node)), [init] if init else [])
        self.state[node].model_id = step.model_id
        pub = self._did(node, self.ops[node].publish(step.model_id, part)).pub
        await trio.lowlevel.checkpoint()
        return pub

    async def _group_base(self, g: str, exclude: list[str]) -> Pub | None:
        """A member of group `g` (not in `exclude`) publishes the group's current extractor."""
        for m in self.groups[g].members:
            if m not in exclude and self.cluster.alive(m) and self.state[m].model_id:
                return self._did(m, self.ops[m].publish(self.state[m].model_id, "extractor")).pub
        return None

    async def _aggregate(self, node: str, inputs: list[Pub], weighting: str, label: str) -> None:
        got = await self._wait(node, inputs, "weights")
        if not got:
            self.state[node].outcome = "no inputs arrived"
            return
        step = self._did(node, self.ops[node].aggregate(got, weighting), got)
        self.state[node].model_id = step.model_id
        self.state[node].kind = "global"
        self.state[node].outcome = f"{label} ({len(got)}/{len(inputs)} inputs)"

    async def _each(self, nodes: list[str], fn, *args) -> None:
        async with trio.open_nursery() as nursery:
            for n in nodes:
                nursery.start_soon(fn, n, *args)

    async def _group_round(self, g: str, joiners: list[str], base: Pub | None, weighting: str) -> list[Pub]:
        """Node-to-node transfer inside one group; returns the full weight sets published."""
        live = self.alive(joiners)
        if not live:
            return []
        first = await self._train_publish(live[0], base, "full")
        pubs = [first] if first else []
        if first is not None:
            out: dict[str, Pub] = {}

            async def follow(n: str) -> None:
                pub = await self._train_publish(n, first, "full")
                if pub is not None:
                    out[n] = pub

            await self._each(live[1:], follow)
            pubs += [out[n] for n in live[1:] if n in out]
        return pubs

    # ---------------------------------------------------------------- modes

    async def _horizontal(self, p: int, joiners: list[str]) -> None:
        weighting = self.scn.phase(p).weighting
        for g in _groups_of(self.data, joiners):
            gj = [n for n in joiners if self.data.nodes[n].group == g]
            base = await self._group_base(g, gj) if any(m not in gj for m in self.groups[g].members) else None
            pubs = await self._group_round(g, gj, base, weighting)
            spaces = {p_.labels for p_ in pubs}
            if len(spaces) > 1:
                self._res.notes.append(f"group {g}: joiners' label spaces differ; averaging extractors only")
                pubs = [self._did(q.node, self.ops[q.node].publish(self.state[q.node].model_id, "extractor")).pub
                        for q in pubs]
            await self._each(self.alive(gj), self._aggregate, pubs, weighting, "global model, horizontal")

    async def _vertical(self, p: int, joiners: list[str]) -> None:
        weighting = self.scn.phase(p).weighting
        for g in _groups_of(self.data, joiners):
            gj = self.alive([n for n in joiners if self.data.nodes[n].group == g])
            members = self.alive(self.groups[g].members)
            base = await self._group_base(g, gj)
            if base is None and gj:  # a new group: its first node's extractor is the shared base
                base = await self._train_publish(gj[0], None, "extractor")
                gj = gj[1:]
            if base is None:
                continue
            out: dict[str, Pub] = {}

            async def tune(n: str) -> None:
                pub = await self._train_publish(n, base, "extractor")
                if pub is not None:
                    out[n] = pub

            await self._each(gj, tune)
            inputs = [base] + [out[n] for n in gj if n in out]
            await self._each(members, self._aggregate, inputs, weighting, "fused extractor, vertical")
        await self._share_and_fit(p)

    async def _hierarchical(self, p: int, joiners: list[str]) -> None:
        weighting = self.scn.phase(p).weighting
        if weighting not in ("sqrt-classes", "model-count"):
            weighting = "sqrt-classes"
        new = [g for g in _groups_of(self.data, joiners) if all(m in joiners for m in self.groups[g].members)]
        old = [g for g in self.groups if g not in new]
        old_pubs = {g: await self._group_base(g, []) for g in old}
        base = next((b for b in old_pubs.values() if b is not None), None)
        for g in new:
            gj = [n for n in joiners if self.data.nodes[n].group == g]
            pubs = await self._group_round(g, gj, base, "samples")
            await self._each(self.alive(gj), self._aggregate, pubs, "samples", f"group {g} model")
        for g in list(old) + new:  # joiners of an existing group take part as its members
            if g in old and any(n in joiners for n in self.groups[g].members):
                self._res.notes.append(f"group {g}: joiners in hierarchical mode are only evaluated")
        new_pubs = {g: await self._group_base(g, []) for g in new}
        entries = [(g, pub, len(self.groups[g].classes), len(self.groups[g].members))
                   for g, pub in {**old_pubs, **new_pubs}.items() if pub is not None]
        self._res.notes.append("groups combined: " + ", ".join(f"{g} ({c} classes, {m} models)"
                                                               for g, _, c, m in entries))

        async def combine(n: str) -> None:
            got = await self._wait(n, [e[1] for e in entries], "group extractors")
            use = [e for e in entries if e[1] in got]
            if len(use) < 2:
                self._res.notes.append(f"{n}: fewer than two group models arrived; keeps its own")
                return
            step = self._did(n, self.ops[n].combine_groups(use, weighting), [e[1] for e in use])
            self.state[n].model_id = step.model_id
            self.state[n].outcome = f"combined {len(use)} group models ({weighting})"

        await self._each(self.alive([n for n in self.data.present(p) if self.state[n].model_id]), combine)
        await self._share_and_fit(p)

    async def _share_and_fit(self, p: int) -> None:
        """Every live node seals its CLS features to every other and fits the ensemble."""
        nodes = self.alive([n for n in self.data.present(p) if self.state[n].model_id])
        keys = {n: (self.ops[n].peer_id, self.ops[n].x25519_public) for n in nodes}
        pubs: dict[str, Pub] = {}
        own: dict[str, tuple[np.ndarray, np.ndarray, list[str]]] = {}
        for n in nodes:
            others = {m: keys[m] for m in nodes if m != n}
            if not others:
                continue
            step = self._did(n, self.ops[n].share_features(self.state[n].model_id, self.data.nodes[n].train, others))
            pubs[n] = step.pub
            own[n] = (step.detail["X"], step.detail["y"], list(self.data.nodes[n].classes))
        classes = self.data.classes_at(p)

        async def fit(n: str) -> None:
            if n not in own:
                return
            got = await self._wait(n, [q for m, q in pubs.items() if m != n], "shared features")
            parts = {n: own[n]}
            for q in got:
                X, y, names = self.ops[n].open_features(q)
                parts[q.node] = (X, y, names)
            ordered = [parts[m] for m in sorted(parts)]
            have = sorted({c for _, _, names in ordered for c in names}, key=classes.index)
            if len(have) < 2:
                self._res.notes.append(f"{n}: fewer than two classes in the features it holds; no ensemble")
                return
            ens, names, secs = self.cache.fit(ordered, have)
            self._did(n, Step(secs), got)
            st = self.state[n]
            st.kind, st.ensemble, st.ens_classes = "ensemble", ens, names
            st.outcome = f"ensemble over {len(names)} classes from {len(parts)} feature sets"

        await self._each(nodes, fit)

    # ---------------------------------------------------------------- prediction

    def _predictor(self, n: str):
        st = self.state[n]
        model = self.ops[n].load_model(st.model_id)
        space = self.data.label_space
        if st.kind == "global":
            labels = self.ops[n].registry.get(st.model_id).labels
            return lambda images: to_global(predict(model, images), list(labels), space)
        ens, names = st.ensemble, st.ens_classes

        def ens_predict(images: torch.Tensor) -> np.ndarray:
            dummy = LabeledImages(images=images, labels=torch.zeros(len(images), dtype=torch.int64), classes=["_"])
            X, _ = extract_features(model, dummy)
            return to_global(ens.predict(X).astype(np.int64), names, space)

        return ens_predict


def _groups_of(data: ScenarioData, names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        g = data.nodes[n].group
        if g not in out:
            out.append(g)
    return out
