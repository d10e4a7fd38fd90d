"""`atd split compare`: FESTA and p-FESTA against their baselines on one multi-task setting,
accuracy and measured bytes per method in one report, the cost formulas beside the bytes,
and which of the papers' orderings hold here.

Setting (defaults: a chest X-ray-like shape): two tasks on sklearn digits at 28 px, a 2-class
"pneumonia"-like task (label <= 2, minority ~30 %) and the 10 digits, ``clients_per_task``
clients per task holding disjoint images, one held-out test set; the small ViT of
`SplitSettings` (patch 4, width 32, depth 2); ``rounds`` x ``steps_per_round`` batches
of ``batch_size`` per client, tails / heads / FL models averaged every
``unifying_rounds``. Every method sees the same data partition and seeds:

=========================  ====================================================================
festa, pfesta              both tasks share one body (multi-task), `run_festa_inprocess` /
                           `run_pfesta_inprocess`; FESTA's clients use ``festa_head``
                           (default "conv": a small CNN head, the FESTA paper's §4 setting;
                           "vit": a trainable patch embedder, p-FESTA's architecture)
festa_single, pfesta_single  one server per task (single-task)
pfesta_learnable_head      p-FESTA ablation: trainable head (`protocols.pfesta`)
pfesta_no_pos_embed        p-FESTA ablation: no position table
central                    per task: pooled data, one model, as many batches as the task's
                           clients took together
fl                         per task: FedAvg of the whole ViT (`atd rounds`' rule)
sl                         per task: sequential split learning
=========================  ====================================================================

Bytes are per client (mean over clients), wire bytes of the method's training messages
(evaluation traffic excluded), next to the method's own formula and all of the paper's
(T_FL, T_SL, T_FESTA, T_pFESTA, T_MSD, T_FL-SSL) for the same symbols. Accuracy is the task metric on
the test set, mean over the task's clients, then mean / std / min / max over ``seeds``
(training is single-threaded and deterministic per seed; the spread is over seeds).
The report as text and as a PNG: `compare_view`.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from protocols import festa, pfesta
from protocols.comm_cost import VARIANT_FORMULAS, CostParams, InProcessChannel, formulas, msd_vs_fl_ssl, tensor_bytes
from protocols.festa import SplitRunResult
from protocols.split_baselines import (CENTRAL_KINDS, FL_KINDS, SL_KINDS, ClientData, run_central, run_fl,
                                       run_sl)
from atdnode.learning import ModelConfig
from atdnode.split.compare_view import METHODS
from protocols.split_parts import TaskSpec, build_plain_embedder, digits_images, split_config

FORMULA_TEXT = {"T_FL": "2R/n (Ph+Pb+Pt)", "T_SL": "2BR(F+G)", "T_FESTA": "2BR(F+G) + 2R/n (Ph+Pt)",
                "T_pFESTA": "DF + BR(F+G) + 2R Pt/n", "T_MSD": "DF + Pb (MSD Eq. 9)",
                "T_FL_SSL": "4R/n (Ph+Pb+Pt) (MSD Eq. 8: teacher + student, up and down)",
                "T_pFESTA_learnable_head": "2BR(F+G) + 2R Pt/n (this implementation's ablation)"}
# which formula each method's measured bytes are checked against (None: no formula of the papers)
OWN_FORMULA = {"festa": "T_FESTA", "festa_single": "T_FESTA", "pfesta": "T_pFESTA", "pfesta_single": "T_pFESTA",
               "pfesta_no_pos_embed": "T_pFESTA", "pfesta_learnable_head": "T_pFESTA_learnable_head",
               "fl": "T_FL", "sl": "T_SL", "central": None}
APPROX = 0.03  # "about equal": within 3 accuracy points


@dataclass(frozen=True)
class CompareSetting:
    """One multi-task split-learning setting; see the module doc."""

    img_size: int = 28
    patch_size: int = 4
    embed_dim: int = 32
    depth: int = 2
    num_heads: int = 2
    clients_per_task: int = 2
    samples_per_client: int = 350
    test_samples: int = 397
    rounds: int = 6
    steps_per_round: int = 20
    unifying_rounds: int = 2
    batch_size: int = 16
    lr: float = 3e-3
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    methods: tuple[str, ...] = METHODS
    festa_head: str = "conv"  # FESTA's client head (protocols.festa.HEADS): the paper's CNN head, small

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
        need = 2 * self.clients_per_task * self.samples_per_client + self.test_samples
        if need > 1797:
            raise ValueError(f"the setting needs {need} digits images, sklearn has 1797")
        if min(self.clients_per_task, self.samples_per_client, self.test_samples, self.rounds,
               self.steps_per_round, self.unifying_rounds, self.batch_size, len(self.seeds)) < 1:
            raise ValueError("every count of the setting must be >= 1 (and at least one seed)")
        if self.festa_head not in festa.HEADS:
            raise ValueError(f"festa_head {self.festa_head!r}: choose from {', '.join(festa.HEADS)}")
        if self.rounds % self.unifying_rounds:
            raise ValueError("rounds must be a multiple of unifying_rounds (FL averages every n rounds)")

    def cfg(self) -> ModelConfig:
        return split_config(img_size=self.img_size, patch_size=self.patch_size, in_chans=1,
                              embed_dim=self.embed_dim, depth=self.depth, num_heads=self.num_heads)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seeds": list(self.seeds), "methods": list(self.methods)}


TASKS = (TaskSpec("pneumonia", "classification", 2), TaskSpec("digit", "classification", 10))


@dataclass
class Partition:
    """Clients per task (disjoint images) and the shared test images with each task's labels."""

    clients: dict[str, list[ClientData]] = field(default_factory=dict)
    test: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _labels(task: TaskSpec, y: torch.Tensor) -> torch.Tensor:
    return (y <= 2).long() if task.name == "pneumonia" else y


