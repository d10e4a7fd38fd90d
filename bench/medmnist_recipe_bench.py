"""Benchmark: which start and recipe the real-image scenarios (netsim/scenarios/breastmnist.toml,
retinamnist.toml) ship, judged on the sites' val splits only.

A pooled, in-process replay of the scenarios' one vertical step (`netsim.vgs` `_vertical`,
VGS-ATD §3.2) with the library's trainer (`netsim.learn.train_model`) and ensemble
(`protocols.vgs.fit_vertical_ensemble`, the scenario's `[ensemble]`):

    the first site trains from the start S (the consortium init, or the sites' MSD base);
    the others fine-tune its extractor (a fresh head; LP-FT's probe first when probe > 0);
    the consortium's extractor is the uniform mean of the three (`weighting = "uniform"`);
    each site's consortium model is the ensemble on that extractor's features of every
    site's training data, with the site's own class-prior correction.

Beside it, per site, what the site has alone: its raw-pixel ensemble on its own images
(`ensemble-raw-own`) and its local model (trained on its own images from S, end to end); and
`blend`, the mean of the consortium model's and the raw-pixel ensemble's class probabilities
(a screen of a candidate the node does not build: it won nothing on the val splits, RESULTS.md).
Every number is scored on the site's val split (carved from its share by the scenario's
`val_fraction`, never trained on): balanced accuracy (what keep = best judges by) and AUROC
(`netsim.learn.score_probs`). No test image is read. A recipe's figure is the mean over
sites of its consortium model's val balanced accuracy; with `--seeds` several, the mean
over seeds. No daemons, no ledger, no encryption and no keep decision in these figures (each site's
consortium model is scored, not the model keep = best would pick; `--keep-rules` below judges that
decision): a cheap screen before the full `atd netsim run`
(`bench/medmnist_bench.py`) that the claims rest on. Prints one JSON object.

Recipes: `--recipe NAME:key=value,...` (keys: epochs, augment 0/1, embed_dim, depth, heads,
img (input side; 28-px images are resized, `atdnode.data`), patch, stem patch|conv (the ViT's
patch embedding or a conv stem, `protocols.vit_stem`), start scratch|msd|public (with pool=SPEC:
a W_p pretrained on another published data set, `public_start`; pool_epochs), lr, probe (LP-FT
probe epochs), probe_lr, msd_steps, tta 0/1 (the consortium's features averaged over each image
and its mirror image, for fitting and scoring: a screen of test-time augmentation, not built in
the library), pca (the ensemble's PCA width)); a key left out keeps the scenario's value.

Each recipe after the first is also compared with the first, seed by seed (`vs_first`: the
paired difference in points of the consortium's val balanced accuracy and AUROC, its mean and
its spread over seeds); `clear` says the mean balanced-accuracy gain exceeds that spread. The
winner is the recipe with the highest mean val balanced accuracy (AUROC breaks ties).

    nice -n 10 python bench/medmnist_recipe_bench.py --scenario breastmnist \\
        --recipe base: e40:epochs=40 noaug:augment=0 msd:start=msd,lr=3e-4

`--keep-rules` also judges the rules a node could decide by which model it uses after the
aggregation (`atdnode.aggregation.keep`), without a test image. Per site and seed, its three
candidates (`keep.CANDIDATES`): "consortium" (its consortium model above), "own" (its model of the
vertical step, end to end: what a node's own model is there) and "raw-pixels" (its raw-pixel
ensemble, `raw-own` above). Each rule of `KEEP_RULES` picks one on the site's own val split, through
`keep.choose` on scores shaped as `atdnode.aggregation.candidates.score_candidates` builds them: R1
the one-SE rule alone (SE from the library's `paired_balanced_accuracy_se`, seed 0); R2 the
one-SE rule with the SE of a Bayesian bootstrap under Jeffreys pseudo-counts
(`atdnode.learning.metrics.jeffreys_paired_balanced_accuracy_se`); R3 policy best as a node runs
it: the consortium unless every class of the site's own has `keep.MIN_VAL_PER_CLASS` val images
(one absent from the split has none), else R1; R4 policy consortium; R5 the highest val balanced accuracy (no SE). The pick is scored on the
other sites' val splits pooled: images the site's decision never saw, and, since every site's images
are dealt from one pool by class shares and balanced accuracy does not depend on class priors, an
independent held-out estimate of the same quantity (a simulation's privilege: a real node never sees
them). `keep_rules` in each recipe's entry (`keep_summary`): per rule the mean held-out balanced
accuracy of the kept candidate over sites x seeds, its regret (the best candidate's held-out score
minus the kept one's), how often it keeps each candidate, and per site its paired difference in
points against R1 over seeds; each site's run holds the per-seed detail ("keep": val scores, SEs,
picks, held-out scores). The held-out set is itself small (the other sites' val splits: 48 images on
BreastMNIST), so a site's held-out score is an estimate too.

`--merge A.json B.json` summarises outputs of separate runs (other seeds, same recipes) as one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from atdnode.models import RAW_PIXELS  # noqa: E402
from protocols.vit_config import STEMS  # noqa: E402


KEYS = {"epochs": int, "augment": lambda v: bool(int(v)), "embed_dim": int, "depth": int, "heads": int, "img": int,
        "patch": int, "stem": str, "start": str, "lr": float, "probe": int, "probe_lr": float, "msd_steps": int,
        "tta": lambda v: bool(int(v)), "pca": int, "pool": str, "pool_epochs": int}


def parse_recipe(text: str) -> tuple[str, dict]:
    """"NAME:key=value,..." -> (NAME, {key: value}); unknown keys are refused."""
    name, _, rest = text.partition(":")
    out = {}
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        if k not in KEYS:
            raise SystemExit(f"recipe {name}: unknown key {k!r} (one of {', '.join(KEYS)})")
        out[k] = KEYS[k](v)
    if out.get("stem", "patch") not in STEMS:
        raise SystemExit(f"recipe {name}: stem must be one of {', '.join(STEMS)}, got {out['stem']!r}")
    if (out.get("start") == "public") != ("pool" in out):
        raise SystemExit(f"recipe {name}: start=public and pool=SPEC go together")
    if out.get("stem") == "conv" and out.get("start") == "msd":
        raise SystemExit(f"recipe {name}: the MSD base has timm's patch embedding: stem=conv needs start=scratch")
    return name, out


def apply_recipe(scn, r: dict):
    """The scenario with recipe `r`'s [model] / [train] values."""
    m = scn.model
    model = replace(m, embed_dim=r.get("embed_dim", m.embed_dim), depth=r.get("depth", m.depth),
                    num_heads=r.get("heads", m.num_heads), img_size=r.get("img", m.img_size),
                    patch_size=r.get("patch", m.patch_size), stem=r.get("stem", m.stem))
    t = scn.train
    train = replace(t, epochs=r.get("epochs", t.epochs), augment=r.get("augment", t.augment), lr=r.get("lr", t.lr),
                    probe_epochs=r.get("probe", t.probe_epochs), probe_lr=r.get("probe_lr", t.probe_lr))
    return scn.replace(model=model, train=train)


