"""Reports: report.json, report.md (comparison tables) and PNG plots (matplotlib Agg).

The JSON holds everything; `strip_timing(report)` removes the wall-clock fields (those
named in `TIMING_KEYS`), which is what two runs with the same seed must agree on.
Plots: accuracy per method per phase, bytes per method, forgetting (phase-1 nodes'
accuracy after each phase).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TIMING_KEYS = {"ready_s", "compute_s", "wall_s", "took_s", "seconds", "started", "finished", "publish_s",
               "time_to_converge_s", "complete_at_s", "at_s", "sim_s", "out_dir", "network_s"}
METRIC_KEYS = ("accuracy", "balanced_accuracy", "auroc", "precision", "sensitivity", "f1")


def strip_timing(obj: Any) -> Any:
    """A copy of `obj` without wall-clock / timing fields (recursively)."""
    if isinstance(obj, dict):
        return {k: strip_timing(v) for k, v in obj.items() if k not in TIMING_KEYS}
    if isinstance(obj, list):
        return [strip_timing(v) for v in obj]
    return obj


def write_report(report: dict, out: Path) -> dict[str, Path]:
    """Write report.json, report.md and the PNG plots into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md"}
    paths["json"].write_text(json.dumps(report, indent=2, sort_keys=True, default=_json_default) + "\n")
    paths["md"].write_text(markdown(report))
    if report.get("methods"):
        paths.update(plots(report, out))
    return paths


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (bytes, bytearray)):
        return o.hex()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# ------------------------------------------------------------------ markdown

def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _ci(m: dict, key: str) -> str:
    """"0.812 [0.750, 0.870]": a metric with its 95 % bootstrap interval, where the score has one."""
    ci = m.get(f"{key}_ci95")
    return _fmt(m.get(key)) + (f" [{_fmt(ci[0])}, {_fmt(ci[1])}]" if isinstance(ci, list) and len(ci) == 2 else "")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} GB"


def comparison_rows(report: dict) -> list[list[str]]:
    """Rows of the main table: method, phase, overall metrics, bytes, times."""
    rows = []
    for method, phases in report.get("methods", {}).items():
        for ph in phases:
            o = ph.get("overall", {})
            total = sum(b.get("sent", 0) for b in ph.get("bytes", {}).values())
            rows.append([method, str(ph["phase"]), *(_fmt(o.get(k)) for k in METRIC_KEYS), human_bytes(total),
                         _fmt(ph.get("ready_s"), 1), _fmt(ph.get("compute_s"), 1)])
    return rows


def verified_lines(report: dict) -> list[str]:
    """Per phase, how many of the VGS-ATD `aggregate` entries re-verified (`atd aggregate --verify`)."""
    out = []
    for ph in report.get("methods", {}).get("vgs-atd", []):
        v = ph.get("verified")
        if v:
            out.append(f"VGS-ATD phase {ph['phase']}: {v['verified']}/{v['aggregates']} aggregate entries verified")
    return out


def kept_lines(report: dict) -> list[str]:
    """Per VGS-ATD phase whose nodes had a val split: which model the per-node numbers (and
    forgetting) score — the one `atd classify` uses by default: its own, its raw-pixel ensemble
    or the consortium's — and why (`netsim.vgs_keep`)."""
    out = []
    for ph in report.get("methods", {}).get("vgs-atd", []):
        def kept(what: str) -> list[str]:
            return sorted(n for n, m in ph.get("per_node", {}).items() if isinstance(m, dict) and m.get("model") == what)

        own, raw, rest = kept("own"), kept("raw-pixels"), kept("consortium")
        if own or raw or rest:
            out.append(f"VGS-ATD phase {ph['phase']}: per-node accuracy and forgetting score the model `atd classify` "
                       f"uses by default — its own for {', '.join(own) or 'no node'}, its raw-pixel ensemble for "
                       f"{', '.join(raw) or 'no node'}, the consortium's for "
                       f"{', '.join(rest) or 'no node'}; overall scores every node's consortium model")
            out += [f"VGS-ATD phase {ph['phase']}: {n}" for n in ph.get("notes", [])
                    if " keeps its own model: " in n or " keeps its raw-pixel ensemble: " in n]
    return out