def partition(s: CompareSetting) -> Partition:
    """Digits shuffled with a fixed seed; task k's clients take consecutive disjoint slices."""
    x, y = digits_images(s.img_size)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    out, lo = Partition(), 0
    for task in TASKS:
        out.clients[task.name] = []
        for i in range(s.clients_per_task):
            hi = lo + s.samples_per_client
            out.clients[task.name].append(ClientData(f"{task.name}-{i}", x[lo:hi], _labels(task, y[lo:hi])))
            lo = hi
    tx, ty = x[len(x) - s.test_samples:], y[len(y) - s.test_samples:]
    out.test = {t.name: (tx, _labels(t, ty)) for t in TASKS}
    return out


def _client_seed(seed: int, i: int) -> int:
    return 1000 * seed + 10 * i


def _festa(s: CompareSetting, part: Partition, tasks: Sequence[TaskSpec], seed: int) -> SplitRunResult:
    cfg = s.cfg()
    srv = festa.FestaServer(cfg, list(tasks), lr=s.lr, seed=1000 * seed + 7, head=s.festa_head)
    data = [c for t in tasks for c in part.clients[t.name]]
    spec = {t.name: t for t in tasks}
    cl = [festa.FestaClient(c.client_id, cfg, spec[c.client_id.rsplit("-", 1)[0]], c.images, c.targets,
                            batch_size=min(s.batch_size, c.images.shape[0]), lr=s.lr, seed=_client_seed(seed, i),
                            head=s.festa_head)
          for i, c in enumerate(data)]
    return festa.run_festa_inprocess(srv, cl, rounds=s.rounds, steps_per_round=s.steps_per_round,
                                     unifying_rounds=s.unifying_rounds, test_data=_test_of(part, cl))


