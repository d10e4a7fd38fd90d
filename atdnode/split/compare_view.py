"""`atd split compare`'s methods, and its report shown: a plain-text table with the orderings, and a PNG.

The report itself (a JSON-able dict) is made by `atdnode.split.compare`; this module only
reads it. The methods are named here, where loading them costs no torch (`atd split compare
--method` lists them in its help).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

METHODS = ("festa", "pfesta", "festa_single", "pfesta_single", "pfesta_learnable_head", "pfesta_no_pos_embed",
           "central", "fl", "sl")


def render(report: dict[str, Any]) -> str:
    """A plain-text table of the report (kB = 1000 bytes) and the orderings."""
    tasks = [t["name"] for t in report["tasks"]]
    head = ["method"] + [f"{t} acc" for t in tasks] + ["bytes/client kB", "formula", "formula kB", "err %"]
    lines = [head]
    for name, r in report["methods"].items():
        b = r["bytes_per_client"]
        lines.append([name] + [f"{r['accuracy'][t]['mean']:.3f}±{r['accuracy'][t]['std']:.3f}" for t in tasks]
                     + [f"{b['measured'] / 1000:,.1f}", b["formula_name"] or "-",
                        "-" if b["formula"] is None else f"{b['formula'] / 1000:,.1f}",
                        "-" if b["rel_error"] is None else f"{100 * b['rel_error']:.2f}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text.append(f"FESTA head: {report['setting'].get('festa_head', 'vit')} (p-FESTA: fixed patch embedder)")
    text.append("")
    for kind, accs in (report.get("references") or {}).items():  # what the learned bodies must beat
        text.append(f"{kind} (same data, no learned features): "
                    + ", ".join(f"{t} {accs[t]:.3f}" for t in tasks if t in accs))
    for o in report["orderings"]:
        mark = {True: "holds", False: "does NOT hold", None: "not run"}[o["holds"]]
        text.append(f"{o['claim']}: {mark}")
    if "msd_cost" in report:
        text += ["", msd_cost_line(report["msd_cost"])]
    return "\n".join(text)


def msd_cost_line(c: dict[str, Any]) -> str:
    """T_MSD (Eq. 9), T_FL-SSL (Eq. 8) and their ratio per client, measured and by formula."""
    def kb(v: float | None) -> str:
        return "-" if v is None else f"{v / 1000:,.1f} kB"

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    return (f"MSD vs federated SSL per client: measured T_MSD {kb(c['measured_T_MSD'])}, "
            f"T_FL-SSL {kb(c['measured_T_FL_SSL'])}, ratio {ratio(c['measured_ratio'])}; "
            f"formula T_MSD (Eq. 9) {kb(c['T_MSD'])}, T_FL-SSL (Eq. 8) {kb(c['T_FL_SSL'])}, "
            f"ratio {ratio(c['ratio'])} (MSD Table VII: about 0.25)")


def write_png(report: dict[str, Any], path: str | Path) -> Path:
    """Accuracy per method and task (mean, std over seeds) and bytes per client (log scale)."""
    from atdnode.plots import png_figure

    names = list(report["methods"])
    tasks = [t["name"] for t in report["tasks"]]
    with png_figure(path, ncols=2, figsize=(12, 4.5), dpi=100) as (fig, (ax1, ax2)):
        width = 0.8 / len(tasks)
        for i, t in enumerate(tasks):
            mean = [report["methods"][n]["accuracy"][t]["mean"] for n in names]
            std = [report["methods"][n]["accuracy"][t]["std"] for n in names]
            ax1.bar([k + i * width for k in range(len(names))], mean, width, yerr=std, label=t, capsize=2)
            ax1.axhline(report["majority"][t], ls=":", lw=0.8, color=f"C{i}")
        ax1.set_xticks([k + 0.4 - width / 2 for k in range(len(names))], names, rotation=45, ha="right")
        ax1.set_ylabel("test accuracy (dotted: majority class)")
        ax1.legend()
        ax2.bar(names, [max(1.0, report["methods"][n]["bytes_per_client"]["measured"]) for n in names])
        ax2.set_yscale("log")
        ax2.set_ylabel("training bytes per client")
        ax2.tick_params(axis="x", rotation=45)
        for lab in ax2.get_xticklabels():
            lab.set_ha("right")
    return Path(path)

