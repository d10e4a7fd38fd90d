"""`atd demo`: the VGS-ATD three phases with real node daemons, end to end, in a few minutes."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from netsim.scenario_choices import Backend

HELP = """Run a small VGS-ATD scenario end to end and print how it compares.

Four hospitals learn on embedded jittered digits (no download), each starting from a shared public model W_p that a designated client pretrained on OTHER digit classes (shipped with atd, its SHA-256 checked): two with the same classes learn horizontally, one with new classes joins vertically (sealed CLS features, one ensemble over all classes), and a second group joins hierarchically. Each node is a real `atd node start` daemon on 127.0.0.1 (signed ledger over libp2p gossip, weights and features as blobs). The same partitions are then used for centralized and local-only training, and the same ensemble is fitted on raw pixels and on W_p's own features; the table and a headline (do the learned features beat raw pixels and the start alone, by how many points) are printed. About 95 s of CPU (about 90 s on 2 cores); the full report (JSON, Markdown, PNG plots) goes to --out.

Use --backend memory to run the daemons in one process on a simulated network instead, and --quick for the smoke scenario (seven daemons on the 8 px digits, where raw pixels win).
"""


def register(app: typer.Typer) -> None:
    app.command("demo", help=HELP)(demo_cmd)


def demo_cmd(
    out: Path = typer.Option(Path("atd-demo"), "--out", help="Directory for report.json, report.md and the PNG plots."),
    backend: Optional[Backend] = typer.Option(None, "--backend", help="process: real daemons (default); memory: one process, a simulated network."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Scenario seed (default 0)."),
    threads: int = typer.Option(0, "--threads", min=0, help="torch CPU threads (0: one, fastest for these tiny models)."),
    quick: bool = typer.Option(False, "--quick", help="The smoke scenario instead: seven daemons on the 8 px digits "
                                                      "(netsim/scenarios/demo_quick.toml), from scratch."),
) -> None:
    from cli.commands.netsim_cmd import _threads, print_summary, run_with_progress
    from netsim.scenario import load_scenario, shipped_scenario, validate

    scn = load_scenario(shipped_scenario("demo_quick" if quick else "demo"))
    changes = {k: v for k, v in {"backend": backend, "seed": seed}.items() if v is not None}
    if changes:
        scn = scn.replace(**changes)
        validate(scn)
    _threads(threads)
    typer.echo(daemons_line(scn), err=True)
    report = run_with_progress(scn, out)
    print_summary(report, out)


def daemons_line(scn) -> str:
    """What the demo starts, in one line (how many daemons, as processes or in one process)."""
    n = len(scn.node_names())
    if scn.backend == "memory":
        return (f"atd demo: {n} hospital nodes as daemons in this one process on a simulated network "
                f"(--backend process: {n} real `atd node start` processes)")
    return (f"atd demo: starting {n} hospital nodes, each a real `atd node start` daemon ({n} OS processes on "
            f"127.0.0.1, stopped at the end); --backend memory runs them in this one process instead")
