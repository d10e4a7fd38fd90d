"""Scenario files: one TOML format for both back-ends, validated up front with clear errors.

A scenario names the nodes and their data (cohorts of nodes that share one partition
scheme over one data set), the phases of the VGS-ATD protocol, the methods to compare,
the network conditions, the faults, and optionally a gossip workload:

    [scenario]   name, description, seed, backend ("memory" | "process"), methods, deadline_s,
                 step_deadline_s
    [model]      timm ViT overrides (atdnode.model.ModelConfig fields)
    [train]      epochs, batch_size, lr, weight_decay, freeze_blocks, augment
    [baselines]  rounds, local_epochs, fedprox_mu
    [ensemble]   pca_components, mlp_epochs (passed to the ensemble classifier)
    [network]    latency_ms, bandwidth_mbps, loss, jitter, namespaces ("off" | "auto");
                 [[network.links]] a, b, latency_ms, bandwidth_mbps, loss
    [[datasets]] name, spec (an atdnode.data spec: "digits", "npz:PATH", "folder:PATH")
    [[cohorts]]  name, phase, group, role, dataset, classes, partition, alpha, fractions,
                 class_sets, train_samples, test_samples, nodes
    [[phases]]   phase, mode ("horizontal" | "vertical" | "hierarchical"), weighting
    [[faults]]   kind, at_s | at_phase, node, nodes, groups, a, b, latency_ms, ...
    [workload]   kind = "gossip", entries, entry_bytes, publishers, interval_s, deadline_s
    [topology]   nodes (count, for network-only scenarios), degree, max_peers, peers
                 ("daemon" | "lite"), sync_interval_s, poll_interval_s

Every problem raises `ScenarioError` naming the file and the key path, e.g.
`three_phase.toml: cohorts[1].partition: 'dirichlet' is not one of iid, label_skew, ...`.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from atdnode.errors import AtdError

BACKENDS = ("memory", "process")
METHODS = ("vgs-atd", "centralized", "fedavg", "swarm", "local")
PARTITIONS = ("iid", "label_skew", "quantity_skew", "disjoint")
MODES = ("horizontal", "vertical", "hierarchical")
FAULTS = ("kill", "restart", "partition", "heal", "slow_link", "late_join", "leave")
WEIGHTINGS = ("uniform", "samples", "sqrt-classes", "model-count")


class ScenarioError(AtdError):
    """A scenario file is missing, not TOML, or has a bad value (the message names the key)."""


# ------------------------------------------------------------------ sections

@dataclass(frozen=True)
class ModelSpec:
    name: str = "vit_tiny_patch16_224"
    img_size: int = 16
    patch_size: int = 4
    embed_dim: int = 32
    depth: int = 2
    num_heads: int = 2
    in_chans: int = 1


@dataclass(frozen=True)
class TrainSpec:
    epochs: int = 3
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.05
    freeze_blocks: int = 1
    augment: bool = False


@dataclass(frozen=True)
class BaselineSpec:
    rounds: int = 3
    local_epochs: int = 1
    fedprox_mu: float = 0.0


@dataclass(frozen=True)
class EnsembleSpec:
    pca_components: int = 32
    mlp_epochs: int = 200


@dataclass(frozen=True)
class LinkSpec:
    a: str
    b: str
    latency_ms: float | None = None
    bandwidth_mbps: float | None = None
    loss: float | None = None


@dataclass(frozen=True)
class NetworkSpec:
    latency_ms: float = 5.0
    bandwidth_mbps: float | None = 100.0  # megabits per second; None = unlimited
    loss: float = 0.0  # gossip loss probability
    jitter: float = 0.1  # per-link seeded latency spread (fraction), avoids exact ties
    namespaces: str = "off"  # process back-end: "auto" = netns + tc netem where the machine allows it
    links: tuple[LinkSpec, ...] = ()


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    spec: str


@dataclass(frozen=True)
class CohortSpec:
    name: str
    nodes: tuple[str, ...]
    dataset: str
    phase: int = 1
    group: str = "A"
    classes: tuple[str, ...] | None = None
    partition: str = "iid"
    alpha: float = 0.5
    fractions: tuple[float, ...] | None = None
    class_sets: tuple[tuple[str, ...], ...] | None = None
    train_samples: int | None = None  # cap on the cohort's training samples (seeded subset)
    test_samples: int | None = None  # cap on each node's test samples
    role: str = "hospital"  # announced in the nodes' signed hello entries


@dataclass(frozen=True)
class PhaseSpec:
    phase: int
    mode: str
    weighting: str = "samples"


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    at_s: float | None = None  # seconds after the workload starts (network scenarios)
    at_phase: int | None = None  # before this phase's protocol step (learning scenarios)
    node: str | None = None
    groups: tuple[tuple[str, ...], ...] = ()
    a: str | None = None
    b: str | None = None
    latency_ms: float | None = None
    bandwidth_mbps: float | None = None
    loss: float | None = None
    deadline_s: float = 60.0


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "gossip"
    entries: int = 100
    entry_bytes: int = 256
    publishers: tuple[str, ...] | None = None  # None = every node
    interval_s: float = 0.01  # between two publications of one publisher
    deadline_s: float = 120.0


@dataclass(frozen=True)
class TopologySpec:
    nodes: int = 0  # extra data-less nodes n0..n{k-1} (network-only scenarios)
    degree: int = 3  # bootstrap peers each node dials (seeded choice among earlier nodes)
    max_peers: int = 8  # a node stops dialing out beyond this many connections
    peers: str = "daemon"  # in-memory node kind: "daemon" (NodeDaemon) | "lite" (gossip-only, 1000+ nodes)
    sync_interval_s: float = 5.0  # daemons' periodic ledger sync
    poll_interval_s: float = 0.1  # daemons' ledger poll (own entries to announce)


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int = 0
    backend: str = "memory"
    description: str = ""
    methods: tuple[str, ...] = METHODS
    deadline_s: float = 1800.0
    step_deadline_s: float = 300.0
    model: ModelSpec = ModelSpec()
    train: TrainSpec = TrainSpec()
    baselines: BaselineSpec = BaselineSpec()
    ensemble: EnsembleSpec = EnsembleSpec()
    network: NetworkSpec = NetworkSpec()
    datasets: tuple[DatasetSpec, ...] = ()
    cohorts: tuple[CohortSpec, ...] = ()
    phases: tuple[PhaseSpec, ...] = ()
    faults: tuple[FaultSpec, ...] = ()
    workload: WorkloadSpec | None = None
    topology: TopologySpec = TopologySpec()
    source: str = "<dict>"

    # -- derived views ------------------------------------------------------------------

    @property
    def learning(self) -> bool:
        """True when the scenario trains models (it has cohorts)."""
        return bool(self.cohorts)

    def node_names(self) -> list[str]:
        """Every node, data nodes first (cohort order), then topology nodes n0, n1, ..."""
        out = [n for c in self.cohorts for n in c.nodes]
        out += [f"n{i}" for i in range(self.topology.nodes)]
        return out

    def node_phase(self) -> dict[str, int]:
        ph = {n: c.phase for c in self.cohorts for n in c.nodes}
        ph.update({f"n{i}": 1 for i in range(self.topology.nodes)})
        return ph

    def node_group(self) -> dict[str, str]:
        return {n: c.group for c in self.cohorts for n in c.nodes}

    def node_roles(self) -> dict[str, str]:
        return {n: c.role for c in self.cohorts for n in c.nodes}

    def phase_numbers(self) -> list[int]:
        return sorted({c.phase for c in self.cohorts})

    def phase(self, p: int) -> PhaseSpec:
        for s in self.phases:
            if s.phase == p:
                return s
        return PhaseSpec(phase=p, mode=default_mode(p))

    def dataset(self, name: str) -> DatasetSpec:
        for d in self.datasets:
            if d.name == name:
                return d
        raise ScenarioError(f"{self.source}: no dataset named {name!r}")

    def replace(self, **changes: Any) -> "Scenario":
        from dataclasses import replace

        return replace(self, **changes)


def default_mode(phase: int) -> str:
    return MODES[min(phase, 3) - 1]


# ------------------------------------------------------------------ parsing

def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario TOML file."""
    p = Path(path)
    if not p.is_file():
        raise ScenarioError(f"{p}: no such scenario file")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{p.name}: not valid TOML ({exc})") from None
    return scenario_from_dict(raw, source=p.name, base_dir=p.parent)


