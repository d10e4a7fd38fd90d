"""Every scenario key, declared once: the section types, each key's type, default, range or
choices and help, and the reader that loads, checks and documents them from that declaration.

A key of a section netsim owns is a field of its dataclass declared with `key(...)`: the
field's annotation is its type, its default the default, and `key`'s arguments its help and
rule (the rule language of config.toml's settings, `atdnode.node.config_schema.Key`, checked by
the same `problem`). `[model]`, `[train]` and `[ensemble]` fill the node's own option types;
their keys are declared in `FOREIGN` (help and rule per field; the type is the field's, the
default netsim's). `SECTIONS` lists every section; from it `read_section` loads and checks a
table (one-line `ScenarioError` naming the file and the key), `keys_of` gives the `Key`s
`netsim.scenario_doc` writes into INTERFACES.md. What one key cannot say alone (a node a fault
names exists, fractions has one entry per node, ...) is `netsim.scenario_check`'s.

To add a scenario key: one field with `key(...)` here (or one `FOREIGN` entry), then regenerate
INTERFACES.md (`python -m netsim.scenario_doc INTERFACES.md`).
"""
from __future__ import annotations

import sys
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from atdnode.aggregation import EnsembleOptions
from atdnode.errors import AtdError
from atdnode.learning import OPTIMIZERS, TrainOptions
from atdnode.node import SettingKey, setting_problem
from protocols.vit_config import INT_FIELDS, STEMS, ModelConfig, ModelConfigError
from netsim.scenario_choices import Backend, Base, FaultKind, GroupStart, Method, Partition, Peers
from protocols.weightings import MODES as MODE_REGISTRY
from protocols.weightings import PRIORS, weightings


class ScenarioError(AtdError):
    """A scenario file is missing, not TOML, or has a bad value (the message names the key)."""


DEFAULT_METHODS = ("vgs-atd", "centralized", "fedavg", "swarm", "local")
# the registered VGS-ATD modes and the weightings a phase may name (fedwavg needs a round's
# reference layers, which a phase has not)
MODES = tuple(MODE_REGISTRY)
PHASE_WEIGHTINGS = tuple(n for n in dict.fromkeys(weightings("average") + weightings("group")) if n != "fedwavg")


def key(default: Any = MISSING, doc: str = "", **rule: Any) -> Any:
    """A dataclass field that is a scenario key: its default, help (`doc`) and rule (the
    `SettingKey` arguments low, high, above, below, choices, blank)."""
    return field(default=default, metadata={"doc": doc, **rule})


# ------------------------------------------------------------------ sections

# [model] is a `protocols.vit_config.ModelConfig` (the one ViT configuration class); netsim's
# defaults are laptop-sized, and num_classes is set per node from its label space.
NETSIM_MODEL = ModelConfig(name="vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=2,
                           num_heads=2, in_chans=1, num_classes=2)
# [train] is an `atdnode.learning.train_options.TrainOptions` and [ensemble] an
# `atdnode.aggregation.ensemble.EnsembleOptions` (the node's own option types, which `atd train` /
# `atd aggregate` fill from their flags); a scenario sets the keys of FOREIGN over these
# laptop-sized defaults.
NETSIM_TRAIN = TrainOptions(epochs=3, batch_size=32, lr=1e-3, weight_decay=0.05, warmup_epochs=0.5, freeze_blocks=1,
                            augment=False, plots=False)  # no confusion/curves PNGs per training run
NETSIM_ENSEMBLE = EnsembleOptions(pca_components=32, mlp_max_iter=200)
ENSEMBLE_RENAMED = {"mlp_epochs": "mlp_max_iter"}  # an older scenario key, still read, -> the option's name

