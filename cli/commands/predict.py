"""`atd predict`: the node's model on new, unlabelled images -> one CSV row per image."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from atdnode.node import sklearn_warnings_to_log
from cli.options import DEVICE_OPT, HOME_OPT, node_home

HELP = """Predict a class for every image of unlabelled folders or files; write one CSV row per image.

DATA (repeatable) is `folder:DIR` (PNG / JPEG / TIFF / BMP below DIR; no class sub-folders needed), `dicom:DIR` (DICOM files below DIR) or single image / DICOM files, with the options that concern pixels: `?window=lo,hi|auto|minmax` and `?frame=K`. Images are read and scaled exactly as for training (8-bit fixed, 16-bit min-max, the DICOM header's window), resized to the model's input; an input without `window=` gets the window the model was trained with, if any.

The CSV has a header and one row per image: file, predicted class, its probability, the probability of every class the model knows (p:CLASS, summing to 1), and the model id. A model from vertical or hierarchical aggregation predicts with its ensemble, others with their head, as `atd classify` does. Unreadable files are skipped and listed on stderr.
"""


def register(app: typer.Typer) -> None:
    app.command("predict", help=HELP)(predict_cmd)


def predict_cmd(
    home: Path = HOME_OPT,
    data: List[str] = typer.Option(..., "--data", help="folder:DIR | dicom:DIR | FILE (repeatable)."),
    out: Path = typer.Option(Path("predictions.csv"), "--out", help="CSV file to write."),
    model: Optional[str] = typer.Option(None, "--model", help="Model id (or unique prefix) from `atd models`, or "
                                        "`latest` (default: the model `atd classify` uses)."),
    device: Optional[str] = DEVICE_OPT,
    batch_size: int = typer.Option(256, "--batch-size", min=1, help="Images per forward pass."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary instead of text."),
) -> None:
    from contextlib import ExitStack

    from atdnode import progress
    from atdnode.learning import run_predict as predict
    from cli.progress import bars

    h = node_home(home)
    sklearn_warnings_to_log(h)
    with bars(quiet=as_json), ExitStack() as stack:
        tasks: dict[str, progress.Task] = {}

        def show(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = stack.enter_context(progress.task(stage, total=total))
            tasks[stage].update(done, total)

        res = predict(h, list(data), model=model, out=out, device=device, batch_size=batch_size, progress=show)
    if as_json:
        typer.echo(json.dumps(res.to_json()))
        return
    counts = ", ".join(f"{c} {n}" for c, n in res.to_json()["counts"].items())
    typer.echo(f"model {res.model_id} ({res.kind}) on {len(res.files)} image(s), {res.device}: {counts}")
    typer.echo(f"  scaling: {', '.join(f'{how} x{n}' for how, n in res.scaling.items())}")
    typer.echo(f"  predictions {res.out}")
    if res.skipped:
        named = "; ".join(f"{f}: {why}" for f, why in res.skipped[:3])
        more = f"; +{len(res.skipped) - 3} more" if len(res.skipped) > 3 else ""
        typer.echo(f"skipped {len(res.skipped)} file(s): {named}{more}", err=True)
