"""`atd demo`: the VGS-ATD three phases with real node daemons, end to end, in a few minutes."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = """Run a small VGS-ATD scenario end to end and print how it compares.

Seven hospitals learn on the embedded digits (no download): three with the same classes learn horizontally, two with new classes join vertically (sealed CLS features, one ensemble over all classes), and a second group joins hierarchically. Each node is a real `atd node start` daemon on 127.0.0.1 (signed ledger over libp2p gossip, weights and features as blobs). The same partitions are then used for centralized, FedAvg, swarm and local-only training, and the comparison table is printed. Takes a few minutes on 2 CPU cores; the full report (JSON, Markdown, PNG plots) goes to --out.

Use --backend memory to run the daemons in one process on a simulated network instead.
"""


def register(app: typer.Typer) -> None:
    app.command("demo", help=HELP)(demo_cmd)


def demo_cmd(
    out: Path = typer.Option(Path("atd-demo"), "--out", help="Directory for report.json, report.md and the PNG plots."),
    backend: Optional[str] = typer.Option(None, "--backend", help="process (real daemons, default) or memory."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Scenario seed (default 0)."),
    threads: int = typer.Option(0, "--threads", min=0, help="torch CPU threads (0: one, fastest for these tiny models)."),
) -> None:
    from cli.commands.netsim_cmd import _threads, print_summary, run_with_progress
    from netsim.scenario import load_scenario, shipped_scenario, validate

    scn = load_scenario(shipped_scenario("demo"))
    changes = {k: v for k, v in {"backend": backend, "seed": seed}.items() if v is not None}
    if changes:
        scn = scn.replace(**changes)
        validate(scn)
    _threads(threads)
    report = run_with_progress(scn, out)
    print_summary(report, out)
