"""The `atd` command line: wiring only.

Each module in `cli/commands/` exposes `register(app: typer.Typer) -> None` and is
discovered here, so commands live in their own modules and nobody edits a central list.
Errors derived from `AtdError` (or any `LedgerError`) print as one line on stderr and
exit non-zero; they never show a traceback.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

import typer

from cli import commands
from atdnode.errors import AtdError

app = typer.Typer(
    name="atd",
    help="atd: peer-to-peer learning daemon for hospitals (signed ledger, one-time ViT aggregation).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_all() -> None:
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"cli.commands.{mod.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


_register_all()


def main() -> None:
    """Console-script entry point: turn known errors into one clear line + exit code."""
    from ledger.errors import LedgerError

    try:
        rc = app(standalone_mode=False)
        if isinstance(rc, int) and rc != 0:  # e.g. 130 after Ctrl-C in non-standalone mode
            sys.exit(rc)
    except (AtdError, LedgerError) as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(getattr(exc, "exit_code", 1))
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # click usage errors and friends
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, OSError):
            typer.echo(f"error: {exc}", err=True)
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
