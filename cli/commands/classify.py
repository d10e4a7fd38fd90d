"""`atd classify`: score the node's model (or ensemble) on a data spec."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from atdnode.home import NodeHome


def classify(
    home: Path = typer.Option(..., "--home", help="Node home directory."),
    data: str = typer.Option(..., "--data", help="Data spec, e.g. `digits` or `npz:PATH?classes=a,b` (see `atd train --help`)."),
    model: str = typer.Option("latest", "--model", help="Model id (or unique prefix) from `atd models`, or `latest`."),
    split: str = typer.Option("test", "--split", help="test | train."),
    out: Optional[Path] = typer.Option(None, "--out", help="Confusion-matrix PNG path (default: HOME/classify/MODEL-SPEC.png)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Predict with the node's global model or ensemble and report accuracy, precision,
    sensitivity and F1 (macro over the data's classes); writes a confusion-matrix PNG.

    A model from vertical or hierarchical aggregation predicts with its ensemble over the
    union of the shared label spaces; others with their own head. Samples of classes the
    model does not know count as errors.
    """
    from atdnode.classify import classify as run

    res = run(NodeHome.at(home).require(), data, model=model, split=split, out=out)
    if as_json:
        typer.echo(json.dumps(res.to_json()))
        return
    m = res.metrics
    typer.echo(f"model {res.model_id} ({res.kind}) on {data} [{split}], n={m['n']}")
    typer.echo(f"  accuracy {m['accuracy']:.4f}  precision {m['precision']:.4f}  "
               f"sensitivity {m['sensitivity']:.4f}  f1 {m['f1']:.4f}")
    if res.unknown_classes:
        typer.echo(f"  classes the model does not know: {', '.join(res.unknown_classes)}")
    typer.echo(f"  confusion matrix {res.png}")


def register(app: typer.Typer) -> None:
    app.command("classify")(classify)
