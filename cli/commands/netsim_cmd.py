"""`atd netsim run SCENARIO [--out DIR]`, `atd netsim list`: many nodes on one machine."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import List, Optional

import typer

from cli.options import DEVICE_OPT
from netsim.scenario_choices import Backend, Method

netsim_app = typer.Typer(help="Run many nodes on this machine: scenarios, faults, VGS-ATD against baselines.",
                         no_args_is_help=True)

RUN_HELP = """Run a scenario and write report.json, report.md and PNG plots into --out.

SCENARIO is a TOML file or the name of a shipped scenario (`atd netsim list`). The scenario names the nodes and their data partitions, the VGS-ATD phases, the methods to compare (vgs-atd, centralized, fedavg, swarm, local; fat-fedavg, fat-fedwavg: adversarial `atd rounds`), the network conditions, faults and an optional gossip workload.

With a plan (`[scenario] plan = "FILE"` and method "plan", or --plan FILE) the nodes carry out that plan file with the functions `atd plan` calls, and the report shows each member's state per step and the evaluation of each node's resulting model.

Back-ends: `memory` runs real node daemons in one process on a simulated network (latency, bandwidth, loss, partitions; seeded, reproducible); `process` runs `atd node start` daemons as OS processes on 127.0.0.1 (optionally in network namespaces with tc netem where the machine allows it).
"""


def register(app: typer.Typer) -> None:
    app.add_typer(netsim_app, name="netsim")


def resolve_scenario(ref: str):
    """A path, or the name of a shipped scenario."""
    from netsim.scenario import load_scenario, shipped_scenario

    p = Path(ref).expanduser()
    if p.is_file() or p.suffix == ".toml" or os.sep in ref:
        return load_scenario(p)
    return load_scenario(shipped_scenario(ref))


@netsim_app.command("run", help=RUN_HELP)
def run_cmd(
    scenario: str = typer.Argument(..., help="Scenario TOML file, or a shipped scenario name."),
    out: Path = typer.Option(Path("netsim-out"), "--out", help="Directory for report.json, report.md, PNGs."),
    backend: Optional[Backend] = typer.Option(None, "--backend", help="Override the scenario's back-end."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Override the scenario's seed."),
    methods: Optional[List[Method]] = typer.Option(None, "--method", help="Only these methods (repeatable)."),
    keep_homes: Optional[Path] = typer.Option(None, "--keep-homes", help="Keep the node homes under this directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of tables."),
    threads: int = typer.Option(0, "--threads", min=0, help="torch CPU threads (0: one, fastest for these tiny models)."),
    base: Optional[str] = typer.Option(None, "--base", help="Where VGS-ATD starts: scratch | msd (a base the nodes "
                                       "build first by masked sampling distillation) | public (W_p, the scenario's [public] "
                                       "pool) | msd,scratch (both, side by side)."),
    plan: Optional[Path] = typer.Option(None, "--plan", help="Carry out this plan file (`atd plan`'s TOML) on the "
                                        "scenario's nodes as method \"plan\" (the plan names members by node "
                                        "name); without --method, the only method run."),
    device: Optional[str] = DEVICE_OPT,
) -> None:
    from atdnode.learning import apply_device
    from netsim.scenario import validate

    apply_device(device)  # checked first; the nodes it starts inherit it ($ATD_DEVICE)
    scn = resolve_scenario(scenario)
    bases = tuple(b.strip() for b in base.split(",")) if base else ()
    for b in bases:
        validate(scn.replace(base=b))
    changes = {}
    if backend is not None:
        changes["backend"] = backend
    if seed is not None:
        changes["seed"] = seed
    if methods:
        changes["methods"] = tuple(methods)
    if plan is not None:
        changes["plan"] = str(plan.expanduser().resolve())
        changes["methods"] = tuple(dict.fromkeys([*(methods or []), "plan"]))
    if changes:
        scn = scn.replace(**changes)
        validate(scn)
    _threads(threads)
    report = run_with_progress(scn, out, keep_homes=keep_homes, quiet=as_json, bases=bases)
    if as_json:
        typer.echo(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print_summary(report, out)


@netsim_app.command("list", help="List the scenarios shipped with atd.")
def list_cmd() -> None:
    from netsim.scenario import load_scenario

    for p in sorted((Path(__import__("netsim").__file__).parent / "scenarios").glob("*.toml")):
        s = load_scenario(p)
        typer.echo(f"{p.stem:14s} {s.description or s.name}  [{p}]")


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n or 1)  # tiny models: one thread is fastest, and immune to a busy machine


def run_with_progress(scn, out: Path | None, *, keep_homes: Path | None = None, quiet: bool = False,
                      bases: tuple[str, ...] = ()) -> dict:
    """Run with a live status line and a log of steps on stderr."""
    from rich.console import Console

    from netsim.run import run_scenario

    console = Console(stderr=True, log_path=False)  # no source-file column: a step fits one 80-column line
    t0 = time.perf_counter()
    if quiet:
        return run_scenario(scn, out, keep_homes=keep_homes, bases=bases)
    with console.status(f"[bold]{scn.name}[/]: starting", spinner="dots") as status:
        def progress(msg: str) -> None:
            console.log(f"[dim]{time.perf_counter() - t0:6.1f}s[/] {msg}")
            status.update(f"[bold]{scn.name}[/]: {msg}")

        return run_scenario(scn, out, progress=progress, keep_homes=keep_homes, bases=bases)


def print_summary(report: dict, out: Path | None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from netsim.report import COMPARISON_HEADER, comparison_rows, verified_lines

    console = Console()  # 80 columns in a log or pipe: the tables below fit without cutting a number
    if report.get("methods"):
        table = Table(title=f"{report['scenario']['name']} ({report['backend']} back-end)", box=box.SIMPLE,
                      pad_edge=False, collapse_padding=True,
                      caption="overall = mean over nodes on the phase's pooled test set; sent = all nodes, "
                              "this phase; ready / cpu = seconds")
        short = ["method", "ph", "acc", "bal", "auc", None, None, "F1", "sent", "ready", "cpu"]  # None: report.md only
        assert len(short) == len(COMPARISON_HEADER)
        for h in filter(None, short):
            table.add_column(h, justify="left" if h == "method" else "right", no_wrap=True)
        for row in comparison_rows(report):
            table.add_row(*(cell for cell, h in zip(row, short) if h))
        console.print(table)
        for line in verified_lines(report):
            console.print(line)
        forget = report.get("forgetting", {})
        if forget:
            ft = Table(title="Forgetting: phase-1 nodes' accuracy after each phase", box=box.SIMPLE,
                       pad_edge=False, collapse_padding=True)
            phases = sorted({p for v in forget.values() for p in v}, key=int)
            ft.add_column("method")
            for p in phases:
                ft.add_column(f"after phase {p}", justify="right")
            for m, v in forget.items():
                ft.add_row(m, *("—" if v.get(p) is None else f"{v[p]:.3f}" for p in phases))
            console.print(ft)
    if report.get("plan"):
        from netsim.report import plan_lines

        p = report["plan"]
        pt = Table(title=f"plan {p['name']!r} ({'every member finished' if p.get('complete') else 'not finished'})",
                   box=box.SIMPLE, pad_edge=False, collapse_padding=True)
        for h in ("step", "kind", "member", "state", "acc", "s", ""):
            pt.add_column(h, justify="right" if h in ("acc", "s") else "left")
        for row in plan_lines(p):
            pt.add_row(*row)
        console.print(pt)
    g = report.get("gossip")
    if g:
        done = sum(1 for d in g["nodes"].values() if d["complete"])
        console.print(f"gossip: {g['entries']} entries, {done}/{len(g['nodes'])} nodes hold all they should; "
                      f"converged: {g['converged']}, time {g.get('time_to_converge_s')} s")
        for f in g.get("faults", []):
            console.print(f"  fault {f['kind']} {f['target']} at {f['at_s']} s: {f['status']} {f['detail']}")
    for note in report.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")
    if report.get("headline"):  # the run's claim, last: measured in this run against its own baselines
        from rich.text import Text

        console.print(Text(f"Headline: {report['headline']}.", style="bold"))
    if out is not None:
        console.print(f"report: {Path(out) / 'report.md'} (+ report.json, PNG plots) in {report['wall_s']:.0f} s")
