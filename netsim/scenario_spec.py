"""A parsed scenario: the section types, the names each key may take, and the reader that
names the file and key path in every error.

The file format is described in `netsim.scenario`, which parses a TOML file into these
types; `netsim.scenario_check` checks them across fields. Both import this module, and it
imports neither (no circle between parsing and checking).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from atdnode.errors import AtdError
from atdnode.aggregation import EnsembleOptions
from atdnode.learning import TrainOptions
from protocols.vit_config import ModelConfig, ModelConfigError

BACKENDS = ("memory", "process")
DEFAULT_METHODS = ("vgs-atd", "centralized", "fedavg", "swarm", "local")
METHODS = DEFAULT_METHODS + ("fat-fedavg", "fat-fedwavg", "plan")  # fat-*: adversarial `atd rounds` (netsim.fat), opt-in; plan: [scenario] plan (netsim.plan)
BASES = ("scratch", "msd", "public")
PARTITIONS = ("iid", "label_skew", "quantity_skew", "disjoint", "non_iid2", "non_iid4", "class_shares")  # non_iid*: FedWAvg paper
MODES = ("horizontal", "vertical", "hierarchical")
FAULTS = ("kill", "restart", "partition", "heal", "slow_link", "late_join", "leave")
WEIGHTINGS = ("uniform", "samples", "sqrt-classes", "model-count")
# where a new group of a hierarchical phase starts (netsim.vgs._hierarchical): "base", the
# consortium's shared base (the paper, §3.3); "consortium", the latest fused extractor of the
# consortium's existing group (a deviation)
GROUP_STARTS = ("base", "consortium")


class ScenarioError(AtdError):
    """A scenario file is missing, not TOML, or has a bad value (the message names the key)."""


# ------------------------------------------------------------------ sections

# [model] is a `protocols.vit_config.ModelConfig` (the one ViT configuration class); netsim's
# defaults are laptop-sized, and num_classes is set per node from its label space.
NETSIM_MODEL = ModelConfig(name="vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=2,
                           num_heads=2, in_chans=1, num_classes=2)


# [train] is an `atdnode.learning.train_options.TrainOptions` and [ensemble] an `atdnode.aggregation.ensemble.EnsembleOptions`
# (the node's own option types, which `atd train` / `atd aggregate` fill from their flags); a
# scenario sets the keys below over netsim's laptop-sized defaults. [train] freeze_blocks are
# the blocks frozen when a model starts from published weights (VGS-ATD phases 2 and 3).
TRAIN_KEYS = ("epochs", "batch_size", "lr", "weight_decay", "warmup_epochs", "freeze_blocks", "probe_epochs", "probe_lr",
              "augment")
NETSIM_TRAIN = TrainOptions(epochs=3, batch_size=32, lr=1e-3, weight_decay=0.05, warmup_epochs=0.5, freeze_blocks=1,
                            augment=False, plots=False)  # no confusion/curves PNGs per training run
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
class PublicSpec:
    """The public pool and the designated client's pretraining of `base = "public"` (W_p,
    VGS-ATD §3.2; `netsim.publicbase`). `spec` is the pool's data spec (a digits-jitter pool,
    `part=public`, must reserve the same `public=` fraction the nodes' data sets leave out:
    `netsim.scenario_check`); W_p trains `epochs` at `lr` with the scenario's [train] recipe;
    every method that trains a model then starts from W_p at `finetune_lr` for
    `finetune_epochs` (None: [train]'s)."""

    spec: str = ""
    epochs: int = 30
    lr: float = 2e-3
    finetune_lr: float | None = None
    finetune_epochs: int | None = None


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
    class_shares: tuple[tuple[float, ...], ...] | None = None  # partition = "class_shares": per node, per class
    train_samples: int | None = None  # cap on the cohort's training samples (seeded subset)
    test_samples: int | None = None  # cap on each node's test samples
    role: str = "hospital"  # announced in the nodes' signed hello entries


@dataclass(frozen=True)
class PhaseSpec:
    phase: int
    mode: str
    weighting: str = "uniform"  # the paper's: uniform (Eq. 2); hierarchical: sqrt-classes unless model-count
    group_start: str = "base"  # hierarchical only: one of GROUP_STARTS ("base": the paper's)


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
    public: PublicSpec = PublicSpec()
    # a share of each node's training split held out as its validation split (stratified,
    # seeded; `netsim.nodedata.split_val`): never trained on by any method; `atd aggregate`
    # judges its candidates on it (`atdnode.aggregation.keep`). 0: no val split (every node trains on all
    # of its share and makes no keep choice: `netsim.nodedata.node_spec`)
    val_fraction: float = 0.0
    # a plan file (`atd plan`'s TOML, README: Plans) that method "plan" carries out on the
    # scenario's nodes with the functions `atd plan` calls (`netsim.plan`); "": none
    plan: str = ""
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
        from dataclasses import replace

        return replace(self, **changes)


def default_mode(phase: int) -> str:
    return MODES[min(phase, 3) - 1]


# ------------------------------------------------------------------ reading

class KeyReader:
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
        except ModelConfigError as exc:  # a value `cls` itself refuses (the [model] invariants)
            raise self.fail(f"{where}.{exc.field}" if exc.field else where, str(exc)) from None

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

    def float_lists(self, v: Any, where: str) -> tuple[tuple[float, ...], ...]:
        if not isinstance(v, list) or not v:
            raise self.fail(where, f"must be a non-empty list of lists, got {v!r}")
        return tuple(self.floats(x, f"{where}[{i}]") for i, x in enumerate(v))

    def str_lists(self, v: Any, where: str) -> tuple[tuple[str, ...], ...]:
        if not isinstance(v, list) or not v:
            raise self.fail(where, f"must be a non-empty list of lists, got {v!r}")
        return tuple(self.strs(x, f"{where}[{i}]") for i, x in enumerate(v))
