"""Benchmark: which start (random consortium init or the MSD base) and which fusion keep
VGS-ATD's extractor close to centralized training on `digits-jitter` ("a setting
and recipe in which learning matters")?

A pooled, in-process replay of the scenario's VGS-ATD phases (`netsim/vgs.py`) at the level
of the extractor weights, with the library's trainer (`netsim.learn.train_model`), its MSD
distillation (`protocols.msd.MSDTrainer` over the pooled images' embedder tokens, what the
netsim campaign runs; `atdnode.split.base.assemble`) and its ensemble
(`protocols.vgs.fit_vertical_ensemble`, the scenario's `[ensemble]`):

    phase 1 (horizontal)   the first founder trains from the start S; the others from its
                           weights (node-to-node transfer); E1 = uniform mean of their extractors
    phase 2 (vertical)     each specialist fine-tunes E1; E2 = uniform mean of E1 and theirs
                           (paper §3.2) -- or, `keep`, the specialist's extractor alone
    phase 3 (hierarchical) the new group's node trains from S; E3 = its extractor and E2
                           averaged with sqrt-classes weights (paper Eq. 11)

Deviations it can score next to the paper's (`--rows`): chain-end (phase 1: the last
founder's extractor instead of the mean; the founders train as a chain, each from the
previous one's weights); b-from-a (phase 3: the new group's node trains from group A's E2,
the consortium's latest fused extractor, netsim's `group_start = "consortium"`, then the
same Eq. 11 average); b-chain-end (group B's model from E2 alone, no average);
b-paper-chain-end (the paper's group-B model from S alone). `--skip-vertical` drops phase 2
(group A is E1: a cheaper probe of the hierarchical step); `--no-paper-phase3` skips the
paper's group-B training; `--ckpt DIR` keeps each trained model, so a stopped run resumes.

S is the consortium init (the founder's seeded init, `netsim.vgs.consortium_init`; rate
[train] lr), the MSD base (rate `--lr`), or W_p (`--start public`, VGS-ATD §3.2: a
designated client's supervised ViT on a public labelled pool, `netsim.publicbase`: `--public
F` of the source digits reserved, rendered `--public-variants` times, trained `--public-epochs`
at `--public-lr`; the nodes keep the other digits; fine-tuning at `--lr` for `--epochs`).
`--baselines` adds centralized (`netsim.baselines.run_centralized` from S, at the nodes' rate
and epochs), centralized-ensemble (the ensemble on centralized's extractor) and local (each
node alone from S) rows; `--choose-lr LR..` only fine-tunes each
phase-1 founder from S on 80 % of its training data at each rate and prints the accuracy on
the other 20 % (no test data: how the fine-tuning rate is chosen).

Each phase's ensemble is fitted on every present
node's training features (the features round) and scored on the phase's pooled test set,
next to the same ensemble on raw pixels, on an untrained extractor, and on S itself, all
in this run. No daemons, no ledger: a cheap probe for choosing a recipe before a full
`atd netsim run` (which is what the claims rest on). Prints one JSON object.

    nice -n 15 python bench/jitter_recipe_bench.py --start scratch
    nice -n 15 python bench/jitter_recipe_bench.py --start msd --lr 3e-4
    nice -n 19 python bench/jitter_recipe_bench.py --start public --choose-lr 3e-4 1e-3 2e-3 --epochs 10 --ckpt /tmp/ck
    nice -n 19 python bench/jitter_recipe_bench.py --start public --lr 1e-3 --epochs 10 --baselines --ckpt /tmp/ck
    nice -n 19 python bench/jitter_recipe_bench.py --no-refs --no-paper-phase3 --ckpt /tmp/ck \\
        --rows vgs-atd chain-end b-from-a b-chain-end
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _mean(states: list[dict], weights: list[float]) -> dict:
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    return {k: sum(float(wi) * s[k].double() for wi, s in zip(w, states)).to(states[0][k].dtype) for k in states[0]}


def msd_start(scn, data, seed: int, steps: int) -> dict:
    """The MSD base's extractor tensors, distilled on every node's training images."""
    from atdnode.learning import extractor_state
    from atdnode.split.base import assemble
    from protocols.msd import MSDConfig, MSDTrainer
    from protocols.split_parts import build_plain_embedder, new_embedder_state, split_config, split_dict

    x = torch.cat([nd.train.images for nd in data.nodes.values()])
    cfg = split_config(split_dict(replace(scn.model, mlp_ratio=4.0)))
    emb = new_embedder_state(cfg, seed=seed)
    with torch.no_grad():
        tokens = build_plain_embedder(cfg, state=emb)(x)
    m = scn.msd
    mc = MSDConfig(steps=steps, batch_size=m.batch_size, lr=m.lr, teacher_keep=m.teacher_keep,
                   student_keep=m.student_keep, teacher_views=m.teacher_views, student_views=m.student_views, seed=seed)
    body = MSDTrainer(cfg, mc).train(tokens).body_state
    model, _ = assemble(cfg, emb, body)
    return extractor_state(model)


def run(scn, args, log) -> dict:
    from atdnode.learning import build_model, extract_features, extractor_state
    from netsim.learn import model_config, predict, to_global, train_model
    from netsim.msdbase import base_scenario
    from netsim.nodedata import load_scenario_data
    from netsim.references import ensemble_options
    from netsim.baselines import run_centralized
    from netsim.publicbase import private_spec
    from atdnode.learning.probe import probe_lr
    from protocols.vgs import fit_vertical_ensemble

    seed = args.seed
    scn = scn.replace(seed=seed)
    if args.start == "public":  # the nodes keep the digits outside the public pool
        scn = scn.replace(datasets=tuple(replace(d, spec=private_spec(d.spec, args.public)) for d in scn.datasets))
    data = load_scenario_data(scn)
    space = data.label_space
    out: dict = {"start": args.start, "seed": seed, "epochs": args.epochs or scn.train.epochs, "timings": {}}
    t_all = time.perf_counter()
    if args.start == "msd":
        scn = base_scenario(scn)
    cfg = lambda n: model_config(scn.model, n)  # noqa: E731
    founder = next(iter(data.nodes))
    t0 = time.perf_counter()
    if args.start == "msd":
        start = msd_start(scn, data, seed, args.msd_steps)
        lr = args.lr
    elif args.start == "public":
        start, out["public_base"] = public_start(scn, args, log)
        lr = args.lr
    else:  # netsim.vgs.consortium_init
        torch.manual_seed(seed + sum(map(ord, founder)))
        start = extractor_state(build_model(cfg(len(data.nodes[founder].classes))))
        lr = args.lr or scn.train.lr
    out["lr"], out["timings"]["start_s"] = lr, round(time.perf_counter() - t0, 1)
    spec = replace(scn.train, lr=lr)
    if args.probe_epochs is not None:  # LP-FT (atdnode.learning.probe) for every training from S, centralized included
        spec = replace(spec, probe_epochs=args.probe_epochs, probe_lr=args.probe_lr)
    kw = {**replace(ensemble_options(scn), seed=seed).kwargs(), "prior": "none"}

    trained: dict[str, torch.nn.Module] = {}
    run_tag = f"{args.start}-s{seed}" + (f"-{_public_tag(args)}-lr{lr or 0:g}-e{args.epochs or scn.train.epochs}"
                                         if args.start == "public" else "")
    if spec.probe_epochs:
        run_tag += f"-lp{spec.probe_epochs}x{probe_lr(spec, scn.model.embed_dim):g}"
    if args.freeze:
        run_tag += f"-fz{args.freeze}"

    def train(node: str, init: dict, part: str = "extractor", tag: str = "", train_data=None):
        nd = data.nodes[node]
        key = f"{run_tag}-{node}{tag}"
        if key in trained:  # the same step already ran in this process (local = a VGS-ATD step)
            return trained[key]
        ck = Path(args.ckpt) / f"{key}.pt" if args.ckpt else None
        if ck is not None and ck.exists():  # a checkpoint of this very step (same start, seed, node)
            m = build_model(cfg(len(nd.classes)))
            m.load_state_dict(torch.load(ck))
            log(f"loaded {ck}")
            trained[key] = m.eval()
            return trained[key]
        td = nd.train if train_data is None else train_data
        t = train_model(cfg(len(nd.classes)), td, spec, seed=seed + sum(map(ord, node)), epochs=args.epochs,
                        init=init, init_part=part, freeze=args.freeze)
        out["timings"][f"train_{node}{tag}_s"] = round(t.seconds, 1)
        log(f"trained {node}{tag} ({len(td)} images) in {t.seconds:.0f} s")
        if ck is not None:
            ck.parent.mkdir(parents=True, exist_ok=True)
            torch.save(t.model.state_dict(), ck)
        trained[key] = t.model
        return t.model

    def train_with(node: str, lr_: float, tr):
        nonlocal spec
        keep, spec = spec, replace(spec, lr=lr_)
        try:
            return train(node, start, tag=f"-holdout-lr{lr_:g}", train_data=tr)
        finally:
            spec = keep

    def holdout_ensemble(model, fit, hold) -> float:
        """The ensemble on `model`'s features of `fit`, scored on `hold` (one node's own data)."""
        X = [extract_features(model, d)[0] for d in (fit, hold)]
        ens, _ = fit_vertical_ensemble([(X[0], fit.labels.numpy(), list(fit.classes))], own=0, **kw)
        return round(float((ens.predict(X[1]) == hold.labels.numpy()).mean()), 4)

    if args.choose_lr:  # the fine-tuning rate from the founders' own holdouts: no test data
        return {**out, "choose_lr": choose_lr(data, [n for n, d in data.nodes.items() if d.phase == 1], args, train_with,
                                             holdout_ensemble),
                "wall_s": round(time.perf_counter() - t_all, 1)}

    def ext(model_or_state) -> torch.nn.Module:
        if isinstance(model_or_state, dict):
            m = build_model(cfg(2))
            m.load_state_dict(model_or_state, strict=False)
            return m.eval()
        return model_or_state

    def score(phase: int, extractor) -> float:
        """Ensemble on `extractor`'s features (None: raw pixels) of the present nodes' training
        data, scored on the phase's pooled test set."""
        def feats(split) -> np.ndarray:
            if extractor is None:
                return split.images.reshape(len(split.images), -1).numpy()
            return extract_features(ext(extractor), split)[0]

        parts = [(feats(data.nodes[n].train), data.nodes[n].train.labels.numpy(), list(data.nodes[n].classes))
                 for n in data.present(phase)]
        ens, classes = fit_vertical_ensemble(parts, own=0, **kw)
        te = data.pooled_test(phase)
        y = to_global(te.labels.numpy(), te.classes, space)
        pred = to_global(ens.predict(feats(te)), list(classes), space)
        return round(float((pred == y).mean()), 4)

    def e2e(phase: int, models: dict) -> float:
        """Mean over the present nodes of their own model's accuracy on the phase's pooled test
        set (`netsim.baselines.evaluate_phase`'s overall)."""
        te = data.pooled_test(phase)
        y = to_global(te.labels.numpy(), te.classes, space)
        accs = [(to_global(predict(m, te.images), list(data.nodes[n].classes), space) == y).mean()
                for n, m in models.items()]
        return round(float(np.mean(accs)), 4)

    nodes_at = {p: [n for n, d in data.nodes.items() if d.phase == p] for p in (1, 2, 3)}
    rows: dict[str, list[float]] = {k: [] for k in ("vgs-atd", "raw", "untrained")}
    torch.manual_seed(seed + 7)
    untrained = extractor_state(build_model(cfg(2)))
    t_ens, refs_done = 0.0, set()

    def phase_rows(p: int, cands: dict[str, dict]) -> None:
        """Score this phase's candidates (in --rows order) as soon as they exist."""
        nonlocal t_ens
        t0 = time.perf_counter()
        for k in args.rows:
            if k in cands:
                rows.setdefault(k, []).append(score(p, cands[k]))
        if args.refs and p not in refs_done:  # once per phase
            refs_done.add(p)
            rows["raw"].append(score(p, None))
            rows["untrained"].append(score(p, untrained))
        t_ens += time.perf_counter() - t0
        log(json.dumps({"phase": p, **{k: v[-1] for k, v in rows.items() if v}}))

    # phase 1: node-to-node transfer inside the founders, uniform mean of extractors
    h = nodes_at[1]
    first = train(h[0], start)
    same = all(data.nodes[n].classes == data.nodes[h[0]].classes for n in h)
    models = [first] + [train(n, first.state_dict() if same else extractor_state(first), "full" if same else "extractor")
                        for n in h[1:]]
    e1 = _mean([extractor_state(m) for m in models], [1.0] * len(models))
    # chain-end: the last founder's extractor, no mean
    phase_rows(1, {"vgs-atd": e1, "vgs-atd-keep": e1, "start": start, "chain-end": extractor_state(models[-1])})
    # phase 2: specialists fine-tune E1; vertical mean (paper) or the specialist's extractor (keep)
    if args.skip_vertical:  # a cheaper probe of phase 3: group A is the founders' E1 alone
        e2 = e2_keep = e1
    else:
        spec_models = [extractor_state(train(n, e1)) for n in nodes_at[2]]
        e2 = _mean([e1, *spec_models], [1.0] * (1 + len(spec_models)))
        e2_keep = _mean(spec_models, [1.0] * len(spec_models))
        phase_rows(2, {"vgs-atd": e2, "vgs-atd-keep": e2_keep, "start": start})
    # phase 3: the new group trains from S (the paper) -- or, b-from-a, from group A's fused
    # extractor E2 (the consortium's latest model; `group_start = "consortium"`); then the
    # sqrt-classes average (Eq. 11); b-chain-end: group B's model alone
    ka, kb = len(data.classes_at(1 if args.skip_vertical else 2)), len({c for n in nodes_at[3] for c in data.nodes[n].classes})
    wa, wb = math.sqrt(ka), math.sqrt(kb)
    if {"b-from-a", "b-chain-end"} & set(args.rows):
        tag = "-from-e1" if args.skip_vertical else "-from-e2"
        g_b2 = _mean([extractor_state(train(n, e2, tag=tag)) for n in nodes_at[3]], [1.0] * len(nodes_at[3]))
        phase_rows(3, {"b-from-a": _mean([e2, g_b2], [wa, wb]), "b-chain-end": g_b2})
    if {"vgs-atd", "vgs-atd-keep"} & set(args.rows) and args.paper_phase3:
        g_b = _mean([extractor_state(train(n, start)) for n in nodes_at[3]], [1.0] * len(nodes_at[3]))
        phase_rows(3, {"vgs-atd": _mean([e2, g_b], [wa, wb]), "vgs-atd-keep": _mean([e2_keep, g_b], [wa, wb]),
                       "b-paper-chain-end": g_b, "start": start})
    if args.baselines:  # local (each node alone from S) and centralized (pooled, from S)
        for p in (1, 2, 3):
            rows.setdefault("local", []).append(
                e2e(p, {n: train(n, start, tag="" if n in (h[0], *nodes_at[3]) else "-local") for n in data.present(p)}))
            log(json.dumps({"phase": p, "local": rows["local"][-1]}))
        cs = scn.replace(train=replace(spec, epochs=args.epochs or spec.epochs))
        cen_models: list = []
        cen = run_centralized(cs, data, log, base=start if args.start != "scratch" else None, models=cen_models)
        rows["centralized"] = [round(r.overall["accuracy"], 4) for r in cen]
        # the VGS-ATD ensemble on centralized's own extractor: how much of the gap is the
        # classifier (PCA -> MLP + RF + SVM vs an end-to-end head), not the extractor
        rows["centralized-ensemble"] = [score(p, extractor_state(m)) for p, m in zip((1, 2, 3), cen_models)]
        out["timings"]["centralized_s"] = round(sum(r.compute_s for r in cen), 1)
        log(json.dumps({"centralized": rows["centralized"]}))
    out["timings"]["ensembles_s"] = round(t_ens, 1)
    out["accuracy"] = {k: v for k, v in rows.items() if v}
    if args.refs and len(rows["vgs-atd"]) == 3:
        out["minus_raw_points"] = [round(100 * (a - r), 1) for a, r in zip(rows["vgs-atd"], rows["raw"])]
    if args.baselines and len(rows["vgs-atd"]) == 3:
        out["minus_centralized_points"] = [round(100 * (a - c), 1) for a, c in zip(rows["vgs-atd"], rows["centralized"])]
    out["wall_s"] = round(time.perf_counter() - t_all, 1)
    return out


