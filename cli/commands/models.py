"""`atd models`: list the node's locally trained models."""
from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from atdnode.home import NodeHome
from cli.options import HOME_OPT


def register(app: typer.Typer) -> None:
    app.command("models")(models_cmd)


def models_cmd(
    home: Path = HOME_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print the full records as a JSON list."),
) -> None:
    """List the models in this node's registry (config, label space, samples, test metrics, blobs)."""
    from atdnode.registry import ModelRegistry

    h = NodeHome.at(home).require()
    recs = ModelRegistry(h).list()
    if as_json:
        typer.echo(json.dumps([r.to_dict() for r in recs], indent=2, sort_keys=True))
        return
    if not recs:
        typer.echo("no models yet (run `atd train`)")
        return
    typer.echo(f"{'id':16}  {'created':16}  {'model':24} {'img/patch/dim/depth':19} {'classes':24} "
               f"{'samples':>7} {'acc':>6} {'f1':>6}  init from")
    for r in recs:
        m, c = r.metrics, r.model
        arch = f"{c['img_size']}/{c['patch_size']}/{c['embed_dim']}/{c['depth']}"
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created))
        typer.echo(f"{r.id:16}  {created:16}  {c['name']:24} {arch:19} {_classes(r.labels):24} {r.samples:>7} "
                   f"{m.get('accuracy', 0):>6.3f} {m.get('f1', 0):>6.3f}  {(r.provenance.get('init_from') or '-')[:12]}")


def _classes(labels: list[str]) -> str:
    s = ",".join(labels)
    return s if len(s) <= 24 else f"{len(labels)}: {s[:20]}…"
