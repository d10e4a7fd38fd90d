"""`atd init`: create a node home (keys, config, ledger) and print the node's peer id."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from atdnode.errors import ConfigError
from atdnode.node import NodeHome
from cli.options import home_option


def init(
    home: Path = home_option("Directory for the new node (created; must not hold a node)."),
    name: Optional[str] = typer.Option(None, "--name", help="Human-readable node name (default: the directory name)."),
    genesis: bool = typer.Option(False, "--genesis", help="Found a new consortium: sign its genesis entry."),
    consortium: Optional[str] = typer.Option(None, "--consortium", help="Name of the consortium to found (with --genesis)."),
    join: Optional[str] = typer.Option(None, "--join", help="Hex id of the genesis entry of the consortium to join."),
) -> None:
    """Create a node home: Ed25519 + X25519 keys (0600), config.toml, ledger.db, blob store.

    Prints the node's peer id (the libp2p id of its Ed25519 key) on stdout.
    """
    from atdnode.node import init_home

    if genesis and not consortium:
        raise ConfigError("--genesis needs --consortium NAME")
    if consortium and not genesis:
        raise ConfigError("--consortium only goes with --genesis")
    h = NodeHome.at(home)
    ident = init_home(h, name=name, consortium=consortium if genesis else None, join=join)
    if genesis:
        what = f"founded consortium {consortium!r}"
    elif join:
        what = f"pinned to consortium genesis {join.strip()}"
    else:
        what = "not in a consortium yet"
    typer.echo(f"initialised node at {h.root} ({what})", err=True)
    typer.echo(ident.peer_id)


def register(app: typer.Typer) -> None:
    app.command("init")(init)
