"""`atd local up|status|down`: a consortium of N nodes on this machine, in one command."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from cli.errors import CliError

local_app = typer.Typer(help="A local consortium: N nodes with their daemons on 127.0.0.1, in one command.",
                        no_args_is_help=True)
DIR_OPT = typer.Option(Path("atd-local"), "--dir", help="Directory holding the consortium (node1 ... nodeN).")


@local_app.command("up")
def up_cmd(
    n: Optional[int] = typer.Option(None, "-n", "--nodes", min=1, help="Number of nodes (node1 founds, the others "
                                    "are admitted; default 3, or what DIR already holds)."),
    dir: Path = DIR_OPT,
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds to wait until every daemon is connected."),
    role: List[str] = typer.Option([], "--role", help="NODE=ROLE, e.g. node1=pfesta-server (repeatable): the role "
                                   "that node's daemon announces (set before it starts)."),
    init_only: bool = typer.Option(False, "--init-only", help="Only create the homes (e.g. to run `atd split "
                                   "configure` before the server starts); start nothing."),
    daemon_arg: List[str] = typer.Option([], "--daemon-arg", help="Extra option for every `atd node start`, e.g. "
                                         "--daemon-arg=--dashboard=127.0.0.1:0 (repeatable; remembered for restarts)."),
    as_json: bool = typer.Option(False, "--json", help="Print the nodes as JSON."),
) -> None:
    """Initialise N nodes in DIR (if not there yet), start their daemons as background processes
    on 127.0.0.1 and return once all are connected to each other.

    Ready means: every daemon is connected to every other one and all ledgers hold the same
    entries (each node's signed hello is known everywhere). Prints, per node, its peer id,
    address and an `export ATD_HOME=...` line. Logs go to
    DIR/nodeK/logs/; `atd local down` stops them. Running `up` again restarts stopped daemons.
    """
    from atdnode.node import localnet
    roles = {}
    for r in role:
        name, sep, value = r.partition("=")
        if not sep or not name or not value:
            raise CliError(f"--role {r!r}: expected NODE=ROLE, e.g. node1=pfesta-server")
        roles[name] = value
    nodes = localnet.up(dir, n, timeout=timeout, roles=roles, start=not init_only,
                        extra_args=list(daemon_arg) or None,
                        log=lambda m: typer.echo(m, err=True))
    _print(nodes, as_json)


@local_app.command("status")
def status_cmd(dir: Path = DIR_OPT, as_json: bool = typer.Option(False, "--json", help="JSON output.")) -> None:
    """Each node of the local consortium: running or not, pid, address, connected peers."""
    from atdnode.node import localnet
    _print(localnet.status(dir), as_json)


@local_app.command("down")
def down_cmd(dir: Path = DIR_OPT,
             timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait for each clean stop before SIGKILL.")
             ) -> None:
    """Stop every daemon of the local consortium (cleans up after crashed ones too); homes are kept."""
    from atdnode.node import localnet
    for name, what in localnet.down(dir, timeout=timeout).items():
        typer.echo(f"{name}: {what}")


def _print(nodes, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps([n.to_json() for n in nodes], indent=2))
        return
    for n in nodes:
        state = f"running (pid {n.pid}), {len(n.peers)} peer(s)" if n.running else "not running"
        typer.echo(f"# {n.name}{' (founder)' if n.founder else ''}  {n.peer_id}  {state}")
        for a in n.addrs[:1]:
            typer.echo(f"#   {a}")
        if n.dashboard:
            typer.echo(f"#   dashboard {n.dashboard}")
        typer.echo(f"export ATD_HOME={n.home}")


def register(app: typer.Typer) -> None:
    app.add_typer(local_app, name="local")
