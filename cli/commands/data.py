"""`atd data inspect SPEC`: what a node would train on, without training (needs no home)."""
from __future__ import annotations

import json
from pathlib import Path

import typer

data_app = typer.Typer(help="Look at a data spec the way `atd train` reads it.", no_args_is_help=True)

HELP = """Print what a node would train on: counts per split and class, native shapes and dtypes, the intensity scaling used and the raw value range, the model input shape, and every skipped file with the reason; write a contact sheet PNG with a few samples per class.

SPEC is `digits`, `npz:PATH`, `folder:PATH`, `dicom:PATH` or `nifti:PATH` with options such as `?classes=FILE.json&window=-1000,400&labels=labels.csv` (see the README's data-spec section).
"""


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")


@data_app.command("inspect", help=HELP)
def inspect_cmd(
    spec: str = typer.Argument(..., help="Data spec, as given to `atd train --data`."),
    img_size: int = typer.Option(64, "--img-size", min=1, help="Model input size to load at."),
    in_chans: int = typer.Option(3, "--in-chans", min=1, max=3, help="Model input channels."),
    out: Path = typer.Option(Path("contact-sheet.png"), "--out", help="Contact sheet PNG (training split)."),
    per_class: int = typer.Option(6, "--per-class", min=1, help="Samples per class on the contact sheet."),
    seed: int = typer.Option(0, "--seed", help="Data seed (80/20 split, shard, subset), as for training."),
    as_json: bool = typer.Option(False, "--json", help="Print the inspection as JSON."),
) -> None:
    from atdnode.data import contact_sheet, inspect_data

    from cli.progress import bars

    with bars(quiet=as_json):
        ins = inspect_data(spec, img_size, in_chans, seed=seed)
    png = contact_sheet(ins.splits["train"], out, per_class=per_class, seed=seed)
    if as_json:
        typer.echo(json.dumps({**ins.to_dict(), "contact_sheet": str(png)}, indent=2))
        return
    for line in ins.lines():
        typer.echo(line)
    typer.echo(f"  contact sheet: {png}")
