"""The `atd` command line: wiring only.

Each module in `cli/commands/` exposes `register(app: typer.Typer) -> None` and is
discovered here, so commands live in their own modules and nobody edits a central list.
Help is plain text (no rich markup, so `[models]` or `'atd[tensorboard]'` survive as
written; flags show no value) and `atd --help` lists the commands in workflow order
(`cli.helpfmt.WorkflowGroup`).
Every failure (usage errors of whichever click typer bundles, `AtdError`/`LedgerError`,
OS errors, errors inside trio ExceptionGroups) prints as one line on stderr and exits
non-zero; none shows a traceback (`cli.failure`).
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
import sys

import typer
import typer.core
import typer.main

from cli import commands
from cli.commands.models import reporting_removals
from cli.helpfmt import WorkflowGroup
from cli.options import closing_nodes

app = typer.Typer(
    name="atd",
    help="atd: peer-to-peer learning daemon for hospitals (signed ledger, one-time ViT aggregation).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # sub-apps inherit it: help texts are printed as written
    cls=WorkflowGroup,
    context_settings={"show_default": True},
)


def version_line() -> str:
    """`atd VERSION (Python X.Y.Z)`: the installed distribution's version."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("atd")
    except PackageNotFoundError:  # run from a source tree that was never installed
        v = "(not installed)"
    return f"atd {v} (Python {platform.python_version()})"


def _version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def _around_every_command(
    ctx: typer.Context,
    _show_version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                       help="Print atd's version and exit."),
) -> None:
    # the library enforces the model size limit wherever a model is registered; the CLI
    # prints the models it removed (cli.commands.models.reporting_removals)
    ctx.with_resource(reporting_removals())
    ctx.with_resource(closing_nodes())  # the node each command opens (cli.options.node_home) closes with it


def _register_all() -> None:
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"cli.commands.{mod.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


_register_all()


@functools.cache
def click_command() -> typer.core.TyperGroup:
    """`app` as the click command typer builds from it, built once per process: calling
    `app` (or typer's test runner) rebuilds it from every command's signature each time
    (~40 ms of CPU), which in-process callers running many command lines pay per line."""
    return typer.main.get_command(app)


def run(argv: list[str] | None = None) -> int:
    """Run one `atd` command line; return its exit code. Never raises, never prints a
    traceback: every failure is one `error: ...` line on stderr (see `cli.failure`)."""
    from cli.failure import report

    try:
        rc = click_command()(args=argv, prog_name="atd", standalone_mode=False)
    except BaseException as exc:  # noqa: BLE001 - the one place that reports everything
        return report(exc)
    # non-standalone mode returns the code of a typer.Exit (e.g. 130 after Ctrl-C)
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0


def main() -> None:
    """Console-script entry point."""
    sys.exit(run())


if __name__ == "__main__":
    main()
