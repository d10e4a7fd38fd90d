"""`atd ledger show|verify|export|import`: inspect, check and move the signed ledger."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from atdnode.node import NodeHome
from cli.errors import CliError
from cli.options import HOME_OPT, node_home

ledger_app = typer.Typer(help="Inspect, verify, export and import the node's signed ledger.", no_args_is_help=True)


def _open(home: Path):
    from atdnode.errors import ConfigError
    from ledger import Ledger

    h = node_home(home)
    if not h.ledger_db.exists():
        raise ConfigError(f"{h.ledger_db} is missing; this node's ledger is gone")
    return Ledger.open(h.ledger_db)


@ledger_app.command("show")
def show(
    home: Path = HOME_OPT,
    kind: Optional[str] = typer.Option(None, "--kind", help="Only entries of this kind (genesis, member, hello, weights, ...)."),
    author: Optional[str] = typer.Option(None, "--author", help="Only entries by this peer id (or a unique prefix / suffix of one, or a hex public key)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of entries (id, author, seq, lamport, kind, body, ...)."),
) -> None:
    """List the entries in the log, in log order (lamport, author, seq).

    Columns: when this node stored the entry (local time; entries carry no signed clock),
    lamport clock, author (last 8 characters of the peer id) #seq, kind, entry id, body."""
    import time

    from atdnode.node import resolve_peer
    from ledger import parse_author

    key = parse_author(resolve_peer(node_home(home), author)) if author else None
    with _open(home) as led:
        entries = led.query(kind=kind, author=key)
        stored = led.stored_at([e.id for e in entries])
    if as_json:
        typer.echo(json.dumps([{**e.to_json(), "stored_at": stored.get(e.id)} for e in entries]))
        return
    for e in entries:
        j = e.to_json()
        body = json.dumps(j["body"], sort_keys=True)
        if len(body) > 80:
            body = body[:77] + "..."
        at = stored.get(e.id)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at is not None else "-" * 19
        typer.echo(f"{when} {e.lamport:>6} {j['author'][-8:]}#{e.seq:<5} {e.kind:<9} {j['id'][:16]} {body}")


@ledger_app.command("wait")
def wait(
    entries: List[str] = typer.Argument(..., help="Entry ids to wait for (64 hex, or a unique prefix of at least 4), "
                                        "e.g. printed by `publish-weights --json` on another node."),
    home: Path = HOME_OPT,
    blobs: bool = typer.Option(False, "--blobs", help="Also wait until the blob each entry names is held here (the daemon fetches it)."),
    timeout: float = typer.Option(120.0, "--timeout", help="Give up after this many seconds (exit 1)."),
) -> None:
    """Wait until entries published elsewhere have reached this node's log (and, with --blobs,
    their blobs its store): the step between a peer's publish and this node's aggregate."""
    from atdnode.replication import wait_for_entries
    from cli.progress import bars

    with bars():
        wait_for_entries(node_home(home), entries, blobs=blobs, timeout=timeout)
    n = len(dict.fromkeys(r.strip().lower() for r in entries))
    typer.echo(f"{n} entr{'y' if n == 1 else 'ies'} here" + (" with their blobs" if blobs else ""))


@ledger_app.command("verify")
def verify(
    home: Path = HOME_OPT,
    peers: bool = typer.Option(False, "--peers", help="Also compare with every connected member (needs the running daemon): "
                               "lists entries a peer holds that this ledger lacks (truncation, rollback, a deleted revocation) and merges them."),
) -> None:
    """Re-verify every stored entry (SQLite integrity, signatures, ids, chains, membership, store chain).

    Exits 0 when intact; otherwise prints the first problem, naming the entry, and exits non-zero.
    With --peers it also exits non-zero when a connected member held entries this ledger lacked.
    """
    with _open(home) as led:
        report = led.verify()
    typer.echo(report.summary())
    if peers:
        _verify_peers(NodeHome.at(home))
    else:  # say what a local check cannot see
        typer.echo("note: checked this ledger alone; a cut tail, a rollback (e.g. a removed revocation) or a cut WAL "
                   "are only detectable against peers: atd ledger verify --peers")


def _verify_peers(h: NodeHome) -> None:
    from atdnode.node import control
    from cli.errors import CliError

    rep = control.call(h.control_socket, "verify_peers", timeout=300.0)
    if not rep["peers"]:
        raise CliError("no connected member answered a sync request; nothing to compare with"
                       + (f" (failed: {', '.join(rep['failed'])})" if rep["failed"] else ""))
    for m in rep["missing"]:
        typer.echo(f"missing: {m['author'][-8:]}#{m['seq']} {m['kind']} {m['id'][:16]} (held by {m['peer'][-8:]}; now merged)")
    if rep["missing"]:
        raise CliError(f"{len(rep['missing'])} entries held by peers were missing from this ledger "
                       "(truncated, rolled back or edited); they are merged now", exit_code=2)
    typer.echo(f"ok: heads agree with {len(rep['peers'])} connected peer(s)"
               + (f"; {len(rep['failed'])} did not answer" if rep["failed"] else ""))


@ledger_app.command("export")
def export(
    file: Path = typer.Argument(..., help="Dump file to write (replaced atomically)."),
    home: Path = HOME_OPT,
) -> None:
    """Write every stored entry to a self-verifying dump file."""
    from ledger.dump import export_dump

    with _open(home) as led:
        n = export_dump(led, file)
    typer.echo(f"exported {n} entries to {file}")


@ledger_app.command("import")
def import_(
    file: Path = typer.Argument(..., help="Dump file made by `atd ledger export`."),
    home: Path = HOME_OPT,
) -> None:
    """Merge a dump into this node's ledger (every entry is verified; reports what happened).

    Exits non-zero when any entry was rejected (the others are still imported)."""
    from atdnode.node import NodeConfig
    from ledger.dump import import_dump

    h = node_home(home)
    with _open(home) as led:
        res = import_dump(led, file)
        m = led.membership()
    cfg = NodeConfig.load(h)
    if m.consortium and (cfg.consortium != m.consortium or cfg.genesis_id is None):
        cfg.consortium = m.consortium
        cfg.genesis_id = m.genesis_id.hex() if m.genesis_id else cfg.genesis_id
        cfg.save(h)
    typer.echo(f"imported {file}: {len(res.added)} added to the log, {len(res.pending)} pending, "
               f"{len(res.rejected)} rejected, {res.duplicates} already present")
    for entry_id, err in res.rejected[:10]:
        typer.echo(f"  rejected: {err}")
    if res.rejected:  # the good entries are in; the exit code says that not everything was
        raise CliError(f"{len(res.rejected)} entries of {file} were rejected (first: {res.rejected[0][1]})")


def register(app: typer.Typer) -> None:
    app.add_typer(ledger_app, name="ledger")
