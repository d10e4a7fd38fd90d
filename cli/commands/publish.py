"""`atd publish-weights`: sign and share part of a trained model."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from atdnode.models import PARTS
from cli.choices import choice
from cli.options import HOME_OPT, node_home

Part = choice("Part", PARTS)


def publish_weights(
    home: Path = HOME_OPT,
    model: str = typer.Option("latest", "--model", help="Model id (or unique prefix) from `atd models`, or `latest`."),
    part: Part = typer.Option("extractor", "--part", help="The weight set to publish (by default the extractor: the head stays private)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Record a signed `weights` entry for a trained model and serve its blob.

    Works without a running daemon: the entry waits in the local ledger and goes out
    when the daemon starts (or at once, if it runs).
    """
    from atdnode.models import publish_weights as do_publish

    pub = do_publish(node_home(home), model=model, part=part)
    if as_json:
        typer.echo(json.dumps({"entry": pub.entry.id.hex(), "blob": pub.blob, "size": pub.size, "part": part}))
    else:
        typer.echo(f"published {part} weights {pub.blob} ({pub.size} bytes) as entry {pub.entry.id.hex()}")


def register(app: typer.Typer) -> None:
    app.command("publish-weights")(publish_weights)
