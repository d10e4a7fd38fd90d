"""Cross-field checks of a parsed scenario (`netsim.scenario.validate` calls `check`; the
types come from `netsim.scenario_spec`, which imports neither module).

Each failure is a `ScenarioError` naming the file and the key path, e.g.
`demo.toml: faults[2].node: unknown node 'h9'`.
"""
from __future__ import annotations

from netsim.scenario_spec import (
    BACKENDS,
    BASES,
    FAULTS,
    GROUP_STARTS,
    METHODS,
    MODES,
    PARTITIONS,
    WEIGHTINGS,
    CohortSpec,
    FaultSpec,
    KeyReader,
    Scenario,
    WorkloadSpec,
)


def check(s: Scenario) -> None:
    """Cross-field checks; raises ScenarioError naming the offending key."""
    c = KeyReader(s.source)
    if s.backend not in BACKENDS:
        raise c.fail("scenario.backend", f"{s.backend!r} is not one of {', '.join(BACKENDS)}")
    for m in s.methods:
        if m not in METHODS:
            raise c.fail("scenario.methods", f"{m!r} is not one of {', '.join(METHODS)}")
    if not s.methods:
        raise c.fail("scenario.methods", "must name at least one method")
    _check_base(c, s)
    _positive(c, "scenario.deadline_s", s.deadline_s)
    if not 0 <= s.val_fraction < 1:
        raise c.fail("scenario.val_fraction", f"{s.val_fraction} must be in [0, 1) (0: no val split)")
    # each [model] value and num_heads | embed_dim are the config's own invariants (vit_config)
    if s.model.img_size % s.model.patch_size:
        raise c.fail("model.patch_size", f"{s.model.patch_size} does not divide img_size {s.model.img_size}")
    for k in ("epochs", "batch_size"):
        _positive(c, f"train.{k}", getattr(s.train, k))
    _positive(c, "train.lr", s.train.lr)
    if not 0 <= s.train.freeze_blocks <= s.model.depth:
        raise c.fail("train.freeze_blocks", f"{s.train.freeze_blocks} out of range 0..{s.model.depth}")
    _positive(c, "baselines.rounds", s.baselines.rounds)
    _positive(c, "baselines.local_epochs", s.baselines.local_epochs)
    if s.baselines.fedprox_mu != 0:
        raise c.fail("baselines.fedprox_mu", "FedProx is not offered: fedavg runs through `atd rounds` (set 0)")
    if not 0 <= s.baselines.adv_ratio <= 1:
        raise c.fail("baselines.adv_ratio", "must be in [0, 1]")
    if s.baselines.optimizer not in ("adamw", "sgd"):
        raise c.fail("baselines.optimizer", f"{s.baselines.optimizer!r} is not one of adamw, sgd")
    if not 0 <= s.baselines.lr_decay < 1:
        raise c.fail("baselines.lr_decay", "must be in [0, 1)")
    if s.baselines.pgd_eps < 0 or s.baselines.pgd_steps < 0:
        raise c.fail("baselines.pgd_eps" if s.baselines.pgd_eps < 0 else "baselines.pgd_steps", "must be >= 0")
    _positive(c, "ensemble.pca_components", s.ensemble.pca_components)
    from protocols.ensemble import PRIORS

    if s.ensemble.prior not in PRIORS:
        raise c.fail("ensemble.prior", f"{s.ensemble.prior!r}: choose from {', '.join(PRIORS)}")
    _check_network(c, s)
    names = s.node_names()
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise c.fail("cohorts", f"node name(s) used twice: {', '.join(dup)}")
    ds_names = [d.name for d in s.datasets]
    if len(set(ds_names)) != len(ds_names):
        raise c.fail("datasets", "dataset names must be unique")
    for i, co in enumerate(s.cohorts):
        _check_cohort(c, f"cohorts[{i}]", co, ds_names)
    if s.cohorts:
        phases = s.phase_numbers()
        if phases[0] != 1 or phases != list(range(1, len(phases) + 1)):
            raise c.fail("cohorts", f"phases must be 1, 2, ... without gaps (got {phases})")
    known = set(s.phase_numbers())
    for i, ph in enumerate(s.phases):
        w = f"phases[{i}]"
        if ph.phase not in known:
            raise c.fail(f"{w}.phase", f"no cohort joins in phase {ph.phase}")
        if ph.mode not in MODES:
            raise c.fail(f"{w}.mode", f"{ph.mode!r} is not one of {', '.join(MODES)}")
        if ph.weighting not in WEIGHTINGS:
            raise c.fail(f"{w}.weighting", f"{ph.weighting!r} is not one of {', '.join(WEIGHTINGS)}")
        if ph.group_start not in GROUP_STARTS:
            raise c.fail(f"{w}.group_start", f"{ph.group_start!r} is not one of {', '.join(GROUP_STARTS)}")
        if ph.group_start != "base" and ph.mode != "hierarchical":
            raise c.fail(f"{w}.group_start", "only a hierarchical phase has new groups to start")
        if ph.phase == 1 and ph.mode == "hierarchical":
            raise c.fail(f"{w}.mode", "phase 1 cannot be hierarchical (there is no earlier group)")
    for i, f in enumerate(s.faults):
        _check_fault(c, f"faults[{i}]", f, set(names), known)
    if s.workload is not None:
        _check_workload(c, s.workload, set(names))
    t = s.topology
    if t.nodes < 0 or t.degree < 1 or t.max_peers < 1:
        raise c.fail("topology", "nodes must be >= 0, degree and max_peers >= 1")
    if t.peers not in ("daemon", "lite"):
        raise c.fail("topology.peers", f"{t.peers!r} is not one of daemon, lite")
    if t.peers == "lite" and s.learning:
        raise c.fail("topology.peers", "gossip-only \"lite\" peers cannot train; use \"daemon\" with cohorts")
    _positive(c, "topology.sync_interval_s", t.sync_interval_s)
    _positive(c, "topology.poll_interval_s", t.poll_interval_s)
    _positive(c, "scenario.step_deadline_s", s.step_deadline_s)
    if not names:
        raise c.fail("cohorts", "the scenario has no nodes (add [[cohorts]] or [topology] nodes)")
    if s.plan or "plan" in s.methods:
        from netsim.plan import check_plan_scenario

        check_plan_scenario(c, s)
    if "vgs-atd" not in s.methods and not s.learning and s.workload is None:
        raise c.fail("scenario", "nothing to run: no cohorts and no workload")