def run_recipe(scn, recipe: dict, seed: int, log, keep_rules: bool = False) -> dict:
    """Per site: the consortium model's, its raw-pixel ensemble's and its local model's val
    balanced accuracy and AUROC under `recipe` at `seed`; with `keep_rules`, its "keep" entry
    (`keep_entry`)."""
    from atdnode.aggregation import fit_reference
    from atdnode.learning import build_model, extract_features, extractor_state
    from netsim.learn import global_probs, model_config, predict_proba, score_probs, to_global, train_model
    from netsim.msdbase import base_scenario
    from netsim.nodedata import load_scenario_data
    from netsim.references import ensemble_options
    from protocols.vgs import fit_vertical_ensemble

    t0 = time.perf_counter()
    scn = apply_recipe(scn, recipe).replace(seed=seed)
    data = load_scenario_data(scn)
    space, sites = data.label_space, list(data.nodes)
    start_kind = recipe.get("start", "scratch")
    if start_kind == "msd":
        from bench.jitter_recipe_bench import msd_start

        scn = base_scenario(scn)
        start = msd_start(scn, data, seed, recipe.get("msd_steps", scn.msd.steps))
    elif start_kind == "public":
        start = public_start(scn, recipe["pool"], seed, recipe.get("pool_epochs", 30), log)
    else:  # netsim.vgs.consortium_init: the founder's seeded init
        torch.manual_seed(seed + sum(map(ord, sites[0])))
        start = extractor_state(build_model(model_config(scn.model, len(data.nodes[sites[0]].classes))))
    spec = scn.train
    opts = ensemble_options(scn)
    if "pca" in recipe:
        opts = replace(opts, pca_components=recipe["pca"])

    def train(node: str, init: dict):
        nd = data.nodes[node]
        return train_model(model_config(scn.model, len(nd.classes)), nd.train, spec, seed=seed + sum(map(ord, node)),
                           init=init, init_part="extractor").model

    first = train(sites[0], start)
    tuned = [first] + [train(n, extractor_state(first)) for n in sites[1:]]
    states = [extractor_state(m) for m in tuned]
    mean = {k: sum(s[k].double() for s in states).div(len(states)).to(states[0][k].dtype) for k in states[0]}
    consortium = build_model(model_config(scn.model, 2))
    consortium.load_state_dict(mean, strict=False)
    consortium.eval()

    def feats(split) -> np.ndarray:
        x = extract_features(consortium, split)[0]
        if not recipe.get("tta"):
            return x
        flipped = replace(split, images=split.images.flip(-1))
        return (x + extract_features(consortium, flipped)[0]) / 2  # the mean over the image and its mirror

    parts = [(feats(data.nodes[n].train), data.nodes[n].train.labels.numpy(), list(data.nodes[n].classes))
             for n in sites]
    val_feats = {n: feats(data.nodes[n].val) for n in sites}
    val_y = {n: to_global(data.nodes[n].val.labels.numpy(), data.nodes[n].classes, space) for n in sites}
    out: dict = {}
    for i, n in enumerate(sites):
        nd = data.nodes[n]
        y = val_y[n]
        ens, classes = fit_vertical_ensemble(parts, own=i, **replace(opts, seed=seed).kwargs())
        raw = fit_reference("ensemble-raw", [nd.train], model_config(scn.model, len(nd.classes)),
                            **replace(opts, seed=seed).kwargs())

        def cons_probs(m: str) -> np.ndarray:  # the site's consortium model on site m's val split
            p = np.zeros((len(val_feats[m]), len(classes)))
            p[:, ens.classes_.astype(np.int64)] = ens.predict_proba(val_feats[m])
            return global_probs(p, classes, space)

        def raw_probs(m: str) -> np.ndarray:  # the site's raw-pixel ensemble on site m's val split
            v = data.nodes[m].val
            pr = np.zeros((len(v), len(raw.classes)))
            flat = v.images.reshape(len(v), -1).numpy()
            pr[:, raw.ensemble.classes_.astype(np.int64)] = raw.ensemble.predict_proba(flat)
            return global_probs(pr, raw.classes, space)

        local = tuned[0] if i == 0 else train(n, start)
        rows = {"consortium": cons_probs(n), "raw-own": raw_probs(n),
                "local": global_probs(predict_proba(local, nd.val.images), nd.classes, space)}
        rows["blend"] = (rows["consortium"] + rows["raw-own"]) / 2
        out[n] = {k: {m: round(v.get(m, float("nan")), 4) for m in ("balanced_accuracy", "auroc")}
                  for k, v in ((k, score_probs(y, q)) for k, q in rows.items())}
        out[n]["val_n"] = len(nd.val)
        if keep_rules:  # the node's three candidates (`atdnode.aggregation.keep.CANDIDATES`) on every val split
            own = tuned[i]
            preds = {m: {"consortium": cons_probs(m).argmax(1), RAW_PIXELS: raw_probs(m).argmax(1),
                         "own": global_probs(predict_proba(own, data.nodes[m].val.images), nd.classes,
                                             space).argmax(1)} for m in sites}
            out[n]["keep"] = keep_entry(val_y, preds, n, [space.index(c) for c in nd.classes])
        log(json.dumps({"seed": seed, "site": n, **out[n]}))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


