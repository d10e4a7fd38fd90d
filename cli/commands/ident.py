"""`atd id`: print this node's peer id (or, with --json, its public keys too)."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from cli.options import HOME_OPT, node_home


def ident(
    home: Path = HOME_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print peer id, Ed25519 and X25519 public keys as JSON."),
) -> None:
    """Print the node's libp2p peer id (derived from its Ed25519 ledger key)."""
    from atdnode.node import NodeIdentity

    i = NodeIdentity.load(node_home(home))
    if as_json:
        typer.echo(json.dumps({"peer_id": i.peer_id, "ed25519": i.public_key.hex(), "x25519": i.x25519_public.hex()}))
    else:
        typer.echo(i.peer_id)


def register(app: typer.Typer) -> None:
    app.command("id")(ident)