# the keys of the sections whose types other packages own: field -> help and rule
FOREIGN: dict[str, dict[str, dict]] = {
    "model": {
        "name": {"doc": "timm ViT by name (its family; the sizes below override it)"},
        **{f: {"doc": d, "low": INT_FIELDS[f]} for f, d in (
            ("img_size", "input side in pixels (a multiple of patch_size)"), ("patch_size", "patch side in pixels"),
            ("embed_dim", "token width (a multiple of num_heads)"), ("depth", "transformer blocks"),
            ("num_heads", "attention heads"), ("in_chans", "image channels"),
            ("num_classes", "head width (set per node from its label space)"))},
        "mlp_ratio": {"doc": "MLP width / embed_dim", "above": 0},
        "stem": {"doc": "image to tokens: patch (timm's patch embedding) or conv (a conv stem, Xiao et al. 2021; "
                        "patch_size a power of two; not with base = \"msd\")", "choices": STEMS},
    },
    "train": {
        "epochs": {"doc": "training epochs of each model", "above": 0},
        "batch_size": {"doc": "training batch size", "above": 0},
        "lr": {"doc": "peak learning rate", "above": 0},
        "weight_decay": {"doc": "AdamW weight decay", "low": 0},
        "warmup_epochs": {"doc": "linear warm-up, then cosine decay", "low": 0},
        "freeze_blocks": {"doc": "blocks frozen when a model starts from published weights (VGS-ATD phases 2 and "
                                 "3; at most [model] depth)", "low": 0},
        "probe_epochs": {"doc": "LP-FT: epochs of the fresh head alone before fine-tuning", "low": 0},
        "probe_lr": {"doc": "LP-FT head rate (unset: a multiple of the fine-tuning rate)", "above": 0},
        "augment": {"doc": "augment small classes (VGS-ATD §4.2)"},
    },
    "ensemble": {
        "pca_components": {"doc": "PCA width before the ensemble's members", "above": 0},
        "mlp_max_iter": {"doc": "MLP iterations (older name: mlp_epochs)", "above": 0},
        "rf_trees": {"doc": "random-forest trees", "above": 0},
        "prior": {"doc": "class-prior correction (protocols.ensemble)", "choices": tuple(PRIORS)},
    },
}

TRAIN_KEYS = tuple(FOREIGN["train"])  # the [train] keys a report echoes (netsim.run)


@dataclass(frozen=True)
class MSDSpec:
    """The MSD campaign that builds the base (`base = "msd"`). The view settings the paper
    leaves blank were measured (`bench/msd_base_bench.py --choose`, `netsim.msdbase`); batch_size
    and lr are `protocols.msd.MSDConfig`'s; steps were measured (`bench/msd_base_bench.py
    --probe`). `teacher_views + student_views >= 2` and `student_keep <= teacher_keep`
    (`netsim.scenario_check`)."""

    steps: int = key(1000, "distillation steps", above=0)
    batch_size: int = key(128, "batch size", above=0)
    lr: float = key(3e-3, "learning rate", above=0)
    teacher_keep: float = key(0.75, "share of patches a teacher view keeps", above=0, high=1)
    student_keep: float = key(0.5, "share of patches a student view keeps", above=0, high=1)
    teacher_views: int = key(2, "teacher views per image", above=0)
    student_views: int = key(2, "student views per image", low=0)
    finetune_lr: float | None = key(None, "VGS-ATD's learning rate when its models descend from the base "
                                          "(unset: [train] lr)", above=0)


@dataclass(frozen=True)
class PublicSpec:
    """The public pool and the designated client's pretraining of `base = "public"` (W_p,
    VGS-ATD §3.2; `netsim.publicbase`). A digits-jitter pool (`part=public`) must reserve the
    same `public=` fraction the nodes' data sets leave out (`netsim.scenario_check`)."""

    spec: str = key("", "the pool's data spec (needed by base = \"public\")", blank=True)
    epochs: int = key(30, "W_p's training epochs (with the scenario's [train] recipe)", above=0)
    lr: float = key(2e-3, "W_p's learning rate", above=0)
    finetune_lr: float | None = key(None, "every method's rate when it starts from W_p (unset: [train] lr)",
                                    above=0)
    finetune_epochs: int | None = key(None, "every method's epochs from W_p (unset: [train] epochs)", above=0)
    file: str = key("", "W_p built once from this recipe and shipped: its extractor's safetensors file, relative "
                        "to the scenario file (`bench/public_base_build.py` rebuilds it); \"\": trained in the run",
                    blank=True)
    sha256: str = key("", "the file's SHA-256 (hex); a file that differs is refused", blank=True)