_PUBLIC: dict = {}  # W_p per (pool, model, recipe, seed, epochs), for this process's recipes


def public_start(scn, pool: str, seed: int, epochs: int, log) -> dict:
    """A public W_p's extractor tensors (VGS-ATD §3.2): the scenario's model pretrained
    (`netsim.publicbase.train_public_base`, the scenario's [train] recipe at `epochs`, seeded
    like netsim's designated client) on the training split of the public data set `pool` (a
    data spec disjoint from the sites' data: another published set), source val joined."""
    from atdnode.data import load_dataset, without_val
    from netsim.publicbase import PUBLIC_SEED_SALT, train_public_base

    spec, m = without_val(pool), scn.model
    t = replace(scn.train, probe_epochs=0)  # W_p trains from scratch: nothing to probe
    key = (spec, repr(m), repr(t), seed, epochs)
    if key in _PUBLIC:  # recipes that differ only after the start share one W_p per seed
        return _PUBLIC[key]
    pool_splits = tuple(load_dataset(spec, m.img_size, m.in_chans, side, seed=seed) for side in ("train", "test"))
    got = train_public_base(m, t, pool_splits, seed=seed + PUBLIC_SEED_SALT, epochs=epochs, lr=scn.train.lr)
    log(json.dumps({"seed": seed, "public_base": pool, "pool_train_images": got.train_images,
                    "pool_test_accuracy": round(got.test_accuracy, 4), "train_s": round(got.seconds, 1)}))
    _PUBLIC[key] = got.extractor
    return got.extractor