def shipped_scenario(name: str) -> Path:
    """Path of a scenario shipped with the package (e.g. "three_phase", "demo")."""
    p = Path(__file__).parent / "scenarios" / f"{name.removesuffix('.toml')}.toml"
    if not p.is_file():
        have = sorted(x.stem for x in p.parent.glob("*.toml"))
        raise ScenarioError(f"no shipped scenario {name!r} (have {', '.join(have)})")
    return p


class _Ctx:
    """Typed getters that name the file and key path in every error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, msg: str) -> ScenarioError:
        return ScenarioError(f"{self.source}: {where}: {msg}")

    def table(self, raw: dict, key: str, where: str) -> dict:
        v = raw.get(key, {})
        if not isinstance(v, dict):
            raise self.fail(where, f"must be a table, got {type(v).__name__}")
        return v

    def tables(self, raw: dict, key: str) -> list[dict]:
        v = raw.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
            raise self.fail(key, "must be an array of tables ([[%s]])" % key)
        return v

    def build(self, cls, raw: dict, where: str, convert: dict | None = None):
        """Instantiate dataclass `cls` from `raw`, type-checking each field."""
        convert = convert or {}
        names = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(names))
        if unknown:
            raise self.fail(where, f"unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(names))})")
        kwargs = {}
        for k, v in raw.items():
            kw = f"{where}.{k}"
            kwargs[k] = convert[k](v, kw) if k in convert else self.scalar(v, names[k].type, kw)
        try:
            return cls(**kwargs)
        except TypeError as exc:  # a required key is missing
            missing = [f.name for f in fields(cls) if f.name not in raw and f.default is f.default_factory]
            raise self.fail(where, f"missing required key(s) {', '.join(missing) or exc}") from None

    def scalar(self, v: Any, typ: Any, where: str) -> Any:
        t = str(typ)
        if t.startswith("int"):
            if isinstance(v, bool) or not isinstance(v, int):
                raise self.fail(where, f"must be an integer, got {v!r}")
            return v
        if t.startswith("float"):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise self.fail(where, f"must be a number, got {v!r}")
            return float(v)
        if t.startswith("bool"):
            if not isinstance(v, bool):
                raise self.fail(where, f"must be true or false, got {v!r}")
            return v
        if t.startswith("str"):
            if not isinstance(v, str) or not v:
                raise self.fail(where, f"must be a non-empty string, got {v!r}")
            return v
        raise self.fail(where, f"unsupported value {v!r}")

    def strs(self, v: Any, where: str) -> tuple[str, ...]:
        if not isinstance(v, list) or not all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v):
            raise self.fail(where, f"must be a list of names, got {v!r}")
        return tuple(str(x) for x in v)

    def floats(self, v: Any, where: str) -> tuple[float, ...]:
        if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            raise self.fail(where, f"must be a list of numbers, got {v!r}")
        return tuple(float(x) for x in v)

    def str_lists(self, v: Any, where: str) -> tuple[tuple[str, ...], ...]:
        if not isinstance(v, list) or not v:
            raise self.fail(where, f"must be a non-empty list of lists, got {v!r}")
        return tuple(self.strs(x, f"{where}[{i}]") for i, x in enumerate(v))


def scenario_from_dict(raw: dict, *, source: str = "<dict>", base_dir: Path | None = None) -> Scenario:
    """Validate a parsed scenario (the TOML's dict form); see the module doc for the keys."""
    c = _Ctx(source)
    top = {"scenario", "model", "train", "baselines", "ensemble", "network", "datasets", "cohorts", "phases",
           "faults", "workload", "topology"}
    unknown = sorted(set(raw) - top)
    if unknown:
        raise c.fail("top level", f"unknown section(s) {', '.join(unknown)} (allowed: {', '.join(sorted(top))})")
    head = c.table(raw, "scenario", "scenario")
    if "name" not in head:
        raise c.fail("scenario", "missing required key name")
    head_conv = {"methods": lambda v, w: c.strs(v, w)}
    hdr = c.build(_Header, head, "scenario", head_conv)

    model = c.build(ModelSpec, c.table(raw, "model", "model"), "model")
    train = c.build(TrainSpec, c.table(raw, "train", "train"), "train")
    base = c.build(BaselineSpec, c.table(raw, "baselines", "baselines"), "baselines")
    ens = c.build(EnsembleSpec, c.table(raw, "ensemble", "ensemble"), "ensemble")
    net_raw = dict(c.table(raw, "network", "network"))
    links_raw = net_raw.pop("links", [])
    if not isinstance(links_raw, list):
        raise c.fail("network.links", "must be an array of tables")
    links = tuple(c.build(LinkSpec, l, f"network.links[{i}]") for i, l in enumerate(links_raw))
    net = c.build(NetworkSpec, net_raw, "network", {"bandwidth_mbps": _opt_float(c)})
    net = NetworkSpec(**{**{f.name: getattr(net, f.name) for f in fields(net)}, "links": links})
    datasets = tuple(c.build(DatasetSpec, d, f"datasets[{i}]") for i, d in enumerate(c.tables(raw, "datasets")))
    datasets = tuple(_resolve_dataset(d, base_dir) for d in datasets)
    conv = {"nodes": c.strs, "classes": c.strs, "fractions": c.floats, "class_sets": c.str_lists}
    cohorts = tuple(c.build(CohortSpec, x, f"cohorts[{i}]", conv) for i, x in enumerate(c.tables(raw, "cohorts")))
    phases = tuple(c.build(PhaseSpec, x, f"phases[{i}]") for i, x in enumerate(c.tables(raw, "phases")))
    fconv = {"groups": c.str_lists, "bandwidth_mbps": _opt_float(c)}
    faults = tuple(c.build(FaultSpec, x, f"faults[{i}]", fconv) for i, x in enumerate(c.tables(raw, "faults")))
    workload = None
    if "workload" in raw:
        workload = c.build(WorkloadSpec, c.table(raw, "workload", "workload"), "workload", {"publishers": c.strs})
    topo = c.build(TopologySpec, c.table(raw, "topology", "topology"), "topology")
    scn = Scenario(name=hdr.name, seed=hdr.seed, backend=hdr.backend, description=hdr.description,
                   methods=hdr.methods, deadline_s=hdr.deadline_s, step_deadline_s=hdr.step_deadline_s, model=model, train=train, baselines=base,
                   ensemble=ens, network=net, datasets=datasets, cohorts=cohorts, phases=phases, faults=faults,
                   workload=workload, topology=topo, source=source)
    validate(scn)
    return scn


@dataclass(frozen=True)
class _Header:
    name: str
    seed: int = 0
    backend: str = "memory"
    description: str = ""
    methods: tuple[str, ...] = METHODS
    deadline_s: float = 1800.0
    step_deadline_s: float = 300.0


def _opt_float(c: _Ctx):
    def conv(v: Any, where: str) -> float | None:
        if isinstance(v, str) and v.lower() in ("none", "unlimited"):
            return None
        return c.scalar(v, "float", where)
    return conv


def _resolve_dataset(d: DatasetSpec, base_dir: Path | None) -> DatasetSpec:
    """Relative npz:/folder: paths are relative to the scenario file."""
    kind, sep, rest = d.spec.partition(":")
    if sep and kind in ("npz", "folder") and base_dir is not None:
        path, q, query = rest.partition("?")
        p = Path(path).expanduser()
        if not p.is_absolute():
            p = (base_dir / p).resolve()
        return DatasetSpec(name=d.name, spec=f"{kind}:{p}{q}{query}")
    return d


# ------------------------------------------------------------------ cross-checks

def validate(s: Scenario) -> None:
    """Cross-field checks; raises ScenarioError naming the offending key."""
    c = _Ctx(s.source)
    if s.backend not in BACKENDS:
        raise c.fail("scenario.backend", f"{s.backend!r} is not one of {', '.join(BACKENDS)}")
    for m in s.methods:
        if m not in METHODS:
            raise c.fail("scenario.methods", f"{m!r} is not one of {', '.join(METHODS)}")
    if not s.methods:
        raise c.fail("scenario.methods", "must name at least one method")
    _positive(c, "scenario.deadline_s", s.deadline_s)
    for k in ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "in_chans"):
        _positive(c, f"model.{k}", getattr(s.model, k))
    if s.model.img_size % s.model.patch_size:
        raise c.fail("model.patch_size", f"{s.model.patch_size} does not divide img_size {s.model.img_size}")
    if s.model.embed_dim % s.model.num_heads:
        raise c.fail("model.num_heads", f"{s.model.num_heads} does not divide embed_dim {s.model.embed_dim}")
    for k in ("epochs", "batch_size"):
        _positive(c, f"train.{k}", getattr(s.train, k))
    _positive(c, "train.lr", s.train.lr)
    if not 0 <= s.train.freeze_blocks <= s.model.depth:
        raise c.fail("train.freeze_blocks", f"{s.train.freeze_blocks} out of range 0..{s.model.depth}")
    _positive(c, "baselines.rounds", s.baselines.rounds)
    _positive(c, "baselines.local_epochs", s.baselines.local_epochs)
    if s.baselines.fedprox_mu < 0:
        raise c.fail("baselines.fedprox_mu", "must be >= 0")
    _positive(c, "ensemble.pca_components", s.ensemble.pca_components)
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
    if "vgs-atd" not in s.methods and not s.learning and s.workload is None:
        raise c.fail("scenario", "nothing to run: no cohorts and no workload")


def _positive(c: _Ctx, where: str, v: float) -> None:
    if not v > 0:
        raise c.fail(where, f"must be > 0, got {v!r}")


def _check_network(c: _Ctx, s: Scenario) -> None:
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


def _link_values(c: _Ctx, where: str, latency: float | None, bw: float | None, loss: float | None) -> None:
    if latency is not None and latency < 0:
        raise c.fail(f"{where}.latency_ms", "must be >= 0")
    if bw is not None and not bw > 0:
        raise c.fail(f"{where}.bandwidth_mbps", "must be > 0")
    if loss is not None and not 0 <= loss < 1:
        raise c.fail(f"{where}.loss", "must be in [0, 1)")


def _check_cohort(c: _Ctx, w: str, co: CohortSpec, datasets: list[str]) -> None:
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


def _check_fault(c: _Ctx, w: str, f: FaultSpec, nodes: set[str], phases: set[int]) -> None:
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


def _check_workload(c: _Ctx, wl: WorkloadSpec, nodes: set[str]) -> None:
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