@dataclass(frozen=True)
class BaselineSpec:
    rounds: int = key(3, "FedAvg / swarm rounds", above=0)
    local_epochs: int = key(1, "local epochs per round", above=0)
    fedprox_mu: float = key(0.0, "must stay 0: fedavg runs through `atd rounds`, which has no FedProx term",
                            low=0)
    q: float = key(10.0, "fat-fedwavg: softmax scale of Eq. 3 (protocols.fedwavg.ROUNDS_Q)")
    pgd_eps: float = key(8 / 255, "fat-*: PGD radius in pixel units (step eps / 4)", low=0)
    pgd_steps: int = key(3, "fat-*: PGD steps", low=0)
    adv_ratio: float = key(0.5, "fat-*: share of each training batch replaced by PGD examples", low=0, high=1)
    optimizer: str = key("adamw", "rounds' local optimiser; sgd: the FedWAvg paper's (momentum 0.9)",
                         choices=OPTIMIZERS)
    lr_decay: float = key(0.0, "sgd: rate x (1 - lr_decay) per local epoch (the paper: 0.05 in AT)", low=0, below=1)


@dataclass(frozen=True)
class LinkSpec:
    a: str = key(doc="one end (a node name)")
    b: str = key(doc="the other end")
    latency_ms: float | None = key(None, "this link's latency (unset: [network]'s)", low=0)
    bandwidth_mbps: float | None = key(None, "this link's bandwidth (unset: [network]'s)", above=0)
    loss: float | None = key(None, "this link's gossip loss probability (unset: [network]'s)", low=0, below=1)


@dataclass(frozen=True)
class NetworkSpec:
    latency_ms: float = key(5.0, "one-way latency of every link", low=0)
    bandwidth_mbps: float | None = key(100.0, "megabits per second (\"none\": unlimited)", above=0)
    loss: float = key(0.0, "gossip loss probability", low=0, below=1)
    jitter: float = key(0.1, "per-link seeded latency spread (a fraction; avoids exact ties)", low=0, below=1)
    namespaces: str = key("off", "process back-end: auto = netns + tc netem where the machine allows it",
                          choices=("off", "auto"))
    links: tuple[LinkSpec, ...] = ()  # [[network.links]]


@dataclass(frozen=True)
class DatasetSpec:
    name: str = key(doc="the name cohorts give")
    spec: str = key(doc="an atdnode.data spec: digits, npz:PATH, folder:PATH (relative to the scenario file)")
    namespace: bool = key(False, "prefix its class names (<name>:<class>) so they never merge with another set's")


@dataclass(frozen=True)
class CohortSpec:
    name: str = key(doc="the cohort's name")
    nodes: tuple[str, ...] = key(doc="its nodes' names", low=1)
    dataset: str = key(doc="a [[datasets]] name")
    phase: int = key(1, "the VGS-ATD phase it joins in", low=1)
    group: str = key("A", "its hierarchical group")
    classes: tuple[str, ...] | None = key(None, "the classes it keeps (unset: all of the data set's)")
    partition: str = key("iid", "how its samples are split among its nodes", choices=tuple(Partition))
    alpha: float = key(0.5, "label_skew / quantity_skew: Dirichlet concentration", low=0)
    fractions: tuple[float, ...] | None = key(None, "quantity_skew: one positive share per node")
    class_sets: tuple[tuple[str, ...], ...] | None = key(None, "disjoint: one class list per node", low=1)
    class_shares: tuple[tuple[float, ...], ...] | None = key(None, "class_shares: per node, a share per class",
                                                               low=1)
    train_samples: int | None = key(None, "cap on the cohort's training samples (seeded subset)", low=1)
    test_samples: int | None = key(None, "cap on each node's test samples", low=1)
    role: str = key("hospital", "announced in the nodes' signed hello entries")


