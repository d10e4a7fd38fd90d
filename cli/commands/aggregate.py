"""`atd aggregate`: one-time aggregation of published weights, recorded on the ledger."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from atdnode.home import NodeHome


def aggregate(
    home: Path = typer.Option(..., "--home", help="Node home directory."),
    mode: str = typer.Option("horizontal", "--mode", help="horizontal | vertical | hierarchical."),
    weighting: str = typer.Option("uniform", "--weighting", help="uniform | samples | sqrt-classes | model-count | fedwavg."),
    inputs: Optional[List[str]] = typer.Option(None, "--inputs", help="Entry ids of the weights entries to combine (default: every compatible one held)."),
    q: float = typer.Option(1.0, "--q", help="FedWAvg softmax scale q."),
    verify: Optional[str] = typer.Option(None, "--verify", help="Recompute this aggregate entry from its inputs and check its result hash."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Combine published weight sets into this node's global model and record how.

    The `aggregate` entry names the input entries, the weighting, the exact weights and
    the result blob, so any peer can recompute and check it with `--verify`.
    """
    from atdnode import aggregate as agg

    h = NodeHome.at(home).require()
    if verify:
        blob = agg.verify_aggregate(h, verify)
        typer.echo(json.dumps({"verified": True, "blob": blob}) if as_json else f"aggregate {verify[:16]} verifies: {blob}")
        return
    if mode != "horizontal":
        from atdnode.errors import ConfigError

        raise ConfigError(f"mode {mode!r} is not available in this build (horizontal is)")
    res = agg.aggregate_horizontal(h, weighting=weighting, inputs=inputs or None, q=q)
    out = {"entry": res.entry.id.hex(), "blob": res.blob, "weights": res.weights, "inputs": res.inputs, "model": res.model_id}
    if as_json:
        typer.echo(json.dumps(out))
    else:
        typer.echo(f"aggregated {len(res.inputs)} weight sets ({weighting}) -> {res.blob}")
        typer.echo(f"entry {out['entry']}; global model {res.model_id}")


def register(app: typer.Typer) -> None:
    app.command("aggregate")(aggregate)
