"""`atd share-features`: seal this node's CLS features to named peers and record it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from atdnode.learning import apply_device
from cli.options import DEVICE_OPT, HOME_OPT, node_home


def share_features(
    home: Path = HOME_OPT,
    to: List[str] = typer.Option(..., "--to", help="Recipient peer id or unique prefix / suffix (repeatable or comma-separated); its `hello` must announce an X25519 key."),
    data: Optional[str] = typer.Option(None, "--data", help="Data spec of the images to describe (default: the model's training data)."),
    model: str = typer.Option("latest", "--model", help="Model whose extractor makes the features (id, prefix or `latest`)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    device: Optional[str] = DEVICE_OPT,
) -> None:
    """Publish CLS features (with labels) of this node's data, encrypted so that only the
    named peers can read them (X25519 + ChaCha20-Poly1305).

    The signed `features` entry records the recipients, shape, classes and the extractor
    that made the features; the daemon serves the envelope and only recipients fetch it.
    Peers use them in `atd aggregate --mode vertical` when they fused the same extractor.
    """
    from atdnode.aggregation import share_features as do_share

    from atdnode.node import resolve_peer

    h = node_home(home)
    apply_device(device, h)  # checked before anything loads; every step of the command uses it
    peers = [resolve_peer(h, p.strip()) for item in to for p in item.split(",") if p.strip()]
    res = do_share(h, to=peers, data_spec=data, model=model)
    if as_json:
        typer.echo(json.dumps({"entry": res.entry.id.hex(), "blob": res.blob, "size": res.size,
                               "recipients": res.recipients, "shape": res.shape}))
    else:
        typer.echo(f"shared {res.shape[0]} x {res.shape[1]} features sealed to {len(res.recipients)} peer(s) "
                   f"as entry {res.entry.id.hex()} (blob {res.blob}, {res.size} bytes)")


def register(app: typer.Typer) -> None:
    app.command("share-features")(share_features)