@dataclass(frozen=True)
class PhaseSpec:
    phase: int = key(doc="the phase (a cohort joins in it)", low=1)
    mode: str = key(doc="VGS-ATD mode", choices=MODES)
    weighting: str = key("uniform", "the paper's: uniform (Eq. 2); hierarchical: sqrt-classes unless model-count",
                         choices=PHASE_WEIGHTINGS)
    group_start: str = key("base", "hierarchical only: where a new group starts", choices=tuple(GroupStart))


@dataclass(frozen=True)
class FaultSpec:
    kind: str = key(doc="what happens", choices=tuple(FaultKind))
    at_s: float | None = key(None, "seconds after the workload starts (network scenarios)", low=0)
    at_phase: int | None = key(None, "before this phase's protocol step (learning scenarios)")
    node: str | None = key(None, "kill, restart, late_join, leave: the node")
    groups: tuple[tuple[str, ...], ...] = key((), "partition: two or more disjoint groups of nodes")
    a: str | None = key(None, "slow_link: one end")
    b: str | None = key(None, "slow_link: the other end")
    latency_ms: float | None = key(None, "slow_link: its latency", low=0)
    bandwidth_mbps: float | None = key(None, "slow_link: its bandwidth", above=0)
    loss: float | None = key(None, "slow_link: its loss probability", low=0, below=1)
    deadline_s: float = key(60.0, "how long the fault's effect is awaited", above=0)


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = key("gossip", "the workload", choices=("gossip",))
    entries: int = key(100, "entries published in all", above=0)
    entry_bytes: int = key(256, "bytes per entry", low=1, high=512 << 10)
    publishers: tuple[str, ...] | None = key(None, "the publishing nodes (unset: every node)", low=1)
    interval_s: float = key(0.01, "between two publications of one publisher", low=0)
    deadline_s: float = key(120.0, "every node has every entry by then", above=0)


@dataclass(frozen=True)
class TopologySpec:
    nodes: int = key(0, "extra data-less nodes n0..n{k-1} (network-only scenarios)", low=0)
    degree: int = key(3, "bootstrap peers each node dials (seeded choice among earlier nodes)", low=1)
    max_peers: int = key(8, "a node stops dialing out beyond this many connections", low=1)
    peers: str = key("daemon", "in-memory node kind: daemon (NodeDaemon), lite (gossip-only, 1000+ nodes)",
                     choices=tuple(Peers))
    sync_interval_s: float = key(5.0, "daemons' periodic ledger sync", above=0)
    poll_interval_s: float = key(0.1, "daemons' ledger poll (own entries to announce)", above=0)


@dataclass(frozen=True)
class Scenario:
    name: str = key(doc="the scenario's name")
    seed: int = key(0, "seeds every node's data split and training")
    backend: str = key("memory", "memory: in-process nodes; process: one `atd node start` per node",
                       choices=tuple(Backend))
    description: str = key("", "one line for reports", blank=True)
    methods: tuple[str, ...] = key(DEFAULT_METHODS, "methods compared (fat-*: adversarial `atd rounds`, opt-in)",
                                   choices=tuple(Method), low=1)
    deadline_s: float = key(1800.0, "the whole run's deadline", above=0)
    step_deadline_s: float = key(300.0, "one protocol step's deadline", above=0)
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
    base: str = key("scratch", "what every model starts from: scratch, msd (a base built by masked sampling "
                    "distillation, [msd]), public (W_p on a public pool, [public])", choices=tuple(Base))
    msd: MSDSpec = MSDSpec()
    public: PublicSpec = PublicSpec()
    val_fraction: float = key(0.0, "share of each node's training split held out as its val split (stratified, "
                              "seeded; never trained on), on which `atd aggregate` judges its keep choice; 0: none",
                              low=0, below=1)
    score_split: str = key("test", "the split every method is scored on: test (the report), or val (a recipe-selection "
                           "run: each data set's val split, carved from its training split where it has none, stands "
                           "in for its test split, which is never read)", choices=("test", "val"))
    plan: str = key("", "a plan file (`atd plan`'s TOML), relative to the scenario file, that method \"plan\" "
                    "carries out on the nodes with the functions `atd plan` calls (netsim.plan); \"\": none",
                    blank=True)
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