def robust_lines(report: dict) -> list[str]:
    """Per phase of each adversarially trained method (fat-*): clean and PGD accuracy on the pooled test set."""
    out = []
    for method, phases in report.get("methods", {}).items():
        for ph in phases:
            o = ph.get("overall", {})
            if "robust_accuracy" in o:
                out.append(f"{method} phase {ph['phase']}: clean accuracy {_fmt(o.get('clean_accuracy'))}, "
                           f"robust (PGD) accuracy {_fmt(o['robust_accuracy'])}")
    return out


COMPARISON_HEADER = ["method", "phase", "accuracy", "balanced acc.", "AUROC", "precision", "sensitivity", "F1", "bytes sent", "ready (s)",
                     "compute (s)"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def markdown(report: dict) -> str:
    s = report.get("scenario", {})
    parts = [f"# netsim report: {s.get('name', '?')}\n", f"{s.get('description', '')}\n".lstrip("\n"),
             f"Back-end: **{report.get('backend', '?')}**, seed {s.get('seed')}, "
             f"{len(report.get('nodes', {}))} nodes.\n"]
    for note in report.get("notes", []):
        parts.append(f"> {note}\n")
    if report.get("methods"):
        parts.append("\n## Comparison (overall = mean over nodes, on the phase's pooled test set)\n\n")
        parts.append(_table(COMPARISON_HEADER, comparison_rows(report)))
        parts += [f"\n{line}.\n" for line in verified_lines(report) + kept_lines(report) + robust_lines(report)]
        if report.get("feature_verdicts"):
            parts.append("\n## Do the learned features earn their place?\n\n")
            if report.get("headline"):
                parts.append(f"**{report['headline']}.**\n\n")
            parts += [f"- {line}.\n" for line in report["feature_verdicts"]]
        if report.get("base_comparison"):  # `atd netsim run --base msd,scratch`
            parts.append("\n## Accuracy per phase by base (scratch: random init; msd: the nodes' MSD base)\n\n")
            cols = [k for k in report["base_comparison"][0] if k != "phase"]
            parts.append(_table(["phase", *cols], [[str(r["phase"]), *(_fmt(r[c]) for c in cols)]
                                                   for r in report["base_comparison"]]))
        parts.append("\n## Forgetting: phase-1 nodes' accuracy on their own test data after each phase\n\n")
        phases = sorted({ph["phase"] for v in report["methods"].values() for ph in v})
        rows = [[m, *(_fmt(report.get("forgetting", {}).get(m, {}).get(str(p))) for p in phases)]
                for m in report["methods"]]
        parts.append(_table(["method", *(f"after phase {p}" for p in phases)], rows))
        parts.append("\n## Per node (accuracy on own test data, bytes sent / received in the phase)\n\n")
        rows = []
        for method, phs in report["methods"].items():
            for ph in phs:
                for node, m in sorted(ph.get("per_node", {}).items()):
                    b = ph.get("bytes", {}).get(node, {})
                    rows.append([method, str(ph["phase"]), node, _ci(m, "accuracy"), _ci(m, "balanced_accuracy"),
                                 _ci(m, "auroc"), _fmt(m.get("f1")),
                                 human_bytes(b.get("sent", 0)), human_bytes(b.get("received", 0)),
                                 ph.get("outcomes", {}).get(node, m.get("status", ""))])
        parts.append(_table(["method", "phase", "node", "accuracy [95 % CI]", "balanced acc. [95 % CI]",
                             "AUROC [95 % CI]", "F1", "sent",
                             "received", "ended with"], rows))
    if report.get("plan"):
        parts.append(plan_markdown(report["plan"]))
    if report.get("gossip"):
        parts.append(gossip_markdown(report["gossip"]))
    if report.get("vgs_faults"):
        parts.append("\n## Faults during the VGS-ATD run\n\n")
        parts.append(_table(["phase", "kind", "target", "status", "detail"],
                            [[str(f.get("phase")), f["kind"], f["target"], f["status"], f.get("detail", "")]
                             for f in report["vgs_faults"]]))
    return "".join(parts)


def plan_lines(plan: dict) -> list[list[str]]:
    """Per step and member of a plan run (`netsim.plan`): step, kind, member, state, accuracy,
    seconds, and the reason or who it went on without."""
    return [[r["step"], r["kind"], r["member"], r["state"], _fmt((r.get("metrics") or {}).get("accuracy")),
             _fmt(r.get("seconds"), 2),
             r.get("reason") or (f"without {', '.join(r['missing'])}" if r.get("missing") else "")]
            for r in plan["steps"]]


def plan_markdown(plan: dict) -> str:
    head = (f"\n## Plan {plan['name']!r} ({plan['id'][:12]}, proposed by {plan['proposer']}): "
            f"{'every member finished' if plan.get('complete') else 'not finished'}\n\n")
    return head + _table(["step", "kind", "member", "state", "accuracy", "seconds", ""], plan_lines(plan))


def gossip_markdown(g: dict) -> str:
    parts = ["\n## Gossip workload\n\n",
             f"{g['entries']} entries published; converged: **{g['converged']}**; "
             f"time to converge: {_fmt(g.get('time_to_converge_s'), 2)} s.\n\n"]
    if g.get("faults"):
        parts.append(_table(["at (s)", "kind", "target", "status", "detail"],
                            [[_fmt(f.get("at_s"), 2), f["kind"], f["target"], f["status"], f.get("detail", "")]
                             for f in g["faults"]]))
        parts.append("\n")
    rows = [[n, d["status"], f"{d['held']}/{d['expected']}", _fmt(d.get("complete_at_s"), 2),
             human_bytes(d["bytes"].get("sent", 0)), human_bytes(d["bytes"].get("received", 0))]
            for n, d in g["nodes"].items()]
    parts.append(_table(["node", "status", "entries held", "complete at (s)", "sent", "received"], rows))
    for n in g.get("notes", []):
        parts.append(f"\n> {n}\n")
    return "".join(parts)


# ------------------------------------------------------------------ plots

def plots(report: dict, out: Path) -> dict[str, Path]:
    from atdnode.plots import pyplot, save_png as _save

    plt = pyplot()

    methods = report["methods"]
    phases = sorted({ph["phase"] for v in methods.values() for ph in v})
    paths = {}

    fig, ax = plt.subplots(figsize=(8.5, 4), dpi=100)
    width = 0.8 / max(1, len(methods))
    for i, (m, phs) in enumerate(methods.items()):
        acc = {ph["phase"]: ph.get("overall", {}).get("accuracy", 0.0) for ph in phs}
        ax.bar([p + i * width - 0.4 + width / 2 for p in phases], [acc.get(p, 0.0) for p in phases], width, label=m)
    ax.set_xticks(phases, [f"phase {p}" for p in phases])
    ax.set_ylabel("overall accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("Accuracy per method per phase")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths["accuracy_png"] = _save(fig, out / "accuracy.png")

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    totals = [sum(sum(b.get("sent", 0) for b in ph.get("bytes", {}).values()) for ph in phs) for phs in methods.values()]
    ax.bar(list(methods), totals, color="tab:orange")
    ax.set_ylabel("bytes sent (all nodes, all phases)")
    ax.set_yscale("symlog")
    ax.set_title("Communication per method")
    paths["bytes_png"] = _save(fig, out / "bytes.png")

    fig, ax = plt.subplots(figsize=(8.5, 4), dpi=100)
    for m, by_phase in report.get("forgetting", {}).items():
        xs = [p for p in phases if by_phase.get(str(p)) is not None]
        ax.plot(xs, [by_phase[str(p)] for p in xs], marker="o", label=m)
    ax.set_xticks(phases, [f"after phase {p}" for p in phases])
    ax.set_ylabel("phase-1 nodes' accuracy (own test data)")
    ax.set_ylim(0, 1)
    ax.set_title("Forgetting")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths["forgetting_png"] = _save(fig, out / "forgetting.png")
    return paths


def forgetting(methods: dict[str, list[dict]], phase1_nodes: list[str]) -> dict[str, dict[str, float | None]]:
    """Mean own-test accuracy of the phase-1 nodes after each phase, per method."""
    out: dict[str, dict[str, float | None]] = {}
    for m, phs in methods.items():
        out[m] = {}
        for ph in phs:
            accs = [ph["per_node"][n]["accuracy"] for n in phase1_nodes
                    if isinstance(ph.get("per_node", {}).get(n), dict) and "accuracy" in ph["per_node"][n]]
            out[m][str(ph["phase"])] = round(sum(accs) / len(accs), 6) if accs else None
    return out