def _public_tag(args) -> str:
    return f"pub{args.public:g}x{args.public_variants}-e{args.public_epochs}-lr{args.public_lr:g}"


def public_start(scn, args, log) -> tuple[dict, dict]:
    """W_p: the designated client's supervised ViT on the public pool (`netsim.publicbase`),
    reused from `--ckpt` when the same pool, seed and recipe built it before."""
    from netsim.publicbase import PUBLIC_SEED_SALT, load_pool, train_public_base

    # the pool's split is fixed (data seed 0, as `atd train` loads a spec), like a published data set's
    pool = load_pool(scn.datasets[0].spec, args.public, args.public_variants, scn.model, 0)
    ck = Path(args.ckpt) / f"wp-s{scn.seed}-{_public_tag(args)}.pt" if args.ckpt else None
    if ck is not None and ck.exists():
        saved = torch.load(ck)
        log(f"loaded W_p {ck}")
        return saved["extractor"], saved["summary"]
    log(f"training W_p on the public pool ({len(pool[0])} images, {args.public_epochs} epochs at {args.public_lr:g})")
    wp = train_public_base(scn.model, scn.train, pool, seed=scn.seed + PUBLIC_SEED_SALT, epochs=args.public_epochs,
                           lr=args.public_lr)
    summary = {**wp.summary(), "fraction": args.public, "variants": args.public_variants,
               "epochs": args.public_epochs, "lr": args.public_lr}
    log(json.dumps({"public_base": summary}))
    if ck is not None:
        ck.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"extractor": wp.extractor, "summary": summary}, ck)
    return wp.extractor, summary