# ------------------------------------------------------------------ the declaration, read


@dataclass(frozen=True)
class Section:
    """One table of a scenario file: `name` ("network", "network.links", "cohorts"), the type it
    fills, and its keys: the fields of `cls` declared with `key`, or `FOREIGN[name]` over the
    defaults `base` for a type another package owns."""

    name: str
    cls: type
    doc: str
    many: bool = False  # [[name]]: an array of tables
    base: Any = None
    renamed: dict[str, str] = field(default_factory=dict)  # an older key, still read -> its name


SECTIONS: tuple[Section, ...] = (
    Section("scenario", Scenario, "the run"),
    Section("model", ModelConfig, "the timm ViT (protocols.vit_config.ModelConfig)", base=NETSIM_MODEL),
    Section("train", TrainOptions, "each model's training (atdnode TrainOptions)", base=NETSIM_TRAIN),
    Section("baselines", BaselineSpec, "the FedAvg / swarm / fat-* baselines"),
    Section("ensemble", EnsembleOptions, "the VGS-ATD ensemble (atdnode EnsembleOptions)", base=NETSIM_ENSEMBLE,
            renamed=ENSEMBLE_RENAMED),
    Section("network", NetworkSpec, "the links between nodes"),
    Section("network.links", LinkSpec, "one link's own conditions", many=True),
    Section("datasets", DatasetSpec, "the data sets cohorts draw from", many=True),
    Section("cohorts", CohortSpec, "nodes that share one partition of one data set", many=True),
    Section("phases", PhaseSpec, "each VGS-ATD phase's mode", many=True),
    Section("faults", FaultSpec, "injected faults", many=True),
    Section("workload", WorkloadSpec, "a gossip workload (network scenarios)"),
    Section("topology", TopologySpec, "who dials whom"),
    Section("msd", MSDSpec, "the MSD campaign of base = \"msd\""),
    Section("public", PublicSpec, "the pool and W_p of base = \"public\""),
)
UNSET = ("none", "unlimited")  # an optional key written as one of these is unset


@dataclass(frozen=True)
class Source:
    """The scenario file every message names."""

    name: str

    def fail(self, where: str, msg: str) -> ScenarioError:
        return ScenarioError(f"{self.name}: {where}: {msg}")

    def table(self, raw: dict, name: str) -> dict:
        v = raw.get(name, {})
        if not isinstance(v, dict):
            raise self.fail(name, f"must be a table, got {type(v).__name__}")
        return v

    def tables(self, raw: dict, name: str) -> list[dict]:
        v = raw.get(name, [])
        if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
            raise self.fail(name, f"must be an array of tables ([[{name}]])")
        return v


def _declared(sec: Section) -> list[tuple[SettingKey, bool]]:
    """(key, optional) for each key of `sec`, in field order."""
    rules = FOREIGN.get(sec.name)
    scope = vars(sys.modules[sec.cls.__module__])
    out = []
    for f in fields(sec.cls):
        rule = rules.get(f.name) if rules is not None else (f.metadata if "doc" in f.metadata else None)
        if rule is None:
            continue
        typ, item, nested, optional = _shape(eval(f.type, scope) if isinstance(f.type, str) else f.type)
        default = getattr(sec.base, f.name) if sec.base is not None else f.default
        default = ("(required)" if default is MISSING else "(unset)" if default is None
                   else list(map(list, default) if nested else default) if isinstance(default, tuple) else default)
        path = f"{sec.name}[].{f.name}" if sec.many else f"{sec.name}.{f.name}"
        out.append((SettingKey(path, typ, default, item=item, nested=nested, **rule), optional))
    return out