def _positive(c: KeyReader, where: str, v: float) -> None:
    if not v > 0:
        raise c.fail(where, f"must be > 0, got {v!r}")


def _check_network(c: KeyReader, s: Scenario) -> None:
    n = s.network
    if n.latency_ms < 0:
        raise c.fail("network.latency_ms", "must be >= 0")
    if n.bandwidth_mbps is not None:
        _positive(c, "network.bandwidth_mbps", n.bandwidth_mbps)
    if not 0 <= n.loss < 1:
        raise c.fail("network.loss", f"must be in [0, 1), got {n.loss}")
    if n.namespaces not in ("off", "auto"):
        raise c.fail("network.namespaces", f"{n.namespaces!r} is not one of off, auto")
    if not 0 <= n.jitter < 1:
        raise c.fail("network.jitter", f"must be in [0, 1), got {n.jitter}")
    nodes = set(s.node_names())
    for i, l in enumerate(n.links):
        for end in (l.a, l.b):
            if end not in nodes:
                raise c.fail(f"network.links[{i}]", f"unknown node {end!r}")
        _link_values(c, f"network.links[{i}]", l.latency_ms, l.bandwidth_mbps, l.loss)


def _link_values(c: KeyReader, where: str, latency: float | None, bw: float | None, loss: float | None) -> None:
    if latency is not None and latency < 0:
        raise c.fail(f"{where}.latency_ms", "must be >= 0")
    if bw is not None and not bw > 0:
        raise c.fail(f"{where}.bandwidth_mbps", "must be > 0")
    if loss is not None and not 0 <= loss < 1:
        raise c.fail(f"{where}.loss", "must be in [0, 1)")


