"""The MSD base: settings measurement, campaign cost, and accuracy per phase.

    python bench/msd_base_bench.py --choose [--steps 300] [--seeds 2]
        MSD's view settings the paper leaves blank (teacher / student keep fractions and
        view counts), measured on the scenario's nodes' pooled training images (no labels in
        distillation; `protocols.msd.MSDTrainer`, the code the MSD server runs): each
        candidate's distilled body is then fine-tuned with labels for a few steps
        (`protocols.msd.fine_tune`, body + tail, as a client does) and scored on the pooled
        test set, next to the same fine-tuning from a random body (same seeds). Ratio = MSD
        accuracy / scratch accuracy, per candidate.

    python bench/msd_base_bench.py --probe demo_quick [--steps-list 0,300,1000,2000] [--seeds 3]
        How long the MSD campaign must run: the base's features as they are (no fine-tuning)
        under the scenario's last-phase ensemble (`EnsembleClassifier` with its
        ``[ensemble]`` settings, fitted on every node's training features, scored on the
        pooled test set) after N distillation steps, N = 0 being the random body. The
        embedder is the one netsim's campaign draws from the seed; ratio = accuracy / the
        random body's. This is what VGS-ATD's features start from in every phase.

    python bench/msd_base_bench.py --campaign demo_quick
        MSD campaign wall time and measured bytes per client for the scenario's nodes
        (`netsim.msdbase.run_msd_base`: real daemon, sessions and ledger, in-memory network).

    python bench/msd_base_bench.py --reports A.json B.json ...
        Accuracy per phase of vgs-atd / centralized / centralized-msd from `atd netsim run`
        report files (base scratch and base msd), side by side.

Every mode prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# (teacher_keep, student_keep, teacher_views, student_views); with the scenarios' 4 patches a
# view keeps ceil(keep * 4) tokens: 1.0 -> 4, 0.75 -> 3, 0.5 -> 2, 0.25 -> 1 (0.875 is 4 too).
CANDIDATES = [(1.0, 0.5, 2, 2), (0.75, 0.5, 2, 2), (1.0, 0.25, 2, 2), (1.0, 0.5, 2, 4), (1.0, 0.5, 2, 0)]


def _pooled(name: str):
    from netsim.nodedata import load_scenario_data
    from netsim.scenario import load_scenario, shipped_scenario

    scn = load_scenario(shipped_scenario(name))
    data = load_scenario_data(scn)
    space = data.label_space
    xs, ys, xt, yt = [], [], [], []
    for nd in data.nodes.values():
        for imgs, labels, out_x, out_y in ((nd.train.images, nd.train.labels, xs, ys),
                                           (nd.test.images, nd.test.labels, xt, yt)):
            out_x.append(imgs)
            out_y.append(torch.tensor([space.index(nd.classes[int(i)]) for i in labels]))
    return scn, torch.cat(xs), torch.cat(ys), torch.cat(xt), torch.cat(yt), len(space)


def choose(name: str, steps: int, seeds: int, finetune_steps: list[int]) -> dict:
    from dataclasses import replace

    from protocols.msd import MSDConfig, MSDTrainer, evaluate_local, fine_tune
    from protocols.split_parts import TaskSpec, build_plain_embedder, split_config, split_dict

    scn, x, y, xt, yt, k = _pooled(name)
    m = scn.model
    cfg = split_config(split_dict(replace(m, mlp_ratio=4.0)))  # the scenario's timm ViT (MLP ratio 4)
    task = TaskSpec("digit", "classification", k)
    rows = []
    for cand in [None] + CANDIDATES:
        accs: dict[int, list[float]] = {s: [] for s in finetune_steps}
        t0 = time.perf_counter()
        for seed in range(seeds):
            emb = build_plain_embedder(cfg, seed=100 + seed)  # a stand-in for the clients' secret
            body = None
            if cand is not None:
                tk, sk, tv, sv = cand
                mc = MSDConfig(steps=steps, teacher_keep=tk, student_keep=sk, teacher_views=tv, student_views=sv,
                               seed=seed)
                with torch.no_grad():
                    tokens = emb(x)
                body = MSDTrainer(cfg, mc).train(tokens).body_state
            for s in finetune_steps:
                b, tail = fine_tune(emb, cfg, task, x, y, body_state=body, steps=s, lr=2e-3, seed=seed)
                accs[s].append(evaluate_local(emb, b, tail, task, xt, yt)["accuracy"])
        rows.append({"candidate": "scratch" if cand is None else dict(zip(
            ("teacher_keep", "student_keep", "teacher_views", "student_views"), cand)),
            "accuracy": {str(s): round(sum(v) / len(v), 4) for s, v in accs.items()},
            "seconds": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    scratch = rows[0]["accuracy"]
    for r in rows[1:]:
        r["ratio_to_scratch"] = {s: round(a / scratch[s], 3) for s, a in r["accuracy"].items()}
    best = max(rows[1:], key=lambda r: sum(r["accuracy"].values()))
    return {"bench": "msd_settings", "scenario": name, "images": int(x.shape[0]), "tokens": cfg.num_patches,
            "msd_steps": steps, "seeds": seeds, "finetune_steps": finetune_steps, "rows": rows,
            "best": best["candidate"]}


def probe(name: str, steps_list: list[int], seeds: list[int]) -> dict:
    import warnings
    from dataclasses import replace

    import numpy as np

    from atdnode.learning import extract_features
    from atdnode.split.base import assemble
    from netsim.nodedata import load_scenario_data
    from netsim.scenario import load_scenario, shipped_scenario
    from protocols.ensemble import EnsembleClassifier
    from protocols.msd import MSDConfig, MSDTrainer
    from protocols.split_parts import SplitBody, build_plain_embedder, new_embedder_state, split_config, split_dict

    warnings.filterwarnings("ignore")  # a capped MLP epoch count is a setting, not news
    rows: dict[int, list[float]] = {s: [] for s in steps_list}
    t0 = time.perf_counter()
    for seed in seeds:
        scn = load_scenario(shipped_scenario(name)).replace(seed=seed)
        data = load_scenario_data(scn)
        space, last = data.label_space, max(d.phase for d in data.nodes.values())
        nodes = [data.nodes[n] for n in data.present(last)]
        x = torch.cat([nd.train.images for nd in nodes])
        y = np.concatenate([[space.index(nd.classes[int(i)]) for i in nd.train.labels] for nd in nodes])
        pool, cl = data.pooled_test(last), data.classes_at(last)
        yt = np.array([space.index(cl[int(i)]) for i in pool.labels])
        cfg = split_config(split_dict(replace(scn.model, mlp_ratio=4.0)))
        emb = new_embedder_state(cfg, seed=seed)  # netsim's campaign draws the same (JoinOptions.secret_seed)
        with torch.no_grad():
            tokens = build_plain_embedder(cfg, state=emb)(x)
        for steps in steps_list:
            m = scn.msd
            if steps:
                mc = MSDConfig(steps=steps, batch_size=m.batch_size, lr=m.lr, teacher_keep=m.teacher_keep,
                               student_keep=m.student_keep, teacher_views=m.teacher_views,
                               student_views=m.student_views, seed=seed)
                body = MSDTrainer(cfg, mc).train(tokens).body_state
            else:
                torch.manual_seed(seed)
                body = SplitBody(cfg).state_dict()
            model, _ = assemble(cfg, emb, body)
            f, _ = extract_features(model, _Images(x, y))
            ft, _ = extract_features(model, _Images(pool.images, yt))
            ens = EnsembleClassifier(pca_components=scn.ensemble.pca_components, mlp_max_iter=scn.ensemble.mlp_max_iter,
                                     seed=seed).fit(f, y)
            rows[steps].append(round(float((ens.predict(ft) == yt).mean()), 4))
            print(json.dumps({"seed": seed, "steps": steps, "accuracy": rows[steps][-1]}), file=sys.stderr, flush=True)
    mean = {s: round(sum(v) / len(v), 4) for s, v in rows.items()}
    ref = mean.get(0)
    return {"bench": "msd_steps_probe", "scenario": name, "seeds": seeds, "accuracy": rows, "mean": mean,
            **({"ratio_to_random_body": {s: round(a / ref, 3) for s, a in mean.items()}} if ref else {}),
            "seconds": round(time.perf_counter() - t0, 1)}


class _Images:
    """The (images, labels) pair `extract_features` reads."""

    def __init__(self, x: torch.Tensor, y) -> None:
        self.images, self.labels = x, torch.as_tensor(y)

    def __len__(self) -> int:
        return len(self.images)


def campaign(name: str, steps: int | None) -> dict:
    from netsim.msdbase import run_msd_base
    from netsim.nodedata import load_scenario_data
    from netsim.scenario import load_scenario, shipped_scenario

    scn = load_scenario(shipped_scenario(name)).replace(base="msd")
    if steps is not None:
        from dataclasses import replace

        scn = scn.replace(msd=replace(scn.msd, steps=steps))
    data = load_scenario_data(scn)
    with tempfile.TemporaryDirectory(prefix="atdmb") as d:
        base = run_msd_base(scn, data, Path(d))
    per = base.bytes_per_client
    return {"bench": "msd_campaign", "scenario": name, "nodes": len(per), "wall_s": round(base.wall_s, 2),
            "bytes_per_client": per, "samples": {n: len(data.nodes[n].train) for n in per},
            "mean_up": round(sum(b["up"] for b in per.values()) / len(per)),
            "down_each": sorted({b["down"] for b in per.values()}), "settings": base.settings,
            "msd_loss": base.msd_loss}


def reports(paths: list[str]) -> dict:
    out = {}
    for p in paths:
        rep = json.loads(Path(p).read_text())
        base = ",".join(rep["bases"]) if rep.get("bases") else "msd" if rep.get("msd_base") else "scratch"
        key = f"{rep['scenario']['name']}/{base}/{rep['methods'] and next(iter(rep['methods']))}"
        out[key] = {m: [round(ph["overall"]["accuracy"], 4) for ph in phs] for m, phs in rep["methods"].items()}
        out[key]["model"] = rep.get("msd_base", {}).get("model", {}).get("name") or rep["scenario"]["model"]["name"]
    return {"bench": "msd_base_accuracy", "accuracy_per_phase": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--choose", action="store_true")
    ap.add_argument("--campaign", metavar="SCENARIO")
    ap.add_argument("--probe", metavar="SCENARIO")
    ap.add_argument("--steps-list", default="0,300,1000,2000")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--reports", nargs="+")
    ap.add_argument("--scenario", default="three_phase")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--finetune-steps", type=int, nargs="+", default=[20, 40])
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.choose:
        print(json.dumps(choose(a.scenario, a.steps or 300, a.seeds, a.finetune_steps)))
    elif a.probe:
        seeds = list(range(a.first_seed, a.first_seed + a.seeds))
        print(json.dumps(probe(a.probe, [int(v) for v in a.steps_list.split(",")], seeds)))
    elif a.campaign:
        print(json.dumps(campaign(a.campaign, a.steps)))
    elif a.reports:
        print(json.dumps(reports(a.reports)))
    else:
        ap.error("give --choose, --probe SCENARIO, --campaign SCENARIO or --reports FILE...")


if __name__ == "__main__":
    main()