def balanced_accuracy(y: np.ndarray, pred: np.ndarray) -> float:
    """The mean over the classes present in `y` of their recall (what `atd classify`'s scorer,
    `atdnode.learning.metrics.classification_metrics`, reports as balanced accuracy)."""
    return float(np.mean([np.mean(pred[y == c] == c) for c in np.unique(y)]))


KEEP_RULES = {
    "R1_best": "the one-SE rule alone, SE from the class-stratified paired bootstrap",
    "R2_jeffreys": "the one-SE rule, SE from a Bayesian bootstrap with Jeffreys pseudo-counts "
                   "(jeffreys_paired_balanced_accuracy_se)",
    "R3_min5": "policy best: the consortium unless every class has at least MIN_VAL_PER_CLASS (5) val images, "
               "else R1 (atdnode.aggregation.keep)",
    "R4_consortium": "policy consortium: always the consortium's model",
    "R5_argmax": "the highest val balanced accuracy, no SE (ties in CANDIDATES order)",
}


def keep_entry(val_y: dict, preds: dict, site: str, classes: list[int]) -> dict:
    """For `site`: its candidates' balanced accuracy on its own val split ("val") with each other
    candidate's SE beside the consortium's ("se": the library's, "se_jeffreys"), the candidate each
    rule of `KEEP_RULES` keeps, judged on that split alone through `atdnode.aggregation.keep.choose`
    on scores shaped as `score_candidates` builds them ("picks"), and each candidate's balanced
    accuracy on the other sites' val splits pooled ("heldout": images the site's decision never
    saw, from the same class-conditional pool; balanced accuracy does not depend on the priors).
    `val_y` {site: labels}; `preds` {site: {candidate: predicted indices}}, both in the label space;
    `classes`: the site's own classes in it (R3 counts each of them in the site's val split, as
    `score_candidates` counts the node's data's classes)."""
    from atdnode.aggregation.keep import CANDIDATES, choose
    from atdnode.learning import jeffreys_paired_balanced_accuracy_se, paired_balanced_accuracy_se

    y, own = val_y[site], preds[site]
    val = {c: round(balanced_accuracy(y, own[c]), 6) for c in CANDIDATES}
    se = {c: round(paired_balanced_accuracy_se(y, own[c], own["consortium"], seed=0), 6)
          for c in CANDIDATES if c != "consortium"}  # seed 0: as judge_candidates scores
    se_j = {c: round(jeffreys_paired_balanced_accuracy_se(y, own[c], own["consortium"], seed=0), 6) for c in se}

    per_class = np.bincount(y, minlength=max(classes) + 1)[classes]

    def scores(ses: dict, counts: bool = False) -> dict:  # score_candidates' shape (counts: with val_class_counts)
        return {"scored_on": "val", **{c: {"balanced_accuracy": val[c], **({"se": ses[c]} if c in ses else {})}
                                       for c in CANDIDATES},
                **({"val_class_counts": {str(c): int(n) for c, n in zip(classes, per_class)}} if counts else {})}

    # R3 is policy best as the node runs it (`choose` with the split's class counts); R1 the
    # one-SE rule alone (the same call without them)
    picks = {"R1_best": choose("best", scores(se))[0], "R2_jeffreys": choose("best", scores(se_j))[0],
             "R3_min5": choose("best", scores(se, counts=True))[0],
             "R4_consortium": choose("consortium", scores(se))[0],
             "R5_argmax": choose("best", scores({c: 0.0 for c in se}))[0]}
    others = [m for m in val_y if m != site]
    hy = np.concatenate([val_y[m] for m in others])
    held = {c: round(balanced_accuracy(hy, np.concatenate([preds[m][c] for m in others])), 6) for c in CANDIDATES}
    return {"val": val, "se": se, "se_jeffreys": se_j, "val_per_class": per_class.tolist(),
            "picks": {r: picks[r] for r in KEEP_RULES}, "heldout": held, "heldout_n": int(len(hy))}


