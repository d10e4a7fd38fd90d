"""The reference ensembles beside VGS-ATD in every netsim report.

Per phase, the VGS-ATD ensemble options of the scenario (`[ensemble]`) fitted through
`atdnode.aggregation.ensemble_refs.fit_reference` — the library function `atd aggregate`'s ensemble
uses — on the pooled training data of every node present in the phase (what a VGS-ATD
node's ensemble sees at most once every peer shared its features), on

    ensemble-raw        raw pixels;
    ensemble-untrained  the pre-logits features of an untrained extractor of the scenario's
                        model config;
    ensemble-raw-own    raw pixels of each node's own training data alone (what a hospital
                        gets with no learning and no consortium), fitted per node.

The members are fitted once per phase; each node then applies the scenario's class-prior
correction for its own class counts (`EnsembleClassifier.with_prior`, the same ratio a
node's own `prior="node"` fit gives). Nothing crosses a network: bytes are zero, and the
note says so. `verdicts` gives the report's one sentence per phase: did the learned
features beat the raw inputs and the untrained extractor?
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from atdnode.aggregation import REFERENCES, EnsembleOptions, fit_own_raw, fit_reference
from netsim.baselines import PhaseResult, data_phases, evaluate_phase
from netsim.learn import global_probs, model_config
from netsim.nodedata import ScenarioData
from netsim.scenario import Scenario


def ensemble_options(scn: Scenario) -> EnsembleOptions:
    """The scenario's ensemble options (VGS-ATD's and the references')."""
    return replace(scn.ensemble, seed=scn.seed)


def run_reference(kind: str, scn: Scenario, data: ScenarioData, log: Callable[[str], None] = print, *,
                  name: str | None = None, model: Callable | None = None) -> list[PhaseResult]:
    """One `PhaseResult` per phase for reference `kind` (one of `REFERENCES`). `model(cfg)`:
    the extractor of an extractor reference instead of the untrained one (`ensemble-public`:
    W_p, not fine-tuned, `netsim.publicbase`), reported as `name`."""
    opts = ensemble_options(scn)
    if kind == OWN_RAW:
        return _run_own_raw(scn, data, log)
    out = []
    for phase in data_phases(data):
        res = PhaseResult(name or kind, phase)
        names, classes = data.present(phase), data.classes_at(phase)
        what = "pixels" if kind == "ensemble-raw" else "untrained-extractor features" if model is None else "features"
        log(f"{name or kind} phase {phase}: the VGS-ATD ensemble on {len(names)} nodes' pooled {what}")
        t0 = time.perf_counter()
        pooled = data.pooled_train(names, classes)
        cfg = model_config(scn.model, len(classes))
        ref = fit_reference(kind, [pooled], cfg, model=None if model is None else model(cfg),
                            **{**opts.kwargs(), "prior": "none"})
        by_name = dict(zip(classes, np.bincount(pooled.labels.numpy(), minlength=len(classes)).tolist()))
        fitted = np.array([by_name[c] for c in ref.classes])
        index = {c: i for i, c in enumerate(ref.classes)}
        preds = {}
        for n in names:
            nd = data.nodes[n]
            own = np.bincount(nd.train.labels.numpy(), minlength=len(nd.classes))
            ens = ref.ensemble.with_prior(opts.prior, fitted,
                                          {index[c]: int(k) for c, k in zip(nd.classes, own) if k > 0})
            preds[n] = _predictor(ref, ens, data.label_space)
            res.outcomes[n] = f"{name or kind} (pooled data of {len(names)} nodes, prior {opts.prior})"
        res.compute_s = time.perf_counter() - t0
        res.ready_s = res.compute_s
        res.notes.append("reference: nothing sent (it shows what the ensemble gets without learned features)")
        evaluate_phase(res, data, phase, preds)
        out.append(res)
    return out


OWN_RAW = "ensemble-raw-own"


def _run_own_raw(scn: Scenario, data: ScenarioData, log: Callable[[str], None]) -> list[PhaseResult]:
    """ensemble-raw-own: per node, the ensemble on raw pixels of its own training data only,
    with the scenario's class-prior correction for its own class counts (as VGS-ATD's):
    `atdnode.aggregation.fit_own_raw`, the keep decision's raw-pixel candidate."""
    opts = ensemble_options(scn)
    out = []
    for phase in data_phases(data):
        res = PhaseResult(OWN_RAW, phase)
        names = data.present(phase)
        log(f"{OWN_RAW} phase {phase}: the VGS-ATD ensemble on each node's own pixels ({len(names)} nodes)")
        t0 = time.perf_counter()
        preds = {}
        for n in names:
            nd = data.nodes[n]
            ref = fit_own_raw(nd.train, model_config(scn.model, len(nd.classes)), **opts.kwargs())
            preds[n] = _predictor(ref, ref.ensemble, data.label_space)
            res.outcomes[n] = f"{OWN_RAW} (its own {len(nd.train)} images, prior {opts.prior})"
        res.compute_s = res.ready_s = time.perf_counter() - t0
        res.notes.append("reference: nothing sent (each hospital alone, no learning)")
        evaluate_phase(res, data, phase, preds)
        out.append(res)
    return out


