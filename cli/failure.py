"""Turn whatever a command raised into one line on stderr and an exit code.

Every `atd` failure ends here (`cli.app.main`): usage errors, typed `AtdError`s (and the
ground floor's `LedgerError` and `ModelConfigError`), OS errors, errors wrapped in trio's
ExceptionGroups, and bugs. The user sees exactly one line, `error: ...`, never a traceback
(set ATD_DEBUG=1 to get the traceback of an unexpected error).

Usage errors come from click, but which click depends on what pip installed: typer
< 0.2x uses the `click` package, newer typer bundles its own copy as `typer._click`
(whose exceptions do not derive from click's). Both are handled, found by duck typing
on the class names and attributes they share, so a third layout does not slip through.
"""
from __future__ import annotations

import os
import sys
from typing import Iterator

DEBUG_ENV = "ATD_DEBUG"


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    """The non-group exceptions inside (possibly nested) ExceptionGroups, in order."""
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            yield from _leaves(sub)
    else:
        yield exc


def _click_classes(name: str) -> tuple[type, ...]:
    """`name` (e.g. 'ClickException') from every click flavour importable here."""
    found = []
    for modname in ("click.exceptions", "typer._click.exceptions"):
        try:
            mod = __import__(modname, fromlist=[name])
        except ImportError:
            continue
        cls = getattr(mod, name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def _exit_classes() -> tuple[type, ...]:
    import typer

    return (typer.Exit, *_click_classes("Exit"))


def _abort_classes() -> tuple[type, ...]:
    import typer

    return (typer.Abort, *_click_classes("Abort"))


def one_line(text: str) -> str:
    """Collapse a message to one line (multi-line messages from libraries happen)."""
    return " ".join(str(text).split()) or "failed"


def _usage_line(exc: BaseException) -> str:
    # typer words a bad choice "Value error, 'x' is not one of ..."; the first two words say nothing
    msg = one_line(exc.format_message()).replace(": Value error, ", ": ")  # type: ignore[attr-defined]
    param = getattr(exc, "param", None)
    envvar = getattr(param, "envvar", None)
    if envvar and type(exc).__name__ == "MissingParameter" and str(envvar) not in msg:
        msg = msg.rstrip(".") + f" (or set {envvar if isinstance(envvar, str) else ' or '.join(envvar)})."
    ctx = getattr(exc, "ctx", None)
    if ctx is not None:
        msg += ("" if msg.endswith((".", "!", "?")) else ".") + f" Try '{ctx.command_path} --help'."
    return msg


def report(exc: BaseException) -> int:
    """Print `exc` as one line on stderr (or help on stdout) and return the exit code."""
    import sqlite3

    from atdnode.errors import AtdError
    from atdnode.transport import TransportError
    from ledger.errors import LedgerError
    from protocols.vit_config import ModelConfigError

    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(f"error: {one_line(code)}", file=sys.stderr)
        return 1
    leaves = list(_leaves(exc))
    # In a group, the first leaf that is not a consequence of cancellation tells the story.
    import trio

    real = [e for e in leaves if not isinstance(e, trio.Cancelled)] or leaves
    exc = real[0]
    if isinstance(exc, _exit_classes()):
        return int(getattr(exc, "exit_code", 0) or 0)
    if isinstance(exc, (KeyboardInterrupt, *_abort_classes())):
        print("interrupted", file=sys.stderr)
        return 130
    if isinstance(exc, _click_classes("NoArgsIsHelpError")):
        text = exc.format_message()  # type: ignore[attr-defined]  # the help, asked for by omission
        if text.strip():  # (typer's rich help is printed while it is formatted, and is empty here)
            print(text)
        return 2
    if isinstance(exc, _click_classes("UsageError")):
        print(f"error: {_usage_line(exc)}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 2))
    if isinstance(exc, _click_classes("ClickException")):
        print(f"error: {one_line(exc.format_message())}", file=sys.stderr)  # type: ignore[attr-defined]
        return int(getattr(exc, "exit_code", 1))
    if isinstance(exc, (AtdError, LedgerError, TransportError, ModelConfigError)):
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 1) or 1)
    if isinstance(exc, sqlite3.Error):  # e.g. a ledger.db that is not a database any more
        print(f"error: ledger database: {one_line(str(exc))}", file=sys.stderr)
        return 1
    if isinstance(exc, BrokenPipeError):  # `atd ledger show | head`: the reader left, nothing to say
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        except (OSError, ValueError):
            pass
        return 1
    if isinstance(exc, OSError):
        if getattr(exc, "filename", None) and exc.strerror:
            print(f"error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        else:
            print(f"error: {one_line(str(exc) or type(exc).__name__)}", file=sys.stderr)
        return 1
    if isinstance(exc, MemoryError):
        print("error: out of memory", file=sys.stderr)
        return 1
    # A bug (or an error type nobody typed yet): still one line, with a way to see more.
    if os.environ.get(DEBUG_ENV):
        import traceback

        traceback.print_exception(exc)
    else:
        print(f"error: unexpected {type(exc).__name__}: {one_line(str(exc))} "
              f"(set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
    return 1