def _pfesta(s: CompareSetting, part: Partition, tasks: Sequence[TaskSpec], seed: int, *, head: str = "fixed",
            pos_embed: bool = True) -> SplitRunResult:
    cfg = s.cfg()
    emb = build_plain_embedder(cfg, seed=1000 * seed + 5)  # in-process stand-in for the clients' secret
    srv = pfesta.PFestaServer(cfg, list(tasks), batch_size=s.batch_size, lr=s.lr, seed=1000 * seed + 7, head=head)
    data = [c for t in tasks for c in part.clients[t.name]]
    spec = {t.name: t for t in tasks}
    cl = [pfesta.PFestaClient(c.client_id, cfg, spec[c.client_id.rsplit("-", 1)[0]], c.images, c.targets, emb,
                              lr=s.lr, seed=_client_seed(seed, i), head=head, pos_embed=pos_embed)
          for i, c in enumerate(data)]
    return pfesta.run_pfesta_inprocess(srv, cl, rounds=s.rounds, steps_per_round=s.steps_per_round,
                                       unifying_rounds=s.unifying_rounds, test_data=_test_of(part, cl))


def _test_of(part: Partition, clients) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {c.client_id: part.test[c.task.name] for c in clients}


def _per_task(run: Callable[[TaskSpec], SplitRunResult]) -> SplitRunResult:
    """Run a single-task method once per task; one result over all clients."""
    out = SplitRunResult()
    for task in TASKS:
        res = run(task)
        out.counter.merge(res.counter)
        out.metrics.update(res.metrics)
        out.params.update(res.params)
        out.losses.update(res.losses)
        out.train_kinds = res.train_kinds
    return out


def run_method(name: str, s: CompareSetting, part: Partition, seed: int) -> SplitRunResult:
    """One method on the setting with one seed."""
    torch.set_num_threads(1)
    cfg = s.cfg()
    if name == "festa":
        return _festa(s, part, TASKS, seed)
    if name == "pfesta":
        return _pfesta(s, part, TASKS, seed)
    if name == "pfesta_learnable_head":
        return _pfesta(s, part, TASKS, seed, head="learnable")
    if name == "pfesta_no_pos_embed":
        return _pfesta(s, part, TASKS, seed, pos_embed=False)
    if name == "festa_single":
        return _per_task(lambda t: _festa(s, part, [t], seed))
    if name == "pfesta_single":
        return _per_task(lambda t: _pfesta(s, part, [t], seed))
    common = dict(lr=s.lr, seed=_client_seed(seed, 0), body_seed=1000 * seed + 7)
    if name == "central":
        return _per_task(lambda t: run_central(
            cfg, t, part.clients[t.name], steps=s.rounds * s.steps_per_round * s.clients_per_task,
            batch_size=s.batch_size, test=part.test[t.name], steps_per_round=s.steps_per_round, rounds=s.rounds,
            unifying_rounds=s.unifying_rounds, **common))
    if name == "fl":
        return _per_task(lambda t: run_fl(
            cfg, t, part.clients[t.name], rounds=s.rounds, steps_per_round=s.steps_per_round,
            unifying_rounds=s.unifying_rounds, batch_size=s.batch_size, test=part.test[t.name], **common))
    if name == "sl":
        def sl(t: TaskSpec) -> SplitRunResult:
            cl = [festa.FestaClient(c.client_id, cfg, t, c.images, c.targets, lr=s.lr, seed=_client_seed(seed, i),
                                    batch_size=min(s.batch_size, c.images.shape[0]))
                  for i, c in enumerate(part.clients[t.name])]
            return run_sl(cfg, t, cl, rounds=s.rounds, steps_per_round=s.steps_per_round, lr=s.lr,
                          seed=1000 * seed + 7, test=part.test[t.name], unifying_rounds=s.unifying_rounds)
        return _per_task(sl)
    raise ValueError(f"unknown method {name!r}")


def _own_formula(method: str, p: CostParams) -> float | None:
    key = OWN_FORMULA[method]
    if key is None:
        return None
    if key == "T_pFESTA_learnable_head":
        return VARIANT_FORMULAS["pfesta_learnable_head"](p)
    return _named_formulas(p)[key]


def _named_formulas(p: CostParams) -> dict[str, float]:
    f = formulas(p)
    return {"T_FL": f["fl"], "T_SL": f["sl"], "T_FESTA": f["festa"], "T_pFESTA": f["pfesta"], "T_MSD": f["msd"],
            "T_FL_SSL": f["fl_ssl"]}