def _predictor(ref, ens, space: list[str]):
    def pred(images: torch.Tensor) -> np.ndarray:
        from atdnode.aggregation import reference_features

        X = reference_features(ref.kind, images, model=ref.model)
        probs = np.zeros((len(X), len(ref.classes)))
        probs[:, ens.classes_.astype(np.int64)] = ens.predict_proba(X)  # the soft vote, prior-corrected
        return global_probs(probs, ref.classes, space)

    return pred


def verdicts(methods: dict[str, list[dict]]) -> list[str]:
    """One sentence per VGS-ATD phase: do the learned features beat raw inputs and the
    untrained extractor (overall accuracy, same run)?"""
    acc = {m: {ph["phase"]: ph.get("overall", {}).get("accuracy") for ph in v} for m, v in methods.items()}
    out = []
    for p, v in sorted(acc.get("vgs-atd", {}).items()):
        raw, unt = (acc.get(k, {}).get(p) for k in REFERENCES)
        if v is None or raw is None or unt is None:
            continue
        pub = acc.get("ensemble-public", {}).get(p)
        refs = [("raw inputs", raw), ("the untrained extractor", unt)] + ([("the public base W_p", pub)] if pub is not None else [])
        lost = [name for name, r in refs if v <= r]
        verdict = (f"beat {', '.join(n for n, _ in refs[:-1])} and {refs[-1][0]}" if not lost
                   else "do not beat " + " or ".join(lost))
        out.append(f"Phase {p}: the learned features {verdict} (VGS-ATD {v:.3f}, the same ensemble on raw "
                   f"inputs {raw:.3f}, on an untrained extractor {unt:.3f}"
                   + (f", on W_p's features {pub:.3f}" if pub is not None else "") + ")")
    return out


START_REFERENCES = {"ensemble-public": "the shared start W_p's features",
                    "ensemble-untrained": "the shared start's (an untrained extractor's) features"}


def headline(report: dict) -> str | None:
    """One line: do the consortium's learned features (VGS-ATD) beat the same ensemble on raw
    pixels and on the shared start's features alone (W_p under base = "public", the untrained
    extractor from scratch), by how many points per phase (overall accuracy, same run), with the
    last phase's numbers and centralized beside them. None without VGS-ATD or raw pixels; a
    start this run did not score (the MSD base) is said to be unmeasured, never claimed."""
    methods = report.get("methods", {})
    acc = {m: {ph["phase"]: ph.get("overall", {}).get("accuracy") for ph in v} for m, v in methods.items()}
    vgs = {p: a for p, a in acc.get("vgs-atd", {}).items() if a is not None}
    if not vgs or "ensemble-raw" not in acc:
        return None
    phases = sorted(vgs)
    start = None if "msd_base" in report else next((k for k in START_REFERENCES if k in acc), None)
    parts = [_versus("raw pixels", vgs, acc["ensemble-raw"], phases)]
    parts.append(_versus(START_REFERENCES[start], vgs, acc[start], phases) if start
                 else "the start's own features were not scored in this run (no claim about them)")
    last = phases[-1]
    nums = [f"VGS-ATD {vgs[last]:.3f}", f"raw pixels {acc['ensemble-raw'].get(last, float('nan')):.3f}"]
    if start:
        nums.append(f"start {acc[start].get(last, float('nan')):.3f}")
    if acc.get("centralized", {}).get(last) is not None:
        nums.append(f"centralized {acc['centralized'][last]:.3f}")
    return f"The consortium's learned features {' and '.join(parts)}; phase {last} (pooled test set): {', '.join(nums)}"


def _versus(name: str, vgs: dict[int, float], ref: dict[int, float | None], phases: list[int]) -> str:
    """"beat raw pixels in every phase (+18.2 / +12.0 points)", "beat ... in phase 3 only (...)",
    or "do NOT beat ... in any phase (...)": points = 100 x (VGS-ATD - reference)."""
    diff = {p: 100 * (vgs[p] - ref[p]) for p in phases if ref.get(p) is not None}
    pts = " / ".join(f"{d:+.1f}" for d in diff.values()) + " points"
    won = [p for p, d in diff.items() if d > 0]
    if not diff:
        return f"were not compared with {name} (not scored in this run)"
    if len(won) == len(phases):
        return f"beat {name} in every phase ({pts})"
    if not won:
        return f"do NOT beat {name} in any phase ({pts})"
    return f"beat {name} in phase{'s' * (len(won) > 1)} {', '.join(map(str, won))} only ({pts})"
