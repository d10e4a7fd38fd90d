"""Scenario files: one TOML format for both back-ends, validated up front with clear errors.

A scenario names the nodes and their data (cohorts of nodes that share one partition
scheme over one data set), the phases of the VGS-ATD protocol, the methods to compare,
the network conditions, the faults, and optionally a gossip workload:

    [scenario]   name, description, seed, backend ("memory" | "process"), methods, deadline_s,
                 step_deadline_s, base ("scratch" | "msd": VGS-ATD starts from a base the nodes
                 build first by masked sampling distillation, `netsim.msdbase` | "public": every
                 method starts from W_p, a designated client's ViT on a public pool, `netsim.publicbase`),
                 val_fraction, plan (a plan file, relative to the scenario file, that method
                 "plan" carries out on the nodes: `netsim.plan`)
    [msd]        the MSD campaign of base = "msd": steps, batch_size, lr, teacher_keep,
                 student_keep, teacher_views, student_views (`protocols.msd.MSDConfig`);
                 finetune_lr: VGS-ATD's learning rate when its models descend from the base
    [public]     the pool of base = "public": spec, epochs, lr (W_p's training), finetune_lr,
                 finetune_epochs (every method's training from W_p)
    [model]      timm ViT overrides (protocols.vit_config.ModelConfig fields)
    [train]      epochs, batch_size, lr, weight_decay, warmup_epochs, freeze_blocks, augment
                 (atdnode.learning.train_options.TrainOptions fields)
    [baselines]  rounds, local_epochs, fedprox_mu, q (FedWAvg), pgd_eps, pgd_steps, adv_ratio (fat-*)
    [ensemble]   pca_components, mlp_max_iter (older name: mlp_epochs), rf_trees, prior
                 (atdnode.aggregation.ensemble.EnsembleOptions fields)
    [network]    latency_ms, bandwidth_mbps, loss, jitter, namespaces ("off" | "auto");
                 [[network.links]] a, b, latency_ms, bandwidth_mbps, loss
    [[datasets]] name, spec (an atdnode.data spec: "digits", "npz:PATH", "folder:PATH"),
                 namespace (bool, default false: classes are matched by name across data sets)
    [[cohorts]]  name, phase, group, role, dataset, classes, partition, alpha, fractions,
                 class_sets, class_shares, train_samples, test_samples, nodes
    [[phases]]   phase, mode ("horizontal" | "vertical" | "hierarchical"), weighting, group_start
                 (hierarchical: "base", the paper's, | "consortium", netsim.vgs._hierarchical)
    [[faults]]   kind, at_s | at_phase, node, nodes, groups, a, b, latency_ms, ...
    [workload]   kind = "gossip", entries, entry_bytes, publishers, interval_s, deadline_s
    [topology]   nodes (count, for network-only scenarios), degree, max_peers, peers
                 ("daemon" | "lite"), sync_interval_s, poll_interval_s

Every problem raises `ScenarioError` naming the file and the key path, e.g.
`three_phase.toml: cohorts[1].partition: 'dirichlet' is not one of iid, label_skew, ...`.
"""
from __future__ import annotations

import tomllib
from dataclasses import MISSING, asdict, fields, make_dataclass, replace
from pathlib import Path
from typing import Any

# the section types live in scenario_spec (also read by scenario_check); re-exported here,
# where every caller has always found them
from netsim.scenario_check import check
from netsim.scenario_spec import (  # noqa: F401
    BACKENDS,
    BASES,
    DEFAULT_METHODS,
    FAULTS,
    METHODS,
    MODES,
    NETSIM_MODEL,
    PARTITIONS,
    WEIGHTINGS,
    BaselineSpec,
    CohortSpec,
    DatasetSpec,
    ENSEMBLE_KEYS,
    ENSEMBLE_RENAMED,
    NETSIM_ENSEMBLE,
    NETSIM_TRAIN,
    TRAIN_KEYS,
    FaultSpec,
    KeyReader,
    LinkSpec,
    MSDSpec,
    NetworkSpec,
    PhaseSpec,
    PublicSpec,
    Scenario,
    ScenarioError,
    TopologySpec,
    WorkloadSpec,
    default_mode,
)
from protocols.vit_config import ModelConfig


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


def scenario_from_dict(raw: dict, *, source: str = "<dict>", base_dir: Path | None = None) -> Scenario:
    """Validate a parsed scenario (the TOML's dict form); see the module doc for the keys."""
    c = KeyReader(source)
    top = {"scenario", "model", "train", "baselines", "ensemble", "network", "datasets", "cohorts", "phases",
           "faults", "workload", "topology", "msd", "public"}
    unknown = sorted(set(raw) - top)
    if unknown:
        raise c.fail("top level", f"unknown section(s) {', '.join(unknown)} (allowed: {', '.join(sorted(top))})")
    head = c.table(raw, "scenario", "scenario")
    if "name" not in head:
        raise c.fail("scenario", "missing required key name")
    head_conv = {"methods": lambda v, w: c.strs(v, w)}
    hdr = c.build(_Header, head, "scenario", head_conv)
    if hdr.plan and base_dir is not None:  # a plan file is relative to the scenario file
        hdr = replace(hdr, plan=str((base_dir / Path(hdr.plan).expanduser()).resolve()))

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
    conv = {"nodes": c.strs, "classes": c.strs, "fractions": c.floats, "class_sets": c.str_lists,
            "class_shares": c.float_lists}
    cohorts = tuple(c.build(CohortSpec, x, f"cohorts[{i}]", conv) for i, x in enumerate(c.tables(raw, "cohorts")))
    phases = tuple(c.build(PhaseSpec, x, f"phases[{i}]") for i, x in enumerate(c.tables(raw, "phases")))
    fconv = {"groups": c.str_lists, "bandwidth_mbps": _opt_float(c)}
    faults = tuple(c.build(FaultSpec, x, f"faults[{i}]", fconv) for i, x in enumerate(c.tables(raw, "faults")))
    workload = None
    if "workload" in raw:
        workload = c.build(WorkloadSpec, c.table(raw, "workload", "workload"), "workload", {"publishers": c.strs})
    topo = c.build(TopologySpec, c.table(raw, "topology", "topology"), "topology")
    msd = c.build(MSDSpec, c.table(raw, "msd", "msd"), "msd")
    public = c.build(PublicSpec, c.table(raw, "public", "public"), "public")
    scn = Scenario(**{k: getattr(hdr, k) for k in HEADER_KEYS}, model=model, train=train, baselines=base,
                   ensemble=ens, network=net, datasets=datasets, cohorts=cohorts, phases=phases, faults=faults,
                   workload=workload, topology=topo, msd=msd, public=public, source=source)
    validate(scn)
    return scn


# The [scenario] table: these fields of `Scenario` (their types and defaults), read as one
# dataclass so `KeyReader.build` type-checks them and names unknown keys.
HEADER_KEYS = ("name", "seed", "backend", "description", "methods", "deadline_s", "step_deadline_s", "base",
               "val_fraction", "plan")
_Header = make_dataclass("_Header", [(f.name, f.type) if f.default is MISSING else (f.name, f.type, f.default)
                                     for f in fields(Scenario) if f.name in HEADER_KEYS], frozen=True)


def _opt_float(c: KeyReader):
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
    check(s)
