"""`atd config show|set`: read and change HOME/config.toml without an editor (containers)."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from atdnode.node import NodeHome
from cli.options import HOME_OPT

config_app = typer.Typer(help="Show and set the node's settings (config.toml), validated.", no_args_is_help=True)


@config_app.command("show")
def show(
    home: Path = HOME_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print {key: value} as JSON."),
) -> None:
    """Every setting `atd config set` knows, with its value here (or its default, marked)."""
    from atdnode.node import KEYS, NodeConfig

    data = NodeConfig.load(NodeHome.at(home).require()).to_dict()
    out = {}
    for k in KEYS:
        table, _, name = k.path.rpartition(".")
        have = data.get(table, {}) if table else data
        out[k.path] = (have[name], False) if isinstance(have, dict) and name in have else (k.default, True)
    if as_json:
        typer.echo(json.dumps({p: v for p, (v, _) in out.items()}, indent=2))
        return
    for k in KEYS:
        v, default = out[k.path]
        typer.echo(f"{k.path} = {json.dumps(v)}" + ("    (default)" if default else "") + f"    # {k.doc} ({k.rule()})")


# a VALUE such as -3 is a value, not an option: the setting's own check refuses it with its name
@config_app.command("set", context_settings={"ignore_unknown_options": True})
def set_cmd(
    key: str = typer.Argument(..., help="Setting, e.g. listen, bootstrap, logs.max_bytes, peers.target, bulk.port "
                                        "(`atd config show` lists them)."),
    value: str = typer.Argument(..., help="New value; lists as a,b or a JSON list; booleans true/false."),
    home: Path = HOME_OPT,
) -> None:
    """Set one setting in config.toml, checked by the part of atd that reads it (a bad value
    changes nothing). A running daemon reads it at its next start."""
    from atdnode.node import set_key

    v = set_key(NodeHome.at(home).require(), key, value)
    typer.echo(f"{key} = {json.dumps(v)}")


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