def bytes_row(method: str, res: SplitRunResult) -> dict[str, Any]:
    """Per-client bytes of one run (mean over clients): measured training wire bytes, the
    method's own formula and its relative error, every paper formula, other traffic."""
    cl = sorted(res.params)
    train = [res.counter.total(c, kinds=res.train_kinds) for c in cl]
    allb = [res.counter.total(c) for c in cl]
    own = [_own_formula(method, res.params[c]) for c in cl]
    row: dict[str, Any] = {"measured": _mean(train), "formula_name": OWN_FORMULA[method],
                           "formula": None if own[0] is None else _mean(own),
                           "other_bytes": _mean([a - t for a, t in zip(allb, train)]),
                           "train_kinds": list(res.train_kinds), "params": asdict(res.params[cl[0]]),
                           "formulas": {k: _mean([_named_formulas(res.params[c])[k] for c in cl])
                                        for k in ("T_FL", "T_SL", "T_FESTA", "T_pFESTA", "T_MSD", "T_FL_SSL")}}
    if method == "sl":
        row["handoff"] = _mean([res.counter.total(c, kinds=["handoff"]) for c in cl])
    row["rel_error"] = None if row["formula"] is None else max(
        abs(t - o) / o for t, o in zip(train, own))  # the worst client
    return row


def _mean(v: Sequence[float]) -> float:
    return float(sum(v) / len(v))


def _spread(v: Sequence[float]) -> dict[str, Any]:
    return {"mean": _mean(v), "std": statistics.pstdev(v) if len(v) > 1 else 0.0, "min": min(v), "max": max(v),
            "runs": list(v)}


def summarise_run(name: str, s: CompareSetting, seed: int, with_bytes: bool) -> dict[str, Any]:
    """One (method, seed) run summarised (picklable, for worker processes)."""
    part = partition(s)
    t0 = time.perf_counter()
    res = run_method(name, s, part, seed)
    return {"seconds": time.perf_counter() - t0,
            "accuracy": {t.name: _mean([res.metrics[c.client_id]["accuracy"] for c in part.clients[t.name]])
                         for t in TASKS},
            "bytes": bytes_row(name, res) if with_bytes else None}


def run_compare(s: CompareSetting, progress: Callable[[str, int], None] | None = None, *,
                jobs: int = 1) -> dict[str, Any]:
    """Every method of ``s.methods`` for every seed (in ``jobs`` worker processes if > 1;
    each run is single-threaded, so the result does not depend on ``jobs``); the report."""
    todo = [(name, seed) for name in s.methods for seed in s.seeds]
    first = s.seeds[0]
    done: dict[tuple[str, int], dict[str, Any]] = {}
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
            futs = {ex.submit(summarise_run, n, s, sd, sd == first): (n, sd) for n, sd in todo}
            for f in as_completed(futs):
                done[futs[f]] = f.result()
                if progress is not None:
                    progress(*futs[f])
    else:
        for n, sd in todo:
            done[(n, sd)] = summarise_run(n, s, sd, sd == first)  # sizes do not depend on the seed
            if progress is not None:
                progress(n, sd)
    return assemble(s, done)


