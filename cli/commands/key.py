"""`atd key export|import|rotate`: back up the node's keys, restore them, move to a new key."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from atdnode.node import NodeHome
from cli.errors import CliError
from cli.options import HOME_OPT, node_home

key_app = typer.Typer(help="Back up, restore and rotate the node's keys.", no_args_is_help=True)
PASS_OPT = typer.Option(None, "--passphrase-file", help="Read the passphrase from this file's first line "
                        "(default: ask on the terminal).")


def _passphrase(path: Optional[Path], *, confirm: bool) -> bytes:
    if path is not None:
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise CliError(f"cannot read --passphrase-file: {exc}") from None
        return (lines[0] if lines else "").encode()
    if not sys.stdin.isatty():  # getpass would warn and read an echoed line, or end in EOF
        raise CliError("no terminal to ask for the passphrase on: give --passphrase-file FILE")
    return typer.prompt("passphrase", hide_input=True, confirmation_prompt=confirm).encode()


@key_app.command("export")
def export(
    home: Path = HOME_OPT,
    out: Path = typer.Option(..., "--out", help="Backup file to create (never overwritten; mode 0600)."),
    encrypted: bool = typer.Option(False, "--encrypted", help="Required: the backup is sealed under a passphrase "
                                   "(scrypt + ChaCha20-Poly1305). Plain exports are not offered."),
    passphrase_file: Optional[Path] = PASS_OPT,
) -> None:
    """Write an encrypted backup of the node's Ed25519 and X25519 keys."""
    from atdnode.node import export_keys

    if not encrypted:
        raise CliError("atd exports keys only encrypted: add --encrypted")
    peer = export_keys(node_home(home), out, _passphrase(passphrase_file, confirm=True))
    typer.echo(f"exported the keys of {peer} to {out} (encrypted); keep it and its passphrase apart")


@key_app.command("import")
def import_(
    backup: Path = typer.Argument(..., help="Backup file written by `atd key export --encrypted`."),
    home: Path = HOME_OPT,
    passphrase_file: Optional[Path] = PASS_OPT,
) -> None:
    """Restore the keys of a backup into HOME (never replacing another key).

    Into an empty HOME, run `atd init --home HOME --join GENESIS` next: it keeps the keys.
    """
    from atdnode.node import import_keys

    peer = import_keys(NodeHome.at(home), backup, _passphrase(passphrase_file, confirm=False))
    typer.echo(peer)


@key_app.command("rotate")
def rotate(home: Path = HOME_OPT) -> None:
    """Move this node to a new Ed25519 key, recorded by a signed `rotate` membership entry.

    The old key signs the entry, the new key proves it accepts it; the node's earlier
    entries stay valid and its membership, admin flag and name follow the new key. The
    old key can sign nothing more. The peer id changes: with a daemon running, let it
    announce the rotation to its peers, then restart it (`atd node stop`, `atd node
    start`); peers learn the new id from the rotate entry and the new `hello`. Back up
    the new key (`atd key export --encrypted`): old backups are now useless.
    """
    from atdnode.node import control
    from atdnode.node import rotate_key

    h = node_home(home)
    r = rotate_key(h)
    typer.echo(f"rotated {r.old} -> {r.new} (entry {r.entry.id.hex()})", err=True)
    if control.daemon_running(h.control_socket):
        typer.echo("the running daemon still uses the old key: restart it once its peers have the rotate entry",
                   err=True)
    typer.echo(r.new)


def register(app: typer.Typer) -> None:
    app.add_typer(key_app, name="key")