def keep_summary(runs: list[dict]) -> dict:
    """Per rule of `KEEP_RULES`, over sites x seeds: the mean held-out balanced accuracy of the
    candidate it keeps, the mean regret (the best candidate's held-out score minus the kept one's),
    how often it keeps each candidate, and per site its paired difference in points against R1
    (mean and population standard deviation over seeds)."""
    from atdnode.aggregation.keep import CANDIDATES

    sites = [k for k in runs[0] if isinstance(runs[0][k], dict) and "keep" in runs[0][k]]
    cells = [r[s]["keep"] for r in runs for s in sites]
    oracle = [max(k["heldout"].values()) for k in cells]
    out = {"oracle_heldout_balanced_accuracy": round(statistics.fmean(oracle), 4),
           "candidate_heldout_balanced_accuracy": {c: round(statistics.fmean(k["heldout"][c] for k in cells), 4)
                                                   for c in CANDIDATES},
           "cells": len(cells), "rules": {}}
    for rule, what in KEEP_RULES.items():
        got = [k["heldout"][k["picks"][rule]] for k in cells]
        per_site = {}
        for s in sites:
            d = [100 * (r[s]["keep"]["heldout"][r[s]["keep"]["picks"][rule]]
                        - r[s]["keep"]["heldout"][r[s]["keep"]["picks"]["R1_best"]]) for r in runs]
            per_site[s] = {"points_runs": [round(x, 1) for x in d], "mean": round(statistics.fmean(d), 1),
                           "spread": round(statistics.pstdev(d), 1) if len(d) > 1 else None}
        out["rules"][rule] = {
            "what": what, "heldout_balanced_accuracy": round(statistics.fmean(got), 4),
            "regret": round(statistics.fmean(o - g for o, g in zip(oracle, got)), 4),
            "picks": {c: sum(k["picks"][rule] == c for k in cells) for c in CANDIDATES},
            "vs_R1_points_per_site": per_site}
    return out


def summary(runs: list[dict]) -> dict:
    """Mean over seeds of the mean over sites, per row and metric."""
    sites = [k for k in runs[0] if isinstance(runs[0][k], dict)]
    res = {}
    for row in [r for r in ("consortium", "raw-own", "local", "blend") if r in runs[0][sites[0]]]:
        for m in ("balanced_accuracy", "auroc"):
            per_seed = [statistics.fmean(r[s][row][m] for s in sites) for r in runs]
            res[f"{row}_{m}"] = round(statistics.fmean(per_seed), 4)
            res[f"{row}_{m}_runs"] = [round(x, 4) for x in per_seed]
    res["consortium_minus_best_alone_points"] = round(100 * statistics.fmean(
        statistics.fmean(r[s]["consortium"]["balanced_accuracy"]
                         - max(r[s]["raw-own"]["balanced_accuracy"], r[s]["local"]["balanced_accuracy"]) for s in sites)
        for r in runs), 1)
    return res


