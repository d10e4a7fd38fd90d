"""`atd models`: list the node's locally trained models."""
from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from atdnode.home import NodeHome


def register(app: typer.Typer) -> None:
    app.command("models")(models_cmd)


def models_cmd(
    home: Path = typer.Option(..., "--home", help="Node home directory (made by `atd init`)."),
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
    from rich.console import Console
    from rich.table import Table

    t = Table("id", "created", "model", "img/patch/dim/depth", "classes", "samples", "acc", "f1", "init from")
    for r in recs:
        m, c = r.metrics, r.model
        t.add_row(r.id, time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created)), c["name"],
                  f"{c['img_size']}/{c['patch_size']}/{c['embed_dim']}/{c['depth']}",
                  _classes(r.labels), str(r.samples), f"{m.get('accuracy', 0):.3f}", f"{m.get('f1', 0):.3f}",
                  (r.provenance.get("init_from") or "-")[:12])
    Console().print(t)


def _classes(labels: list[str]) -> str:
    s = ",".join(labels)
    return s if len(s) <= 24 else f"{len(labels)}: {s[:20]}…"
