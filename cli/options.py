"""Options shared by every `atd` command.

`HOME_OPT` is the one `--home` option: when it is absent the home comes from the
ATD_HOME environment variable, so `export ATD_HOME=/srv/atd/node1` once is enough.
Every command taking a node home uses it (`test_cli_errors` checks that), e.g.

    def cmd(home: Path = HOME_OPT) -> None: ...
"""
from __future__ import annotations

import typer

HOME_ENV = "ATD_HOME"

HOME_HELP = "Node home directory (made by `atd init`)."

HOME_OPT = typer.Option(..., "--home", envvar=HOME_ENV, show_envvar=True, help=HOME_HELP)


def home_option(help: str = HOME_HELP) -> typer.models.OptionInfo:
    """The shared --home option with a command-specific help text (same flag, same env var)."""
    return typer.Option(..., "--home", envvar=HOME_ENV, show_envvar=True, help=help)

DEVICE_HELP = ("Device that runs the model: cpu, cuda or cuda:N (default: [compute] device in "
               "config.toml, else cuda when present).")

DEVICE_OPT = typer.Option(None, "--device", help=DEVICE_HELP)