def _check_cohort(c: KeyReader, w: str, co: CohortSpec, datasets: list[str]) -> None:
    if not co.nodes:
        raise c.fail(f"{w}.nodes", "must name at least one node")
    if co.dataset not in datasets:
        raise c.fail(f"{w}.dataset", f"{co.dataset!r} is not a [[datasets]] name (have {', '.join(datasets) or 'none'})")
    if co.phase < 1:
        raise c.fail(f"{w}.phase", "must be >= 1")
    if co.partition not in PARTITIONS:
        raise c.fail(f"{w}.partition", f"{co.partition!r} is not one of {', '.join(PARTITIONS)}")
    if co.partition in ("label_skew", "quantity_skew") and co.fractions is None and not co.alpha > 0:
        raise c.fail(f"{w}.alpha", "must be > 0")
    if co.fractions is not None:
        if co.partition != "quantity_skew":
            raise c.fail(f"{w}.fractions", "only applies to partition = \"quantity_skew\"")
        if len(co.fractions) != len(co.nodes) or any(f <= 0 for f in co.fractions):
            raise c.fail(f"{w}.fractions", f"needs one positive number per node ({len(co.nodes)})")
    if (co.class_shares is not None) != (co.partition == "class_shares"):
        raise c.fail(f"{w}.class_shares", "partition = \"class_shares\" needs class_shares, and only it takes them")
    if co.class_shares is not None and (len(co.class_shares) != len(co.nodes)
                                        or any(f < 0 for s in co.class_shares for f in s)
                                        or any(sum(s) <= 0 for s in co.class_shares)):
        raise c.fail(f"{w}.class_shares", f"needs one list of non-negative shares per node ({len(co.nodes)})")
    if co.class_sets is not None:
        if co.partition != "disjoint":
            raise c.fail(f"{w}.class_sets", "only applies to partition = \"disjoint\"")
        if len(co.class_sets) != len(co.nodes):
            raise c.fail(f"{w}.class_sets", f"needs one class list per node ({len(co.nodes)})")
        flat = [x for cs in co.class_sets for x in cs]
        if len(set(flat)) != len(flat) or any(not cs for cs in co.class_sets):
            raise c.fail(f"{w}.class_sets", "class lists must be non-empty and disjoint")
        if co.classes is not None and not set(flat) <= set(co.classes):
            raise c.fail(f"{w}.class_sets", "names classes outside the cohort's classes")
    for k in ("train_samples", "test_samples"):
        v = getattr(co, k)
        if v is not None and v < len(co.nodes):
            raise c.fail(f"{w}.{k}", f"must be at least the node count ({len(co.nodes)})")


def _check_fault(c: KeyReader, w: str, f: FaultSpec, nodes: set[str], phases: set[int]) -> None:
    if f.kind not in FAULTS:
        raise c.fail(f"{w}.kind", f"{f.kind!r} is not one of {', '.join(FAULTS)}")
    if (f.at_s is None) == (f.at_phase is None):
        raise c.fail(w, "needs exactly one of at_s (seconds into the workload) or at_phase")
    if f.at_s is not None and f.at_s < 0:
        raise c.fail(f"{w}.at_s", "must be >= 0")
    if f.at_phase is not None and f.at_phase not in phases:
        raise c.fail(f"{w}.at_phase", f"no phase {f.at_phase} in this scenario")
    _positive(c, f"{w}.deadline_s", f.deadline_s)
    if f.kind in ("kill", "restart", "late_join", "leave"):
        if f.node is None:
            raise c.fail(w, f"a {f.kind} fault needs node = \"...\"")
        if f.node not in nodes:
            raise c.fail(f"{w}.node", f"unknown node {f.node!r}")
    if f.kind == "partition":
        if len(f.groups) < 2:
            raise c.fail(f"{w}.groups", "a partition needs at least two groups of nodes")
        seen: set[str] = set()
        for g in f.groups:
            for n in g:
                if n not in nodes:
                    raise c.fail(f"{w}.groups", f"unknown node {n!r}")
                if n in seen:
                    raise c.fail(f"{w}.groups", f"node {n!r} is in two groups")
                seen.add(n)
    if f.kind == "slow_link":
        for end in (f.a, f.b):
            if end is None or end not in nodes:
                raise c.fail(w, f"a slow_link fault needs two known nodes a and b (got {f.a!r}, {f.b!r})")
        if f.latency_ms is None and f.bandwidth_mbps is None and f.loss is None:
            raise c.fail(w, "a slow_link fault needs latency_ms, bandwidth_mbps or loss")
        _link_values(c, w, f.latency_ms, f.bandwidth_mbps, f.loss)
    if f.kind == "late_join" and f.at_phase is not None:
        raise c.fail(w, "late_join in learning scenarios is expressed by a cohort's phase; use at_s")


