"""The methods VGS-ATD is compared with, on exactly the scenario's partitions.

    centralized  every node uploads its training data raw; one model is trained on the pool
    fedavg       R rounds of `atd rounds --weighting fedavg` among real daemons on the
                 in-memory network (netsim.fat, the same code path as fat-fedavg / fat-fedwavg):
                 no server; every node trains `local_epochs` from the round's global model,
                 publishes, and every node computes the same uniform average
    fat-fedavg   the same with PGD adversarial training (Federated Adversarial Training with
    fat-fedwavg  Transformers); FedWAvg weights softmax(q cos) of the last layer vs the previous
                 global (Eq. 3); clean and robust (PGD) accuracy reported
    swarm        R rounds: the model travels node to node, each trains `local_epochs` on it;
                 the last node then sends the final model to every other node
    local        every node trains on its own data only; nothing is sent

A shared base (`base=`: extractor tensors; W_p of `scenario.base = "public"`,
`netsim.publicbase`; the MSD base of `base = "msd"`, `netsim.msdbase`, whose runs netsim
reports as `<method>-msd` next to the scratch ones): every baseline's first phase starts
from the base's extractor with a fresh seeded head (VGS-ATD §4.4: "the baselines start
from the same pretrained weights").
centralized, local and swarm's first training is `learn.train_model(init=base,
init_part="extractor")`, LP-FT's probe included when [train] probe_epochs is set
(`atdnode.learning.probe`). The `atd rounds` methods (fedavg, fat-*) start their first campaign from
one shared round-0 model, `extractor_start`: the base's extractor and the head a campaign of
that seed draws from scratch; every node trains its round-0 local epochs from it as from any
global model. Deviation: no probe in round 0 (`atd rounds` trains whole models; a probe
would need one node's data for the shared head, or per-node heads that the round-0 average
mixes), so with probe_epochs > 0 the rounds methods are the only ones without LP-FT.

Phases: a baseline keeps its state from one phase to the next (the model is warm-started,
its head widened for new classes — `learn.expand_head`) and trains with the data of every
node present in the phase. Byte accounting is analytic and stated per node (except for the
`atd rounds` methods, whose bytes are what the daemons' links carried): model
transfers count the raw tensor bytes of the full model (`learn.state_bytes`), raw data
uploads count uint8 pixels + int64 labels; the server is the pseudo-node `"server"`.
Times: compute is measured (wall clock); network time is estimated from the scenario's
default link (latency + bytes / bandwidth), with nodes working in parallel where the
method allows (FedAvg rounds, local training) and in sequence where it does not (swarm).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from atdnode.learning import ModelConfig, build_model, load_part
from netsim.learn import (
    METRICS,
    expand_head,
    full_state,
    model_config,
    global_probs,
    predict_proba,
    score_probs,
    state_bytes,
    to_global,
    train_model,
)
from netsim.nodedata import ScenarioData, concat
from netsim.scenario import NetworkSpec, Scenario

BASELINES = ("centralized", "fedavg", "swarm", "local", "fat-fedavg", "fat-fedwavg")
SERVER = "server"

Progress = Callable[[str], None]


@dataclass
class PhaseResult:
    """One method after one phase."""

    method: str
    phase: int
    per_node: dict[str, dict] = field(default_factory=dict)  # own test set
    overall: dict = field(default_factory=dict)  # mean over nodes, pooled test of the phase
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # this phase: sent / received
    ready_s: float = 0.0  # time until every present node can predict (this phase)
    compute_s: float = 0.0  # summed compute of every node (this phase)
    outcomes: dict[str, str] = field(default_factory=dict)  # node -> what it ended with
    notes: list[str] = field(default_factory=list)
    verified: dict[str, int] = field(default_factory=dict)  # VGS-ATD: {"aggregates": n, "verified": k}

    def add_bytes(self, node: str, sent: int = 0, received: int = 0) -> None:
        b = self.bytes.setdefault(node, {"sent": 0, "received": 0})
        b["sent"] += int(sent)
        b["received"] += int(received)

    def to_dict(self) -> dict:
        return {"method": self.method, "phase": self.phase, "per_node": self.per_node, "overall": self.overall,
                "bytes": self.bytes, "ready_s": round(self.ready_s, 3), "compute_s": round(self.compute_s, 3),
                "outcomes": self.outcomes, "notes": self.notes,
                **({"verified": self.verified} if self.verified else {})}


def transfer_s(net: NetworkSpec, nbytes: int) -> float:
    """Estimated seconds to move `nbytes` over one default link."""
    bw = net.bandwidth_mbps
    return net.latency_ms / 1000.0 + (nbytes * 8 / (bw * 1e6) if bw else 0.0)


Predictor = Callable[[torch.Tensor], np.ndarray]  # images -> (N, classes) probabilities over the global label space


def evaluate_phase(res: PhaseResult, data: ScenarioData, phase: int, predictors: dict[str, Predictor]) -> None:
    """Fill per-node metrics (own test set) and overall metrics (mean over nodes on the
    phase's pooled test set) from each node's predictor: accuracy and the rest of its arg-max,
    AUROC of its probabilities (`netsim.learn.score_probs`), each with its 95 % interval; the
    overall intervals are the nodes' intervals on the pooled test set, bound by bound averaged
    (every node is scored on the same images, so their errors are far from independent). Nodes
    whose probabilities on the pooled set are identical (one global model) are scored once."""
    pooled = data.pooled_test(phase)
    space = data.label_space
    pooled_true = to_global(pooled.labels.numpy(), pooled.classes, space)
    overall = []
    on_pooled: dict[bytes, dict] = {}  # nodes holding one model give identical probabilities: scored once
    for name in data.present(phase):
        nd = data.nodes[name]
        pred = predictors.get(name)
        if pred is None:
            res.per_node[name] = {"status": res.outcomes.get(name, "no model")}
            continue
        y_true = to_global(nd.test.labels.numpy(), nd.classes, space)
        res.per_node[name] = score_probs(y_true, pred(nd.test.images))
        probs = np.ascontiguousarray(pred(pooled.images), dtype=np.float64)
        key = hashlib.blake2b(probs.tobytes(), digest_size=32).digest() + repr(probs.shape).encode()
        if key not in on_pooled:
            on_pooled[key] = score_probs(pooled_true, probs)
        overall.append(on_pooled[key])
    if overall:
        keys = METRICS + (("auroc",) if all("auroc" in o for o in overall) else ())
        res.overall = {k: round(float(np.mean([o[k] for o in overall])), 6) for k in keys}
        for k in ("accuracy", "balanced_accuracy", "auroc"):  # the nodes' intervals on the same pooled set, averaged
            if all(f"{k}_ci95" in o for o in overall):
                res.overall[f"{k}_ci95"] = [round(float(np.mean([o[f"{k}_ci95"][i] for o in overall])), 6) for i in (0, 1)]
        res.overall["n"] = int(len(pooled))
        res.overall["nodes"] = len(overall)


def model_predictor(model: nn.Module, classes: list[str], space: list[str]) -> Predictor:
    return lambda images: global_probs(predict_proba(model, images), classes, space)


def extractor_start(cfg: ModelConfig, base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A full state of `cfg`: `base`'s extractor tensors and the head of a fresh model built
    after `torch.manual_seed(seed)` — the head `atd rounds` draws for a campaign of that seed
    (`atdnode.rounds.rules.init_blob`), so a campaign from a base differs from one from scratch
    in its extractor only."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    load_part(model, base, "extractor")
    return full_state(model)


class _Global:
    """A single model over a growing label space, shared by centralized / fedavg / swarm."""

    def __init__(self, scn: Scenario, data: ScenarioData) -> None:
        self.scn, self.data = scn, data
        self.state: dict[str, torch.Tensor] | None = None
        self.classes: list[str] = []

    def start_phase(self, phase: int) -> tuple[list[str], list[str]]:
        """Present nodes and the phase's label space; widens the carried model's head."""
        classes = self.data.classes_at(phase)
        if self.state is not None and classes != self.classes:
            self.state = expand_head(self.state, self.classes, classes, model_config(self.scn.model, len(classes)),
                                     seed=self.scn.seed + 1000 * phase)
        self.classes = classes
        return self.data.present(phase), classes

    def base_start(self, base: dict[str, torch.Tensor] | None, seed: int) -> None:
        """Before the first phase's training: the carried model becomes `base`'s extractor with
        a fresh head seeded by `seed` over the phase's label space (`extractor_start`).
        No-op without a base or once a model is carried."""
        if base is not None and self.state is None:
            self.state = extractor_start(self.cfg(), base, seed)

    def cfg(self):
        return model_config(self.scn.model, len(self.classes))

    def model(self) -> nn.Module:
        m = build_model(self.cfg())
        m.load_state_dict(self.state)
        m.eval()
        return m


def run_centralized(scn: Scenario, data: ScenarioData, log: Progress = print, *,
                    base: dict[str, torch.Tensor] | None = None, name: str = "centralized",
                    models: list[nn.Module] | None = None) -> list[PhaseResult]:
    """Pooled training, phase by phase (each phase continues the last one's model). `base`:
    extractor tensors the first phase starts from (an MSD base, `netsim.msdbase`, or W_p,
    `netsim.publicbase`); `models`, when given, receives each phase's trained model."""
    g = _Global(scn, data)
    out = []
    for phase in data_phases(data):
        res = PhaseResult(name, phase)
        names, classes = g.start_phase(phase)
        upload = 0.0
        for n in names:
            if data.nodes[n].phase == phase:  # earlier nodes' data is already at the server
                b = data.nodes[n].raw_bytes
                res.add_bytes(n, sent=b)
                res.add_bytes(SERVER, received=b)
                upload = max(upload, transfer_s(scn.network, b))
        log(f"centralized phase {phase}: training on {len(names)} nodes' pooled data")
        first = g.state is None and base is not None
        t = train_model(g.cfg(), data.pooled_train(names, classes), scn.train, seed=scn.seed + phase,
                        init=base if first else g.state, init_part="extractor" if first else "full")
        g.state = full_state(t.model)
        if models is not None:
            models.append(t.model)
        m = state_bytes(g.state)
        for n in names:
            res.add_bytes(n, received=m)
            res.add_bytes(SERVER, sent=m)
            res.outcomes[n] = "global model"
        res.compute_s = t.seconds
        res.ready_s = upload + t.seconds + transfer_s(scn.network, m)
        evaluate_phase(res, data, phase, {n: model_predictor(t.model, classes, data.label_space) for n in names})
        out.append(res)
    return out


def run_fedavg(scn: Scenario, data: ScenarioData, log: Progress = print, *,
               base: dict[str, torch.Tensor] | None = None) -> list[PhaseResult]:
    """FedAvg through `atd rounds` on the in-memory back-end (`run_rounds_method`)."""
    return run_rounds_method("fedavg", scn, data, log, base=base)


def run_fat(method: str):
    return lambda scn, data, log=print, *, base=None: run_rounds_method(method, scn, data, log, base=base)


ROUND_METHODS = {"fedavg": ("fedavg", False), "fat-fedavg": ("fedavg", True), "fat-fedwavg": ("fedwavg", True)}


def pgd_of(scn: Scenario):
    """The fat-* methods' PGD settings from the scenario's [baselines]."""
    from netsim.fat import pgd_config

    b = scn.baselines
    return pgd_config(eps=b.pgd_eps, steps=b.pgd_steps, ratio=b.adv_ratio, in_chans=scn.model.in_chans)


def run_rounds_method(method: str, scn: Scenario, data: ScenarioData, log: Progress = print, *,
                      base: dict[str, torch.Tensor] | None = None) -> list[PhaseResult]:
    """`fedavg`, `fat-fedavg` or `fat-fedwavg` over every phase of the scenario: per phase one
    `atd rounds` campaign among the present nodes' daemons (netsim.fat.run_rounds_memnet),
    started from the previous phase's global model with its head widened to the new label
    space; fat-* report clean and PGD accuracy on the phase's pooled test set. With `base`
    (extractor tensors), the first campaign's round-0 model is the base's extractor and the
    fresh head a campaign of this seed draws (`_Global.base_start`; no probe: module doc)."""
    from netsim.fat import run_rounds_memnet
    from protocols.adversarial import robust_accuracy

    weighting, adv = ROUND_METHODS[method]
    pgd = pgd_of(scn) if adv else None
    b = scn.baselines
    g = _Global(scn, data)
    out = []
    for phase in data_phases(data):
        res = PhaseResult(method, phase)
        names, classes = g.start_phase(phase)
        seed = scn.seed + 1000 * (phase - 1)
        g.base_start(base, seed)
        log(f"{method} phase {phase}: {b.rounds} rounds of atd rounds on {len(names)} daemons")
        rr = run_rounds_memnet({n: data.nodes[n].train for n in names}, classes=classes, model=scn.model,
                               rounds=b.rounds, weighting=weighting, q=b.q, adversarial=pgd,
                               local_epochs=b.local_epochs, batch_size=scn.train.batch_size, lr=scn.train.lr,
                               seed=seed, network=scn.network,
                               test={n: data.nodes[n].test for n in names}, init_state=g.state,
                               deadline=scn.step_deadline_s, optimizer=b.optimizer, lr_decay=b.lr_decay, log=log)
        g.state = rr.state
        for n in names:
            res.add_bytes(n, **rr.bytes[n])
            res.outcomes[n] = "global model"
        rounds = rr.per_round()
        res.compute_s = sum(r.train_s + r.aggregate_s for reps in rr.reports.values() for r in reps)
        res.ready_s = sum(r["max_train_s"] + r["max_exchange_s"] + r["max_aggregate_s"] for r in rounds)
        res.notes.append(f"atd rounds on in-memory daemons ({weighting}{', PGD ' + str(pgd.steps) + ' steps' if pgd else ''}): "
                         + "; ".join(f"round {r['round']} weights {[round(w, 3) for w in r['weights']]}"
                                     + (f" missing {len(r['missing'])}" if r["missing"] else "") for r in rounds))
        if not rr.identical:
            res.notes.append("nodes ended with different global models")
        model = g.model()
        evaluate_phase(res, data, phase, {n: model_predictor(model, classes, data.label_space) for n in names})
        if pgd is not None and res.overall:
            pooled = concat([data.pooled_test(phase)], classes)
            rep = robust_accuracy(model, (pooled.images, pooled.labels), generator=torch.Generator().manual_seed(scn.seed),
                                  **pgd.attack_kwargs())
            res.overall.update(clean_accuracy=round(rep.clean, 6), robust_accuracy=round(rep.robust, 6))
        out.append(res)
    return out


def run_swarm(scn: Scenario, data: ScenarioData, log: Progress = print, *,
              base: dict[str, torch.Tensor] | None = None) -> list[PhaseResult]:
    """The model travels node to node for `rounds` rounds per phase (module doc). With `base`
    (extractor tensors) the very first training is `train_model(init=base,
    init_part="extractor")`, as local's and centralized's; every later one continues the
    travelling model."""
    g = _Global(scn, data)
    b = scn.baselines
    out = []
    for phase in data_phases(data):
        res = PhaseResult("swarm", phase)
        names, classes = g.start_phase(phase)
        cfg = g.cfg()
        prev = None
        for r in range(b.rounds):
            log(f"swarm phase {phase}: round {r + 1}/{b.rounds}")
            for k, n in enumerate(names):
                if g.state is not None and prev != n:
                    m = state_bytes(g.state)
                    if prev is not None:
                        res.add_bytes(prev, sent=m)
                        res.add_bytes(n, received=m)
                        res.ready_s += transfer_s(scn.network, m)
                first = g.state is None and base is not None
                t = train_model(cfg, data.pooled_train([n], classes), scn.train,
                                seed=scn.seed + 7919 * r + k + 101 * phase, epochs=b.local_epochs,
                                init=base if first else g.state, init_part="extractor" if first else "full",
                                warmup_epochs=0.0)
                g.state = full_state(t.model)
                res.compute_s += t.seconds
                res.ready_s += t.seconds
                prev = n
        m = state_bytes(g.state)
        for n in names:  # the last holder hands the final model to everyone else
            if n != prev:
                res.add_bytes(prev, sent=m)
                res.add_bytes(n, received=m)
            res.outcomes[n] = "swarm model"
        res.ready_s += transfer_s(scn.network, m * max(0, len(names) - 1))
        model = g.model()
        evaluate_phase(res, data, phase, {n: model_predictor(model, classes, data.label_space) for n in names})
        out.append(res)
    return out


def run_local(scn: Scenario, data: ScenarioData, log: Progress = print, *,
              base: dict[str, torch.Tensor] | None = None) -> list[PhaseResult]:
    """Every node trains alone on its own data (from `base`'s extractor when given: W_p,
    `netsim.publicbase`), nothing is sent."""
    models: dict[str, nn.Module] = {}
    out = []
    for phase in data_phases(data):
        res = PhaseResult("local", phase)
        slowest = 0.0
        for n in data.present(phase):
            nd = data.nodes[n]
            if n not in models:
                log(f"local phase {phase}: {n} trains alone")
                t = train_model(model_config(scn.model, len(nd.classes)), nd.train, scn.train,
                                seed=scn.seed + sum(map(ord, n)), init=base)
                models[n] = t.model
                res.compute_s += t.seconds
                slowest = max(slowest, t.seconds)
            res.add_bytes(n)
            res.outcomes[n] = "own model only"
        res.ready_s = slowest
        evaluate_phase(res, data, phase, {n: model_predictor(models[n], data.nodes[n].classes, data.label_space)
                                          for n in data.present(phase)})
        out.append(res)
    return out


def data_phases(data: ScenarioData) -> list[int]:
    return sorted({d.phase for d in data.nodes.values()})


RUNNERS = {"centralized": run_centralized, "fedavg": run_fedavg, "swarm": run_swarm, "local": run_local,
           "fat-fedavg": run_fat("fat-fedavg"), "fat-fedwavg": run_fat("fat-fedwavg")}


def run_baseline(method: str, scn: Scenario, data: ScenarioData, log: Progress = print, *,
                 base: dict[str, torch.Tensor] | None = None) -> list[PhaseResult]:
    """Run one baseline over every phase of the scenario; one result per phase. `base`:
    extractor tensors every baseline starts from (W_p of base = "public", the MSD base; module doc)."""
    try:
        runner = RUNNERS[method]
    except KeyError:
        raise ValueError(f"unknown baseline {method!r} (one of {', '.join(BASELINES)})") from None
    return runner(scn, data, log, base=base)
