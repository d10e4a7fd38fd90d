"""Scenario files: one TOML format for both back-ends, validated up front with clear errors.

A scenario names the nodes and their data (cohorts of nodes that share one partition
scheme over one data set), the phases of the VGS-ATD protocol, the methods to compare,
the network conditions, the faults, and optionally a gossip workload:

    [scenario]   name, description, seed, backend ("memory" | "process"), methods, deadline_s,
                 step_deadline_s, base ("scratch" | "msd": VGS-ATD starts from a base the nodes
                 build first by masked sampling distillation, `netsim.msdbase`)
    [msd]        the MSD campaign of base = "msd": steps, batch_size, lr, teacher_keep,
                 student_keep, teacher_views, student_views (`protocols.msd.MSDConfig`);
                 finetune_lr: VGS-ATD's learning rate when its models descend from the base
    [model]      timm ViT overrides (atdnode.model.ModelConfig fields)
    [train]      epochs, batch_size, lr, weight_decay, warmup_epochs, freeze_blocks, augment
                 (atdnode.training.TrainOptions fields)
    [baselines]  rounds, local_epochs, fedprox_mu, q (FedWAvg), pgd_eps, pgd_steps, adv_ratio (fat-*)
    [ensemble]   pca_components, mlp_max_iter (older name: mlp_epochs), rf_trees, prior
                 (atdnode.node_ensemble.EnsembleOptions fields)
    [network]    latency_ms, bandwidth_mbps, loss, jitter, namespaces ("off" | "auto");
                 [[network.links]] a, b, latency_ms, bandwidth_mbps, loss
    [[datasets]] name, spec (an atdnode.data spec: "digits", "npz:PATH", "folder:PATH"),
                 namespace (bool, default false: classes are matched by name across data sets)
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
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from atdnode.errors import AtdError
from atdnode.model import ModelConfig
from atdnode.node_ensemble import EnsembleOptions
from atdnode.training import TrainOptions

BACKENDS = ("memory", "process")
DEFAULT_METHODS = ("vgs-atd", "centralized", "fedavg", "swarm", "local")
METHODS = DEFAULT_METHODS + ("fat-fedavg", "fat-fedwavg")  # fat-*: adversarial `atd rounds` (netsim.fat), opt-in
BASES = ("scratch", "msd")
PARTITIONS = ("iid", "label_skew", "quantity_skew", "disjoint", "non_iid2", "non_iid4")  # non_iid*: FedWAvg paper
MODES = ("horizontal", "vertical", "hierarchical")
FAULTS = ("kill", "restart", "partition", "heal", "slow_link", "late_join", "leave")
WEIGHTINGS = ("uniform", "samples", "sqrt-classes", "model-count")


class ScenarioError(AtdError):
    """A scenario file is missing, not TOML, or has a bad value (the message names the key)."""


# ------------------------------------------------------------------ sections

# [model] is an `atdnode.model.ModelConfig` (the one ViT configuration class); netsim's
# defaults are laptop-sized, and num_classes is set per node from its label space.
NETSIM_MODEL = ModelConfig(name="vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=2,
                           num_heads=2, in_chans=1, num_classes=2)

# [train] is an `atdnode.training.TrainOptions` and [ensemble] an `atdnode.node_ensemble.EnsembleOptions`
# (the node's own option types, which `atd train` / `atd aggregate` fill from their flags); a
# scenario sets the keys below over netsim's laptop-sized defaults. [train] freeze_blocks are
# the blocks frozen when a model starts from published weights (VGS-ATD phases 2 and 3).
TRAIN_KEYS = ("epochs", "batch_size", "lr", "weight_decay", "warmup_epochs", "freeze_blocks", "augment")
NETSIM_TRAIN = TrainOptions(epochs=3, batch_size=32, lr=1e-3, weight_decay=0.05, warmup_epochs=0.5, freeze_blocks=1,
                            augment=False)
ENSEMBLE_KEYS = ("pca_components", "mlp_max_iter", "rf_trees", "prior")
ENSEMBLE_RENAMED = {"mlp_epochs": "mlp_max_iter"}  # an older scenario key, still read, -> the option's name
NETSIM_ENSEMBLE = EnsembleOptions(pca_components=32, mlp_max_iter=200)


@dataclass(frozen=True)
class MSDSpec:
    """The MSD campaign that builds the base (`base = "msd"`). The view settings the paper
    leaves blank were measured (`bench/msd_base_bench.py --choose`, `netsim.msdbase`):
    teacher views keep 3 of the scenarios' 4 patches (0.75), student views 2 (0.5), two of
    each. batch_size and lr are `protocols.msd.MSDConfig`'s; steps 1000, measured
    (`bench/msd_base_bench.py --probe`, `netsim.msdbase`): at 300 the base's features were
    hardly better than a random body's for the last phase's ensemble."""

    steps: int = 1000
    batch_size: int = 128
    lr: float = 3e-3
    teacher_keep: float = 0.75
    student_keep: float = 0.5
    teacher_views: int = 2
    student_views: int = 2
    # VGS-ATD's training from the base (`base = "msd"`): every model then descends from the
    # pretrained base, and this learning rate replaces [train] lr (None: [train] lr)
    finetune_lr: float | None = None


@dataclass(frozen=True)
class BaselineSpec:
    rounds: int = 3
    local_epochs: int = 1
    fedprox_mu: float = 0.0  # must stay 0: fedavg runs through `atd rounds`, which has no FedProx term
    q: float = 10.0  # fat-fedwavg: softmax scale of Eq. 3 (protocols.fedwavg.ROUNDS_Q, chosen by measurement)
    pgd_eps: float = 8 / 255  # fat-*: PGD radius in pixel units (step eps / 4)
    pgd_steps: int = 3
    adv_ratio: float = 0.5  # share of each training batch replaced by PGD examples
    optimizer: str = "adamw"  # rounds' local optimiser; "sgd": the FedWAvg paper's (momentum 0.9)
    lr_decay: float = 0.0  # sgd: rate x (1 - lr_decay) per local epoch (the paper: 0.05 in AT)


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
    namespace: bool = False  # true: prefix its class names ("<name>:<class>") so they never merge


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
    weighting: str = "uniform"  # the paper's: uniform (Eq. 2); hierarchical: sqrt-classes unless model-count


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
    methods: tuple[str, ...] = DEFAULT_METHODS
    deadline_s: float = 1800.0
    step_deadline_s: float = 300.0
    model: ModelConfig = NETSIM_MODEL
    train: TrainOptions = field(default_factory=lambda: replace(NETSIM_TRAIN))
    baselines: BaselineSpec = BaselineSpec()
    ensemble: EnsembleOptions = NETSIM_ENSEMBLE  # its seed is the scenario's (netsim.references.ensemble_options)
    network: NetworkSpec = NetworkSpec()
    datasets: tuple[DatasetSpec, ...] = ()
    cohorts: tuple[CohortSpec, ...] = ()
    phases: tuple[PhaseSpec, ...] = ()
    faults: tuple[FaultSpec, ...] = ()
    workload: WorkloadSpec | None = None
    topology: TopologySpec = TopologySpec()
    base: str = "scratch"
    msd: MSDSpec = MSDSpec()
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

    def options(self, default, raw: dict, where: str, keys: tuple[str, ...], renamed: dict[str, str] | None = None):
        """`default` (a node options dataclass) with the scenario's `keys` from `raw`, type-checked;
        an old key in `renamed` is read as its new name."""
        raw = dict(raw)
        for old, new in (renamed or {}).items():
            if old in raw:
                if new in raw:
                    raise self.fail(where, f"{old} and {new} name one setting: keep {new}")
                raw[new] = raw.pop(old)
        unknown = sorted(set(raw) - set(keys))
        if unknown:
            raise self.fail(where, f"unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(keys))})")
        types = {f.name: f.type for f in fields(default)}
        return replace(default, **{k: self.scalar(v, types[k], f"{where}.{k}") for k, v in raw.items()})

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
           "faults", "workload", "topology", "msd"}
    unknown = sorted(set(raw) - top)
    if unknown:
        raise c.fail("top level", f"unknown section(s) {', '.join(unknown)} (allowed: {', '.join(sorted(top))})")
    head = c.table(raw, "scenario", "scenario")
    if "name" not in head:
        raise c.fail("scenario", "missing required key name")
    head_conv = {"methods": lambda v, w: c.strs(v, w)}
    hdr = c.build(_Header, head, "scenario", head_conv)

    model = c.build(ModelConfig, {**asdict(NETSIM_MODEL), **c.table(raw, "model", "model")}, "model")
    train = c.options(NETSIM_TRAIN, c.table(raw, "train", "train"), "train", TRAIN_KEYS)
    base = c.build(BaselineSpec, c.table(raw, "baselines", "baselines"), "baselines")
    ens = c.options(NETSIM_ENSEMBLE, c.table(raw, "ensemble", "ensemble"), "ensemble", ENSEMBLE_KEYS, ENSEMBLE_RENAMED)
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
    msd = c.build(MSDSpec, c.table(raw, "msd", "msd"), "msd")
    scn = Scenario(name=hdr.name, seed=hdr.seed, backend=hdr.backend, description=hdr.description,
                   methods=hdr.methods, deadline_s=hdr.deadline_s, step_deadline_s=hdr.step_deadline_s, model=model, train=train, baselines=base,
                   ensemble=ens, network=net, datasets=datasets, cohorts=cohorts, phases=phases, faults=faults,
                   workload=workload, topology=topo, base=hdr.base, msd=msd, source=source)
    validate(scn)
    return scn


@dataclass(frozen=True)
class _Header:
    name: str
    seed: int = 0
    backend: str = "memory"
    description: str = ""
    methods: tuple[str, ...] = DEFAULT_METHODS
    deadline_s: float = 1800.0
    step_deadline_s: float = 300.0
    base: str = "scratch"


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
        return DatasetSpec(name=d.name, spec=f"{kind}:{p}{q}{query}", namespace=d.namespace)
    return d


# ------------------------------------------------------------------ cross-checks

def validate(s: Scenario) -> None:
    """Cross-field checks (see `netsim.scenario_check`); raises ScenarioError naming the key."""
    from netsim.scenario_check import check

    check(s)
