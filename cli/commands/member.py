"""`atd member add|revoke|restore|list`: consortium membership, recorded as signed `member` entries."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from cli.options import HOME_OPT, node_home

member_app = typer.Typer(help="Admit, revoke and list consortium members (admins only for changes).",
                         no_args_is_help=True)


def _ident_and_ledger(home: Path):
    from atdnode.node import NodeIdentity
    from ledger import Ledger

    from atdnode.errors import ConfigError

    h = node_home(home)
    if not h.ledger_db.exists():
        raise ConfigError(f"{h.ledger_db} is missing; this node's ledger is gone")
    return NodeIdentity.load(h), Ledger.open(h.ledger_db)


@member_app.command("add")
def add(
    peer_id: str = typer.Argument(..., help="Peer id (12D3KooW...) of the node to admit (`atd id` on that node)."),
    home: Path = HOME_OPT,
    admin: bool = typer.Option(False, "--admin", help="Also make it an admin (founder only)."),
    name: str = typer.Option("", "--name", help="Optional human-readable name recorded with the admission (default: none)."),
) -> None:
    """Admit a node to the consortium (signed by this node, which must be an admin)."""
    from ledger import parse_author

    key = parse_author(peer_id)
    ident, led = _ident_and_ledger(home)
    with led:
        e = led.admit(ident.signer, key, admin=admin, name=name or None)
    typer.echo(f"admitted {peer_id}{' as admin' if admin else ''} (entry {e.id.hex()})")


@member_app.command("revoke")
def revoke(
    peer_id: str = typer.Argument(..., help="Peer id (or a unique prefix / suffix of one) of the member to revoke."),
    home: Path = HOME_OPT,
) -> None:
    """Revoke a member for good: its entries beyond those already in this ledger are refused."""
    from atdnode.node import resolve_peer
    from ledger import parse_author

    key = parse_author(resolve_peer(node_home(home), peer_id))
    ident, led = _ident_and_ledger(home)
    with led:
        e = led.revoke(ident.signer, key)
    typer.echo(f"revoked {peer_id} after seq {e.body['upto']} (entry {e.id.hex()})")


@member_app.command("restore")
def restore(
    old: str = typer.Argument(..., help="Peer id (or a unique prefix / suffix) of the member whose rotation is contested."),
    new: str = typer.Argument(..., help="Peer id of the owner's new key (`atd id` on the owner's node)."),
    home: Path = HOME_OPT,
) -> None:
    """Give a frozen identity back to its owner: when a stolen old key signed a rotation
    competing with the owner's, the identity is frozen and neither new key is a member.
    An admin (the founder, for an admin's identity) names the owner's new key, which must be
    one of the keys the old key rotated to; it then carries the identity (membership,
    admin flag, name, reader access) and the thief's rotation is evidence."""
    from atdnode.node import resolve_peer
    from ledger import parse_author

    old_key = parse_author(resolve_peer(node_home(home), old))
    new_key = parse_author(new)
    ident, led = _ident_and_ledger(home)
    with led:
        e = led.restore(ident.signer, old_key, new_key)
    typer.echo(f"restored {old} -> {new} (entry {e.id.hex()})")


@member_app.command("list")
def list_members(
    home: Path = HOME_OPT,
    as_json: bool = typer.Option(False, "--json", help="JSON output."),
) -> None:
    """List members as this node's ledger knows them."""
    from ledger import peer_id_from_public_key

    _, led = _ident_and_ledger(home)
    with led:
        m = led.membership()
        contested = {k: sorted(peer_id_from_public_key(n) for n in led.rival_rotations(k)) for k in m.members}
    rows = [{"peer_id": peer_id_from_public_key(k), "admin": s.admin, "revoked": s.revoked, "upto": s.upto,
             "name": s.name, "founder": k == m.founder,
             "rotated_to": peer_id_from_public_key(m.rotations[k]) if k in m.rotations else None,
             "contested": contested[k]}
            for k, s in sorted(m.members.items())]
    if as_json:
        typer.echo(json.dumps({"consortium": m.consortium, "members": rows}))
        return
    typer.echo(f"consortium: {m.consortium or '(no genesis yet)'}")
    for r in rows:
        flags = [f for f, on in (("founder", r["founder"]), ("admin", r["admin"]),
                                 ("revoked", r["revoked"] and not r["rotated_to"])) if on]
        if r["rotated_to"]:
            flags.append(f"rotated->{r['rotated_to'][:16]}")
        if r["contested"]:  # frozen by competing rotations: `atd member restore` settles it
            flags.append("frozen, rotations contested->" + "|".join(p[:16] for p in r["contested"]))
        typer.echo(f"{r['peer_id']}  {','.join(flags) or 'member'}  {r['name'] or ''}".rstrip())


def register(app: typer.Typer) -> None:
    app.add_typer(member_app, name="member")