def choose_lr(data, founders: list[str], args, train_at, ens_at) -> dict:
    """Fine-tune each phase-1 founder from S on a seeded 80 % of its training data at each
    rate of `--choose-lr`; its own accuracy on the other 20 % (end-to-end, its label space,
    and `ens_at`: the VGS-ATD ensemble on the fine-tuned model's features, fitted on the 80 %),
    and the founders' pooled holdout accuracy (no test data is read)."""
    from netsim.learn import predict
    from netsim.nodedata import subset

    res: dict = {}
    for node in founders:
        nd = data.nodes[node]
        perm = np.random.default_rng([args.seed, 0xC0DE]).permutation(len(nd.train))
        cut = int(0.8 * len(perm))
        fit, hold = (subset(nd.train, np.sort(perm[a:b]), nd.classes) for a, b in ((0, cut), (cut, len(perm))))
        for lr in args.choose_lr:
            m = train_at(node, lr, fit)
            acc = round(float((predict(m, hold.images) == hold.labels.numpy()).mean()), 4)
            ens = ens_at(m, fit, hold)
            res.setdefault(f"{lr:g}", {})[node] = {"fit": len(fit), "holdout": len(hold), "accuracy": acc,
                                                   "ensemble": ens}
            print(json.dumps({"node": node, "lr": lr, "holdout_accuracy": acc, "holdout_ensemble": ens}),
                  file=sys.stderr, flush=True)
    for r in res.values():  # weighted by holdout size: the founders' pooled holdout accuracies
        n = sum(v["holdout"] for v in r.values())
        for k in ("accuracy", "ensemble"):
            r[f"pooled_{k}"] = round(sum(v[k] * v["holdout"] for v in list(r.values()) if isinstance(v, dict)) / n, 4)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="netsim/scenarios/jitter.toml")
    ap.add_argument("--start", choices=("scratch", "msd", "public"), default="scratch")
    ap.add_argument("--public", type=float, default=0.3, help="fraction of source digits in the public pool")
    ap.add_argument("--public-variants", type=int, default=8, help="renderings per public digit")
    ap.add_argument("--public-epochs", type=int, default=30)
    ap.add_argument("--public-lr", type=float, default=2e-3)
    ap.add_argument("--baselines", action="store_true", help="add local and centralized rows (from S)")
    ap.add_argument("--choose-lr", type=float, nargs="+", help="only: the first founder's holdout accuracy per rate")
    ap.add_argument("--lr", type=float, help="training rate (default: [train] lr; --start msd needs it)")
    ap.add_argument("--epochs", type=int, help="override [train] epochs")
    ap.add_argument("--msd-steps", type=int, help="MSD distillation steps (default: [msd] steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe-epochs", type=int, help="LP-FT (atdnode.learning.probe): epochs of the fresh head alone on the "
                    "frozen start before fine-tuning (default: [train] probe_epochs)")
    ap.add_argument("--probe-lr", type=float, help="LP-FT: the probe's rate (default: [train] probe_lr, else 5 x --lr)")
    ap.add_argument("--freeze", type=int, default=0, help="freeze the embeddings and the first K blocks while fine-tuning")
    ap.add_argument("--no-refs", dest="refs", action="store_false", help="skip the raw / untrained ensembles")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-paper-phase3", dest="paper_phase3", action="store_false",
                    help="skip the paper's phase 3 (group B from S): only b-* rows there")
    ap.add_argument("--skip-vertical", action="store_true",
                    help="no phase 2: phase 3's group A is the founders' E1 (a cheaper probe of the hierarchical step)")
    ap.add_argument("--ckpt", help="folder for each trained model (reused when present: a stopped run resumes)")
    ap.add_argument("--rows", nargs="+", default=["vgs-atd", "vgs-atd-keep", "start"],
                    choices=("vgs-atd", "vgs-atd-keep", "start", "b-from-a", "b-chain-end", "chain-end", "b-paper-chain-end"),
                    help="which extractors to score (b-*: phase 3 only, chain-end: phase 1 only)")
    args = ap.parse_args()
    from netsim.scenario import load_scenario

    torch.set_num_threads(args.threads)
    scn = load_scenario(Path(args.scenario))
    if args.start == "public" and args.lr is None and not args.choose_lr:
        ap.error("--start public needs --lr (or --choose-lr)")
    if args.start == "msd" and args.lr is None:
        args.lr = scn.msd.finetune_lr or scn.train.lr
    args.msd_steps = args.msd_steps or scn.msd.steps
    res = run(scn, args, lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({"bench": "jitter_recipe", "scenario": args.scenario, **res}, indent=1))


if __name__ == "__main__":
    main()
