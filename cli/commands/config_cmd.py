"""`atd config show|set`: read and change HOME/config.toml without an editor (containers)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import typer
from typer.core import TyperCommand

from cli.options import HOME_OPT, node_home

config_app = typer.Typer(help="Show and set the node's settings (config.toml), validated.", no_args_is_help=True)


@config_app.command("show")
def show(
    home: Path = HOME_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print {key: value} as JSON."),
) -> None:
    """Every setting `atd config set` knows, with its value here (or its default, marked)."""
    from atdnode.node import KEYS, NodeConfig

    data = NodeConfig.load(node_home(home)).to_dict()
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


class _NegativeNumbersAreValues(TyperCommand):
    """`atd config set peers.target -3`: a token that reads as a negative number is a VALUE
    (the key's declaration then refuses it, naming the key), not an unknown option."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        numbers = [a for a in args if re.fullmatch(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", a)]
        rest = [a for a in args if a not in numbers]
        return super().parse_args(ctx, [*rest, "--", *numbers] if numbers and "--" not in rest else args)


@config_app.command("set", cls=_NegativeNumbersAreValues)
def set_cmd(
    key: str = typer.Argument(..., help="Setting, e.g. listen, bootstrap, logs.max_bytes, peers.target, bulk.port "
                                        "(`atd config show` lists them)."),
    value: str = typer.Argument(..., help="New value; lists as a,b or a JSON list; booleans true/false."),
    home: Path = HOME_OPT,
) -> None:
    """Set one setting in config.toml, checked by the part of atd that reads it (a bad value
    changes nothing). A running daemon reads it at its next start."""
    from atdnode.node import set_key

    v = set_key(node_home(home), key, value)
    typer.echo(f"{key} = {json.dumps(v)}")


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
