"""Cross-field checks of a parsed scenario (`netsim.scenario.validate` calls `check`; the
types come from `netsim.scenario_spec`, which imports neither module).

Each failure is a `ScenarioError` naming the file and the key path, e.g.
`demo.toml: faults[2].node: unknown node 'h9'`.
"""
from __future__ import annotations

from netsim.scenario_spec import CohortSpec, FaultSpec, Scenario, Source


def check(s: Scenario) -> None:
    """What one key's declaration cannot say (each key's type, range and choices are checked
    from `netsim.scenario_spec`); raises ScenarioError naming the offending key."""
    c = Source(s.source)
    if s.base == "public":
        _check_public(c, s)
    if s.baselines.fedprox_mu != 0:
        raise c.fail("baselines.fedprox_mu", "FedProx is not offered: fedavg runs through `atd rounds` (set 0)")
    m = s.msd
    if m.teacher_views + m.student_views < 2:
        raise c.fail("msd.student_views", "need at least two views in all (teacher_views + student_views)")
    if m.student_keep > m.teacher_keep:
        raise c.fail("msd.student_keep", f"need student_keep <= teacher_keep, got {m.student_keep}, {m.teacher_keep}")
    if s.base == "msd" and s.model.stem != "patch":
        raise c.fail("model.stem", "the MSD base is split-learned with timm's patch embedding: "
                                   "use stem = \"patch\" with base = \"msd\"")
    if s.train.freeze_blocks > s.model.depth:
        raise c.fail("train.freeze_blocks", f"{s.train.freeze_blocks} out of range 0..{s.model.depth}")
    names = s.node_names()
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise c.fail("cohorts", f"node name(s) used twice: {', '.join(dup)}")
    for i, l in enumerate(s.network.links):
        for end in (l.a, l.b):
            if end not in names:
                raise c.fail(f"network.links[{i}]", f"unknown node {end!r}")
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
        if ph.group_start != "base" and ph.mode != "hierarchical":
            raise c.fail(f"{w}.group_start", "only a hierarchical phase has new groups to start")
        if ph.phase == 1 and ph.mode == "hierarchical":
            raise c.fail(f"{w}.mode", "phase 1 cannot be hierarchical (there is no earlier group)")
    for i, f in enumerate(s.faults):
        _check_fault(c, f"faults[{i}]", f, set(names), known)
    for p in (s.workload.publishers or ()) if s.workload is not None else ():
        if p not in names:
            raise c.fail("workload.publishers", f"unknown node {p!r}")
    if s.topology.peers == "lite" and s.learning:
        raise c.fail("topology.peers", "gossip-only \"lite\" peers cannot train; use \"daemon\" with cohorts")
    if not names:
        raise c.fail("cohorts", "the scenario has no nodes (add [[cohorts]] or [topology] nodes)")
    if s.plan or "plan" in s.methods:
        from netsim.plan_check import check_plan_scenario

        check_plan_scenario(c, s)
    if "vgs-atd" not in s.methods and not s.learning and s.workload is None:
        raise c.fail("scenario", "nothing to run: no cohorts and no workload")


def _check_cohort(c: Source, w: str, co: CohortSpec, datasets: list[str]) -> None:
    if co.dataset not in datasets:
        raise c.fail(f"{w}.dataset", f"{co.dataset!r} is not a [[datasets]] name (have {', '.join(datasets) or 'none'})")
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
        if len(set(flat)) != len(flat):
            raise c.fail(f"{w}.class_sets", "class lists must be disjoint")
        if co.classes is not None and not set(flat) <= set(co.classes):
            raise c.fail(f"{w}.class_sets", "names classes outside the cohort's classes")
    for k in ("train_samples", "test_samples"):
        v = getattr(co, k)
        if v is not None and v < len(co.nodes):
            raise c.fail(f"{w}.{k}", f"must be at least the node count ({len(co.nodes)})")


def _check_fault(c: Source, w: str, f: FaultSpec, nodes: set[str], phases: set[int]) -> None:
    if (f.at_s is None) == (f.at_phase is None):
        raise c.fail(w, "needs exactly one of at_s (seconds into the workload) or at_phase")
    if f.at_phase is not None and f.at_phase not in phases:
        raise c.fail(f"{w}.at_phase", f"no phase {f.at_phase} in this scenario")
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
    if f.kind == "late_join" and f.at_phase is not None:
        raise c.fail(w, "late_join in learning scenarios is expressed by a cohort's phase; use at_s")


def _check_public(c: Source, s: Scenario) -> None:
    """`[public]` of base = "public": a pool spec disjoint from every node's data (a
    digits-jitter pool reserves `public=F` of the source digits; every digits-jitter data set
    of the scenario must leave out that very fraction)."""
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
    if p.file and len(p.sha256) != 64 or any(ch not in "0123456789abcdef" for ch in p.sha256):
        raise c.fail("public.sha256", "a shipped W_p file needs its SHA-256 as 64 lower-case hex digits")
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