def assemble(s: CompareSetting, done: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """The report from per-(method, seed) summaries (:func:`summarise_run`), for every method and
    seed of ``s``."""
    part = partition(s)
    methods: dict[str, Any] = {}
    for name in s.methods:
        runs = [done[(name, sd)] for sd in s.seeds]
        methods[name] = {"accuracy": {t.name: _spread([r["accuracy"][t.name] for r in runs]) for t in TASKS},
                         "bytes_per_client": runs[0]["bytes"],
                         "seconds_per_run": _mean([r["seconds"] for r in runs]),
                         "multi_task": name in ("festa", "pfesta", "pfesta_learnable_head", "pfesta_no_pos_embed")}
    report = {"setting": s.to_dict(), "tasks": [t.to_dict() for t in TASKS],
              "majority": {t.name: _majority(part.test[t.name][1]) for t in TASKS},
              "formulas": FORMULA_TEXT, "approx_tolerance": APPROX, "methods": methods}
    report["references"] = references(s, part)
    report["orderings"] = orderings(report)
    return {**report, "msd_cost": msd_cost(s, part, methods.get("fl", {}).get("bytes_per_client"))}


def msd_cost(s: CompareSetting, part: Partition, fl_bytes: dict[str, Any] | None) -> dict[str, Any]:
    """MSD's one round (T_MSD, MSD Eq. 9) against federated self-supervised learning
    (T_FL-SSL, MSD Eq. 8) per client on this setting's clients, measured and by formula.

    Measured T_MSD: the wire bytes of `protocols.msd.run_msd_inprocess`'s messages (every
    client's permuted embeddings up, the distilled body down), run with one distillation step
    -- the bytes do not depend on the steps. Measured T_FL-SSL: twice the `fl` method's
    measured bytes (Eq. 8 moves a teacher and a student where FedAvg moves one model of the
    same size; the DINO projection head is left out of both), None when `fl` was not run.
    Formulas: T_MSD with MSD's D, F, Pb; T_FL-SSL at the `fl` run's R, n and model size."""
    from protocols.msd import MSDConfig, run_msd_inprocess
    from protocols.pfesta import permute_tokens, random_permutations

    cfg = s.cfg()
    emb = build_plain_embedder(cfg, seed=5)  # in-process stand-in for the clients' secret
    gen = torch.Generator().manual_seed(0)
    uploads = {}
    with torch.no_grad():
        for t in TASKS:
            for c in part.clients[t.name]:
                tokens = emb(c.images)  # (M, N, D)
                uploads[c.client_id] = permute_tokens(tokens, random_permutations(tokens.shape[0], tokens.shape[1], gen))
    res, ch = run_msd_inprocess(cfg, uploads, MSDConfig(steps=1, batch_size=16))
    cl = sorted(uploads)
    n_tok = next(iter(uploads.values())).shape[1]
    f = n_tok * cfg.embed_dim * 4
    msd_p = CostParams(D=round(_mean([uploads[c].shape[0] for c in cl])), B=0, R=1, n=1, F=f, G=f, Ph=0,
                       Pb=tensor_bytes(res.body_state), Pt=0)
    measured = _mean([ch.counter.total(c) for c in cl])
    if fl_bytes is None:
        return {"T_MSD": msd_p.D * msd_p.F + msd_p.Pb, "measured_T_MSD": measured, "T_FL_SSL": None,
                "ratio": None, "measured_T_FL_SSL": None, "measured_ratio": None, "params": asdict(msd_p)}
    out = msd_vs_fl_ssl(msd_p, CostParams(**fl_bytes["params"]), measured_msd=measured,
                        measured_fl_ssl=2 * fl_bytes["measured"])
    return {**out, "params": asdict(msd_p), "fl_params": fl_bytes["params"]}


def references(s: CompareSetting, part: Partition) -> dict[str, dict[str, float]]:
    """Per task, the VGS-ATD ensemble (`atdnode.aggregation.ensemble_refs`, small options) on the pooled
    clients' raw pixels and on an untrained extractor of the setting's ViT, scored on the
    test set: what the split methods' learned bodies must beat."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    from atdnode.data import LabeledImages
    from atdnode.aggregation import REFERENCES, fit_reference

    out: dict[str, dict[str, float]] = {k: {} for k in REFERENCES}
    for t in TASKS:
        names = [str(i) for i in range(t.num_outputs)]
        pooled = LabeledImages(images=torch.cat([c.images for c in part.clients[t.name]]),
                               labels=torch.cat([c.targets for c in part.clients[t.name]]).long(), classes=names)
        tx, ty = part.test[t.name]
        for kind in REFERENCES:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                ref = fit_reference(kind, [pooled], s.cfg(), pca_components=32, mlp_max_iter=200, seed=0,
                                    prior="none")
            pred = [int(ref.classes[i]) for i in ref.predict(tx)]
            out[kind][t.name] = round(float((torch.tensor(pred) == ty.long()).float().mean()), 6)
    return out


def _majority(y: torch.Tensor) -> float:
    return float(torch.bincount(y).max()) / len(y)


def orderings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The papers' claims, each evaluated on this report's numbers (means over seeds, every
    task must agree): ``holds`` (None where a method is missing) and the numbers behind it.
    ``robust``: the accuracy gap exceeds the sum of both methods' standard deviations."""
    m, tasks = report["methods"], [t["name"] for t in report["tasks"]]

    def acc(name: str, t: str) -> dict[str, float]:
        return m[name]["accuracy"][t]

    def cmp(claim: str, a: str, b: str, op: str) -> dict[str, Any]:
        if a not in m or b not in m:
            return {"claim": claim, "holds": None, "detail": "not run"}
        per = {}
        for t in tasks:
            x, y = acc(a, t), acc(b, t)
            d = x["mean"] - y["mean"]
            ok = abs(d) <= APPROX if op == "~" else (d > 0 if op == ">" else d >= -APPROX)
            per[t] = {a: x["mean"], b: y["mean"], "diff": d, "holds": ok, "robust": abs(d) > x["std"] + y["std"]}
        return {"claim": claim, "holds": all(v["holds"] for v in per.values()), "per_task": per}

    def gain(method: str, single: str) -> float | None:
        if method not in m or single not in m:
            return None
        return _mean([acc(method, t)["mean"] - acc(single, t)["mean"] for t in tasks])

    def comm(a: str, b: str) -> dict[str, Any]:
        claim = f"{a} communication < {b}"
        if a not in m or b not in m:
            return {"claim": claim, "holds": None, "detail": "not run"}
        x, y = m[a]["bytes_per_client"]["measured"], m[b]["bytes_per_client"]["measured"]
        p = m[a]["bytes_per_client"]["params"]
        # why, from the formulas: what each scheme moves per round, and p-FESTA's one-time upload
        per_round = {"pfesta": p["B"] * (p["F"] + p["G"]) + 2 * p["Pt"] / p["n"],
                     "fl": 2 * (p["Ph"] + p["Pb"] + p["Pt"]) / p["n"], "sl": 2 * p["B"] * (p["F"] + p["G"]),
                     "festa": 2 * p["B"] * (p["F"] + p["G"]) + 2 * (p["Ph"] + p["Pt"]) / p["n"]}
        return {"claim": claim, "holds": x < y, "bytes": {a: x, b: y}, "ratio": x / y,
                "per_round_formula": {k: per_round[k] for k in (a, b) if k in per_round},
                "once_formula": {"pfesta": p["D"] * p["F"]}}

    out = [cmp("FESTA ~ centralized (within approx_tolerance)", "festa", "central", "~"),
           cmp("centralized > FL", "central", "fl", ">"),
           cmp("FL > SL", "fl", "sl", ">"),
           cmp("FESTA > FL", "festa", "fl", ">"),
           cmp("FESTA multi-task >= single-task (within approx_tolerance)", "festa", "festa_single", ">="),
           cmp("p-FESTA multi-task >= single-task (within approx_tolerance)", "pfesta", "pfesta_single", ">="),
           comm("pfesta", "sl"), comm("pfesta", "fl"), comm("pfesta", "festa")]
    gp, gf = gain("pfesta", "pfesta_single"), gain("festa", "festa_single")
    out.append({"claim": "p-FESTA multi-task gain > FESTA's", "holds": None if None in (gp, gf) else gp > gf,
                "gain": {"pfesta": gp, "festa": gf}})
    out.append(cmp("fixed head no worse than learnable (within approx_tolerance)", "pfesta",
                   "pfesta_learnable_head", ">="))
    out.append(cmp("position embedding needed (with > without)", "pfesta", "pfesta_no_pos_embed", ">"))
    return out