def versus(first: dict, other: dict) -> dict:
    """`other` against `first`, seed by seed: the paired difference in points of the consortium's
    val balanced accuracy and AUROC (mean over sites), its mean and spread (population standard
    deviation over seeds), and whether the balanced-accuracy gain is clear of that spread."""
    out = {}
    for m, short in (("balanced_accuracy", "bal_acc"), ("auroc", "auroc")):
        d = [100 * (b - a) for a, b in zip(first[f"consortium_{m}_runs"], other[f"consortium_{m}_runs"])]
        out[short] = {"points_runs": [round(x, 1) for x in d], "mean": round(statistics.fmean(d), 1),
                      "spread": round(statistics.pstdev(d), 1) if len(d) > 1 else None}
    b = out["bal_acc"]
    out["clear"] = b["spread"] is not None and b["mean"] > b["spread"]
    return out


def scored(recipe: dict, runs: list[dict]) -> dict:
    """One recipe's entry: its summary over `runs` (one per seed), the keep rules' (`keep_summary`)
    where the runs scored them, wall times and the runs."""
    sites = [k for k in runs[0] if isinstance(runs[0][k], dict)]
    keep = {"keep_rules": keep_summary(runs)} if all("keep" in r[s] for r in runs for s in sites) else {}
    return {"recipe": recipe, **summary(runs), **keep, "wall_s": [x["wall_s"] for x in runs], "runs": runs}


def verdict(scenario: str, seeds: list[int], out: dict) -> dict:
    """The bench's JSON object: every recipe against the first, and the winner."""
    first = next(iter(out))
    for name in list(out)[1:]:
        out[name]["vs_first"] = versus(out[first], out[name])
    best = max(out, key=lambda k: (out[k]["consortium_balanced_accuracy"], out[k]["consortium_auroc"]))
    return {"bench": "medmnist_recipe", "scenario": scenario, "seeds": seeds, "judged_on": "val", "winner": best,
            "recipes": out}


def merge(paths: list[Path]) -> dict:
    """Several outputs of this bench (one scenario, different seeds) as one: the recipes every
    output holds under the same name and values, their runs joined in the order given."""
    docs = [json.loads(p.read_text()) for p in paths]
    if len({d["scenario"] for d in docs}) != 1:
        raise SystemExit(f"--merge: outputs of different scenarios ({', '.join(sorted({d['scenario'] for d in docs}))})")
    seeds = [s for d in docs for s in d["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--merge: a seed appears twice ({seeds})")
    out = {}
    for name, entry in docs[0]["recipes"].items():
        if all(d["recipes"].get(name, {}).get("recipe") == entry["recipe"] for d in docs):
            out[name] = scored(entry["recipe"], [r for d in docs for r in d["recipes"][name]["runs"]])
    if not out:
        raise SystemExit("--merge: no recipe is in every output with the same values")
    return verdict(docs[0]["scenario"], seeds, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="breastmnist", help="a shipped scenario name or a TOML path")
    ap.add_argument("--recipe", nargs="+", default=["scenario:"], help="NAME:key=value,... (see the docstring)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--keep-rules", action="store_true",
                    help="also score the keep rules (KEEP_RULES) on held-out val splits; see the docstring")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                    help="summarise earlier outputs of this bench (different seeds) instead of running")
    args = ap.parse_args()
    if args.merge:
        print(json.dumps(merge(args.merge), indent=1))
        return
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    from netsim.scenario import load_scenario, shipped_scenario

    warnings.filterwarnings("ignore", category=ConvergenceWarning)
    torch.set_num_threads(1)
    scn = load_scenario(Path(args.scenario) if args.scenario.endswith(".toml") else shipped_scenario(args.scenario))
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    recipes = dict(parse_recipe(r) for r in args.recipe)
    out = {}
    for name, r in recipes.items():
        out[name] = scored(r, [run_recipe(scn, r, s, log, args.keep_rules) for s in args.seeds])
        log(json.dumps({"recipe": name, **{k: v for k, v in out[name].items() if k not in ("runs", "keep_rules")}}))
    print(json.dumps(verdict(scn.name, args.seeds, out), indent=1))


if __name__ == "__main__":
    main()