def _check_workload(c: KeyReader, wl: WorkloadSpec, nodes: set[str]) -> None:
    if wl.kind != "gossip":
        raise c.fail("workload.kind", f"{wl.kind!r} is not a known workload (gossip)")
    _positive(c, "workload.entries", wl.entries)
    if not 1 <= wl.entry_bytes <= 512 << 10:
        raise c.fail("workload.entry_bytes", "must be in 1..524288")
    if wl.interval_s < 0:
        raise c.fail("workload.interval_s", "must be >= 0")
    _positive(c, "workload.deadline_s", wl.deadline_s)
    for p in wl.publishers or ():
        if p not in nodes:
            raise c.fail("workload.publishers", f"unknown node {p!r}")
    if wl.publishers is not None and not wl.publishers:
        raise c.fail("workload.publishers", "must name at least one node (or be left out for all)")


def _check_base(c, s: Scenario) -> None:
    """`scenario.base` and the `[msd]` campaign settings (the same checks `MSDConfig` makes)."""
    if s.base not in BASES:
        raise c.fail("scenario.base", f"{s.base!r} is not one of {', '.join(BASES)}")
    m = s.msd
    for k in ("steps", "batch_size", "teacher_views"):
        _positive(c, f"msd.{k}", getattr(m, k))
    if m.student_views < 0 or m.teacher_views + m.student_views < 2:
        raise c.fail("msd.student_views", "need at least two views in all (teacher_views + student_views)")
    if not 0 < m.student_keep <= m.teacher_keep <= 1:
        raise c.fail("msd.student_keep", f"need 0 < student_keep <= teacher_keep <= 1, got {m.student_keep}, "
                                         f"{m.teacher_keep}")
    if not m.lr > 0:
        raise c.fail("msd.lr", f"must be > 0, got {m.lr}")
    if m.finetune_lr is not None and not m.finetune_lr > 0:
        raise c.fail("msd.finetune_lr", f"must be > 0, got {m.finetune_lr}")
    if s.base == "public":
        _check_public(c, s)


def _check_public(c, s: Scenario) -> None:
    """`[public]` of base = "public": a pool spec disjoint from every node's data (a
    digits-jitter pool reserves `public=F` of the source digits; every digits-jitter data set
    of the scenario must leave out that very fraction), positive epochs and rates."""
    from atdnode.data import DataSpec
    from atdnode.errors import DataError

    p = s.public
    if not p.spec:
        raise c.fail("public.spec", "base = \"public\" needs the public pool's data spec")
    try:
        pool = DataSpec.parse(p.spec)
        specs = {d.name: DataSpec.parse(d.spec) for d in s.datasets}
    except DataError as exc:
        raise c.fail("public.spec", str(exc)) from None
    for k in ("epochs", "finetune_epochs"):
        if getattr(p, k) is not None:
            _positive(c, f"public.{k}", getattr(p, k))
    for k in ("lr", "finetune_lr"):
        if getattr(p, k) is not None and not getattr(p, k) > 0:
            raise c.fail(f"public.{k}", f"must be > 0, got {getattr(p, k)}")
    for d in s.datasets:
        if d.spec == p.spec:
            raise c.fail("public.spec", f"is data set {d.name!r}'s own spec: the pool must be disjoint from the nodes' data")
    if pool.source != "digits-jitter":
        return
    if pool.public is None or pool.part != "public":
        raise c.fail("public.spec", f"{p.spec}: a digits-jitter pool needs public=F&part=public")
    for name, ds in specs.items():
        if ds.source == "digits-jitter" and (ds.public != pool.public or ds.part != "private"):
            raise c.fail("public.spec", f"data set {name!r} ({s.dataset(name).spec}) overlaps the public pool: "
                                        f"give it public={pool.public:g} (the pool's digits left out)")