def _shape(hint: Any) -> tuple[type, type, bool, bool]:
    """(type, item, nested, optional) of a field's annotation: tuple[X, ...] is a list of X."""
    optional = isinstance(hint, types.UnionType) and type(None) in hint.__args__
    if optional:
        hint = next(a for a in hint.__args__ if a is not type(None))
    if typing.get_origin(hint) is not tuple:
        return hint, str, False, optional
    inner = typing.get_args(hint)[0]
    if typing.get_origin(inner) is tuple:
        return list, typing.get_args(inner)[0], True, optional
    return list, inner, False, optional


def keys_of(sec: Section) -> list[SettingKey]:
    """The declared keys of `sec` (what INTERFACES.md lists)."""
    return [k for k, _ in _declared(sec)]


def read_values(sec: Section, raw: dict, where: str, src: Source, *, skip: tuple[str, ...] = ()) -> dict:
    """The keys of `raw` (one table of section `sec`, at `where`), each checked against its
    declaration and typed (lists as tuples, numbers of a float key as floats); `skip`: keys of
    sub-tables the caller reads."""
    raw = {k: v for k, v in raw.items() if k not in skip}
    for old, new in sec.renamed.items():
        if old in raw:
            if new in raw:
                raise src.fail(where, f"{old} and {new} name one setting: keep {new}")
            raw[new] = raw.pop(old)
    declared = {k.path.rpartition(".")[2]: (k, opt) for k, opt in _declared(sec)}
    unknown = sorted(set(raw) - set(declared))
    if unknown:
        raise src.fail(where, f"unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(declared))})")
    missing = [n for n, (k, _) in declared.items() if k.default == "(required)" and n not in raw]
    if missing:
        raise src.fail(where, f"missing required key{'s' * (len(missing) > 1)} {', '.join(missing)}")
    values = {}
    for name, v in raw.items():
        k, optional = declared[name]
        if optional and isinstance(v, str) and v.lower() in UNSET:
            values[name] = None
            continue
        why = setting_problem(k, v)
        if why:
            raise src.fail(f"{where}.{name}", why)
        values[name] = _typed(k, v)
    return values


def _typed(k: SettingKey, v: Any) -> Any:
    if k.type is float:
        return float(v)
    if k.type is not list:
        return v
    one = (lambda x: float(x)) if k.item is float else (lambda x: x)
    return tuple(tuple(map(one, x)) for x in v) if k.nested else tuple(map(one, v))


def read_section(sec: Section, raw: dict, where: str, src: Source, *, skip: tuple[str, ...] = ()) -> Any:
    """One table of section `sec` as its type (`sec.base` with the table's keys, for a type
    another package owns); a value the type itself refuses ([model]'s invariants) names its key."""
    values = read_values(sec, raw, where, src, skip=skip)
    try:
        return replace(sec.base, **values) if sec.base is not None else sec.cls(**values)
    except ModelConfigError as exc:
        raise src.fail(f"{where}.{exc.field}" if exc.field else where, str(exc)) from None


def check_declared(s: Scenario) -> None:
    """Every declared key's value in a built scenario (also one changed after loading, by
    `Scenario.replace`: a CLI override) against its rule; ScenarioError naming the key."""
    src = Source(s.source)
    for sec in SECTIONS:
        owner = s.network if sec.name == "network.links" else s
        value = s if sec.name == "scenario" else getattr(owner, sec.name.rpartition(".")[2])
        objs = list(value) if sec.many else [] if value is None else [value]
        for i, obj in enumerate(objs):
            for k, optional in _declared(sec):
                name = k.path.rpartition(".")[2]
                v = getattr(obj, name)
                if v is None and optional:
                    continue
                v = [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
                why = setting_problem(k, v)
                if why:
                    raise src.fail(f"{sec.name}[{i}].{name}" if sec.many else k.path, why)
