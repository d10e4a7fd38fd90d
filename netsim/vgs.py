"""The VGS-ATD scenario runner on the in-memory back-end (real daemons, simulated network).

Phase by phase, the nodes of the cohorts that join in that phase start their daemons and
bootstrap to nodes already up; faults scheduled for the phase are applied first. Then the
phase's mode runs (each step is a `vgs_ops.NodeOps` call: the library function behind
the matching CLI command; weights and features travel only as signed entries + blobs):

horizontal   node-to-node transfer inside each joining group — the group's first node
             trains (from the group's current extractor if the group exists), the others
             start from its published weights with `freeze_blocks` blocks frozen — every
             node publishes its full weights, and every member averages them once and fits
             the ensemble on the fused extractor (`atd aggregate --mode horizontal`, the
             paper's default); then the features round below.
vertical     a shared base (the group's current extractor, published by a member, or the
             first joiner's own) is fine-tuned by each joiner, which publishes its
             extractor only; every member runs `atd aggregate --mode vertical` on base +
             joiners' extractors (same inputs, so the same fused extractor everywhere).
hierarchical each new group first does its own horizontal round; then every node runs
             `atd aggregate --mode hierarchical` with one group per aggregate entry (a
             group's latest horizontal or vertical aggregate) — existing groups are reused,
             never retrained; C_i and n_i are read from the signed entries. The new group's
             first node starts from the consortium's shared base (the paper's §3.3: each
             group from its pretrained W_p), or, with the phase's `group_start =
             "consortium"` (a deviation), from the latest fused extractor of the
             first existing group, published by one of its members (node-to-node transfer
             across groups, as the paper's horizontal mode does inside one).

Features round (every mode): after the first aggregation each node seals the pre-logits
features (CLS token; for the GAP ViT the mean of the patch tokens) of its data under its new
extractor to the step's other nodes (`atd share-features`), waits for theirs and aggregates
again with the same inputs: the same fused extractor, an ensemble on every feature set it
could open. Each phase ends by re-verifying every `aggregate` entry it produced on its
author (`atd aggregate --verify`, missing input blobs fetched first); the report says how
many verified. Shared start: a node that trains from nothing starts from the consortium's
base (its MSD base, `base = "msd"`, or one seeded `consortium_init` every node derives the
same way), so the groups of a hierarchical run share one `base` fingerprint.

Every wait (for a peer's entry and blob) has the scenario's `step_deadline_s`; one that runs
out is recorded and the step goes on with what arrived. Times: network time is the phase's
simulated time (compute does not advance the clock); "ready" adds the critical path of the
measured compute. Scores: each node's consortium model; per node, with `[scenario]
val_fraction`, the model `atd classify` uses by default (`netsim.vgs_keep`).
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import trio

from atdnode.errors import AtdError
from atdnode.learning import TrainOptions
from netsim.baselines import PhaseResult, evaluate_phase
from netsim.faults import FaultOutcome, apply_fault, pick_bootstrap
from netsim.learn import global_probs, model_config
from netsim.nodedata import ScenarioData, node_spec
from netsim.references import ensemble_options
from netsim.scenario import Scenario
from netsim.vgs_keep import score_kept
from netsim.vgs_ops import NodeOps, Pub, Step


@dataclass
class NodeState:
    model_id: str | None = None  # the node's current model (trained / global)
    kind: str = "none"  # trained | global | none
    agg: Pub | None = None  # its latest aggregate entry (a group model in hierarchical mode)
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
                 real_clock: bool = False, base_files: dict[str, Path] | None = None) -> None:
        self.scn, self.data, self.cluster, self.log = scn, data, cluster, log
        # base = "msd": each node's assembled MSD base (`netsim.msdbase`), where training
        # would otherwise start from random init (`atd train --init-from FILE`)
        self.base_files = dict(base_files or {})
        self.msd = bool(self.base_files)
        self.real_clock = real_clock
        self.ops: dict[str, NodeOps] = {}
        # The data spec (a path) enters weight-set metadata, so its length changes blob sizes:
        # a fixed-length temp directory keeps runs of one scenario byte-for-byte comparable.
        self.data_dir = Path(tempfile.mkdtemp(prefix="atd-netsim-data-"))
        ens = ensemble_options(scn)
        if not self.base_files:  # from scratch: one seeded consortium init that every group starts from
            founder = next(iter(data.nodes))
            init = consortium_init(scn, founder, len(data.nodes[founder].classes),
                                   self.data_dir / "consortium-init.safetensors")
            self.base_files = {n: init for n in data.nodes}
        for name, nd in data.nodes.items():
            spec = node_spec(nd, self.data_dir / f'{name}.npz')
            self.ops[name] = NodeOps(name, cluster.c.homes[name], seed=scn.seed, spec=spec,
                                     cfg=model_config(scn.model, len(nd.classes)), ensemble=ens)
        self.state = {n: NodeState() for n in data.nodes}
        self.groups: dict[str, Group] = {}
        self._produced: list[Pub] = []  # aggregate entries of the current phase
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
        self._produced = []
        await getattr(self, f"_{mode}")(p, joiners)
        await self._verify_phase()
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
        res.outcomes.update({n: self.state[n].outcome for n in self.data.present(p)})
        scored = [n for n in self.data.present(p) if self.cluster.alive(n) and self.state[n].kind != "none"]
        evaluate_phase(res, self.data, p, {n: self._predictor(n) for n in scored})
        if self.scn.val_fraction > 0:  # per node: the model `atd classify` uses (netsim.vgs_keep)
            score_kept(res, self.data, self.ops, {n: self.state[n].model_id for n in scored})
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
        t, ft = self.scn.train, self.scn.msd.finetune_lr
        # from the MSD base: its fine-tuning rate (base = "public": [train] is already W_p's, `publicbase.finetune_scenario`)
        lr = ft if self.msd and self.scn.base == "msd" and ft is not None else t.lr
        return replace(t, lr=lr, freeze_blocks=freeze, init_from=init.blob if init else _opt_str(self.base_files.get(node)),
                       seed=self.scn.seed + sum(map(ord, node)))

    # ---------------------------------------------------------------- shared steps

    async def _train_publish(self, node: str, init: Pub | None, part: str) -> Pub | None:
        """Wait for `init`, train from it (freezing K blocks) and publish `part`."""
        if init is not None:
            if not await self._wait(node, [init], "the initial weights"):
                self.state[node].outcome = f"no initial weights from {init.node}"
                return None
        freeze = self.scn.train.freeze_blocks if init is not None else 0
        step = self._did(node, self.ops[node].train(self._train_opts(init, freeze, node)), [init] if init else [])
        self.state[node].model_id, self.state[node].kind = step.model_id, "trained"
        pub = self._did(node, self.ops[node].publish(step.model_id, part)).pub
        await trio.lowlevel.checkpoint()
        return pub

    async def _group_base(self, g: str, exclude: list[str]) -> Pub | None:
        """A member of group `g` (not in `exclude`) publishes the group's current extractor."""
        for m in self.groups[g].members:
            if m not in exclude and self.cluster.alive(m) and self.state[m].model_id:
                return self._did(m, self.ops[m].publish(self.state[m].model_id, "extractor")).pub
        return None

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

    # ---------------------------------------------------------------- aggregation rounds

    async def _agg_round(self, mode: str, nodes: list[str], inputs: list[Pub], weighting: str, label: str) -> None:
        """Every node in `nodes` aggregates `inputs` (`atd aggregate --mode MODE`), shares its
        features under the result with the others and aggregates again (the ensemble now
        fitted on every feature set that arrived)."""
        done: dict[str, list[Pub]] = {}

        async def first(n: str) -> None:
            got = await self._wait(n, inputs, "inputs")
            if len(got) < len(inputs) and (mode == "hierarchical" or not got):
                self.state[n].outcome = f"{label}: {len(got)}/{len(inputs)} inputs arrived; keeps its model"
                return
            if await self._aggregate(n, mode, got, weighting):
                done[n] = got

        await self._each(self.alive(nodes), first)
        sharers = [n for n in nodes if n in done and self.cluster.alive(n)]
        pubs: dict[str, Pub] = {}

        async def share(n: str) -> None:
            others = [m for m in sharers if m != n]
            if not others:
                return
            peers = [self.ops[m].peer_id for m in others]
            with trio.move_on_after(self.scn.step_deadline_s):
                while self.cluster.alive(n) and not self.ops[n].knows_keys(peers):
                    await trio.sleep(0.1)
            try:
                pubs[n] = self._did(n, self.ops[n].share_features(self.state[n].model_id, peers)).pub
            except AtdError as exc:
                self._res.notes.append(f"{n}: could not share features: {exc}")

        await self._each(sharers, share)

        async def second(n: str) -> None:
            got = await self._wait(n, [q for m, q in pubs.items() if m != n], "shared features")
            if got:
                await self._aggregate(n, mode, done[n], weighting, after=got)
            self.state[n].outcome = f"{label} ({len(done[n])}/{len(inputs)} inputs, features from {len(got)} peer(s))"

        await self._each(self.alive(sharers), second)

    async def _aggregate(self, node: str, mode: str, inputs: list[Pub], weighting: str, after: list[Pub] = ()
                         ) -> bool:
        try:
            step = self._did(node, self.ops[node].aggregate(mode, inputs, weighting), [*inputs, *after])
        except AtdError as exc:
            self._res.notes.append(f"{node}: {mode} aggregation failed: {exc}")
            self.state[node].outcome = f"{mode} aggregation failed"
            return False
        st = self.state[node]
        st.model_id, st.kind, st.agg = step.model_id, "global", step.pub
        sizes = "group sizes (from the signed entries): " + ", ".join(
            f"{g['name']} ({g['n_classes']} classes, {g['n_models']} models)" for g in step.detail.get("groups", []))
        for w in step.detail.get("warnings", []):  # e.g. inputs or groups from different bases
            if f"{mode}: {w}" not in self._res.notes:
                self._res.notes.append(f"{mode}: {w}")
        if mode == "hierarchical" and sizes not in self._res.notes:
            self._res.notes.append(sizes)
        self._produced.append(step.pub)
        return True

    async def _verify_phase(self) -> None:
        """Re-verify every aggregate entry of the phase on its author (`atd aggregate --verify`),
        fetching the blobs of the weights entries behind it first."""
        ok, bad = 0, []
        for pub in self._produced:
            n = pub.node
            if not self.cluster.alive(n):
                bad.append(f"{pub.entry[:12]} ({n} is down)")
                continue
            await self._wait(n, self._behind(n, pub.entry), "inputs to verify")
            try:
                self.ops[n].verify(pub.entry)
                ok += 1
            except AtdError as exc:
                bad.append(f"{pub.entry[:12]} ({exc})")
        self._res.verified = {"aggregates": len(self._produced), "verified": ok}
        self._res.notes.append(f"aggregate entries verified: {ok}/{len(self._produced)}"
                               + (" — failed: " + "; ".join(bad) if bad else ""))

    def _behind(self, node: str, entry: str) -> list[Pub]:
        """The weights and group-aggregate entries an aggregate entry rests on (recursively)."""
        from ledger import Ledger

        by_peer = {o.peer_id: m for m, o in self.ops.items()}
        out: list[Pub] = []
        with Ledger.open(self.ops[node].home.ledger_db) as led:
            todo, seen = [entry], set()
            while todo:
                e = led.get(bytes.fromhex(todo.pop()))
                if e is None or e.id in seen:
                    continue
                seen.add(e.id)
                b = e.body
                if e.kind in ("weights", "aggregate") and isinstance(b.get("blob"), str):
                    from ledger import peer_id_from_public_key

                    src = by_peer.get(peer_id_from_public_key(e.author), node)
                    out.append(Pub(src, e.id.hex(), b["blob"], str(b.get("manifest")), e.kind, "", (), 0))
                todo += [h for h in b.get("inputs") or [] if isinstance(h, str)] if e.kind == "aggregate" else []
        return out[1:]

    # ---------------------------------------------------------------- modes

    async def _horizontal(self, p: int, joiners: list[str]) -> None:
        weighting = self.scn.phase(p).weighting
        for g in _groups_of(self.data, joiners):
            gj = [n for n in joiners if self.data.nodes[n].group == g]
            base = await self._group_base(g, gj) if any(m not in gj for m in self.groups[g].members) else None
            pubs = await self._group_round(g, gj, base, weighting)
            if len({p_.labels for p_ in pubs}) > 1:
                self._res.notes.append(f"group {g}: joiners' label spaces differ; averaging extractors only")
                pubs = [self._did(q.node, self.ops[q.node].publish(self.state[q.node].model_id, "extractor")).pub
                        for q in pubs]
            if pubs:
                await self._agg_round("horizontal", gj, pubs, weighting, "global model, horizontal")

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
            await self._agg_round("vertical", members, inputs, weighting, "fused extractor, vertical")

    async def _hierarchical(self, p: int, joiners: list[str]) -> None:
        weighting = self.scn.phase(p).weighting
        if weighting not in ("sqrt-classes", "model-count"):
            weighting = "sqrt-classes"  # the paper's default (Eq. 11)
        new = [g for g in _groups_of(self.data, joiners) if all(m in joiners for m in self.groups[g].members)]
        for g in self.groups:
            if g not in new and any(n in joiners for n in self.groups[g].members):
                self._res.notes.append(f"group {g}: joiners in hierarchical mode are only evaluated")
        old = [g for g in self.groups if g not in new]
        for g in new:  # a new group first learns horizontally on its own
            gj = [n for n in joiners if self.data.nodes[n].group == g]
            start = None  # the paper: from the consortium's shared base
            if self.scn.phase(p).group_start == "consortium" and old:  # deviation: from group old[0]'s model
                start = await self._group_base(old[0], joiners)
                if start is not None:
                    self._res.notes.append(f"group {g} starts from group {old[0]}'s extractor ({start.node}'s "
                                           f"{self.state[start.node].kind} model)")
            pubs = await self._group_round(g, gj, start, "uniform")
            if pubs:
                await self._agg_round("horizontal", gj, pubs, "uniform", f"group {g} model")
        groups = []
        for g in self.groups:  # each group's latest aggregate entry is its group model
            m = next((m for m in self.groups[g].members if self.cluster.alive(m) and self.state[m].agg), None)
            if m is not None:
                groups.append((replace(self.state[m].agg, part=g), self.state[m].agg.part))
        self._res.notes.append("groups combined: " + ", ".join(f"{q.part} ({q.node}'s {mode} aggregate)"
                                                               for q, mode in groups))
        groups = [q for q, _ in groups]
        if len(groups) < 2:
            self._res.notes.append("fewer than two group models; nothing to combine")
            return
        nodes = self.alive([n for n in self.data.present(p) if self.state[n].model_id])
        await self._agg_round("hierarchical", nodes, groups, weighting, f"combined {len(groups)} groups ({weighting})")

    # ---------------------------------------------------------------- prediction

    def _predictor(self, n: str):
        model_id, space, ops = self.state[n].model_id, self.data.label_space, self.ops[n]

        def pred(images: torch.Tensor) -> np.ndarray:
            names, probs = ops.probabilities(model_id, images)
            return global_probs(probs, names, space)

        return pred


def consortium_init(scn: Scenario, founder: str, num_classes: int, path: Path) -> Path:
    """The consortium's shared start when there is no MSD base: the founder's initial
    extractor (the scenario's model at timm's init under the founder's training seed, as
    `_train_opts` sets it, and its class count, which decides the init order), as a
    safetensors checkpoint (`atd train --init-from FILE`). Every node derives it the same way;
    every node that trains from nothing starts here, so every group of a hierarchical run
    shares one `base` fingerprint (group B trained from its own random start, and
    the combined extractor scored like a random body), and the founder trains exactly as
    it did before."""
    from safetensors.torch import save_file

    from atdnode.learning import build_model, extractor_state

    torch.manual_seed(scn.seed + sum(map(ord, founder)))  # the founder's seed in `_train_opts`
    model = build_model(model_config(scn.model, num_classes))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in extractor_state(model).items()}, str(path))
    return path


def _groups_of(data: ScenarioData, names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        g = data.nodes[n].group
        if g not in out:
            out.append(g)
    return out


def _opt_str(p: Path | None) -> str | None:
    return None if p is None else str(p)
