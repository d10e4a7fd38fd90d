"""`atd base build|publish`: the consortium's own base ViT from a finished MSD campaign."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from atdnode.learning import apply_device
from cli.options import DEVICE_OPT, HOME_OPT, node_home

base_app = typer.Typer(help="A base ViT built inside the consortium by masked sampling distillation (MSD).",
                       no_args_is_help=True)


@base_app.command("build")
def build(
    home: Path = HOME_OPT,
    campaign: str = typer.Option("latest", "--campaign", help="The MSD campaign: its service entry id, its body "
                                 "weights entry id (or a unique prefix), or `latest`."),
    as_json: bool = typer.Option(False, "--json", help="Print the registry record as JSON."),
    device: Optional[str] = DEVICE_OPT,
) -> None:
    """Assemble a timm ViT extractor from the campaign's secret embedder (sealed to this client)
    and its distilled body, and register it as a model. Only a client of the campaign can."""
    from atdnode.split import build_base

    h = node_home(home)
    apply_device(device, h)  # checked before anything loads
    rec = build_base(h, campaign)
    if as_json:
        typer.echo(json.dumps(rec.to_dict(), indent=2, sort_keys=True))
        return
    m = rec.model
    typer.echo(f"model {rec.id}  MSD base of campaign {rec.provenance['campaign'][:12]} "
               f"(body entry {rec.provenance['body_entry'][:12]})")
    typer.echo(f"  extractor {rec.blobs['extractor']}")
    typer.echo(f"  train from it: atd train --init-from {rec.id} --model {m['name']} --img-size {m['img_size']} "
               f"--patch-size {m['patch_size']} --embed-dim {m['embed_dim']} --depth {m['depth']} "
               f"--heads {m['num_heads']} --in-chans {m['in_chans']} --mlp-ratio {m.get('mlp_ratio', 4.0)} --data ...")


@base_app.command("publish")
def publish(
    home: Path = HOME_OPT,
    model: str = typer.Option("latest", "--model", help="The MSD base's model id (or prefix), or `latest`."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Share the MSD base with the campaign's client members only (a signed weights entry whose
    blob readers are the clients; the server never gets it)."""
    from atdnode.split import publish_base

    pub = publish_base(node_home(home), model)
    if as_json:
        typer.echo(json.dumps({"entry": pub.entry.id.hex(), "blob": pub.blob, "readers": pub.readers}))
    else:
        typer.echo(f"published MSD base {pub.blob} as entry {pub.entry.id.hex()} "
                   f"(readable by {len(pub.readers)} other client members)")


def register(app: typer.Typer) -> None:
    app.add_typer(base_app, name="base")
