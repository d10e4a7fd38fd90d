"""`atd plan`: signed plans the consortium's members carry out (propose, accept / decline, follow, status)."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Optional

import typer

from cli.errors import CliError
from cli.options import HOME_OPT, node_home

plan_app = typer.Typer(help="Signed plans: the consortium's steps in one file, carried out by every member that "
                            "accepted (README: Plans).", no_args_is_help=True)


def _read(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise CliError(f"{path}: no such plan file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CliError(f"{path} is not valid TOML: {exc}") from None


def _propose(home: Path, file: Path) -> str:
    from atdnode.plans import propose

    return propose(node_home(home), _read(file))


@plan_app.command("propose")
def propose_cmd(file: Path = typer.Argument(..., help="Plan file (TOML; README: Plans)."), home: Path = HOME_OPT) -> None:
    """Check a plan file against the consortium and sign it as a `plan` entry; prints its id."""
    typer.echo(_propose(home, file))


@plan_app.command("accept")
def accept_cmd(plan: str = typer.Argument(..., help="Plan id (or unique prefix)."), home: Path = HOME_OPT) -> None:
    """Record this member's signed acceptance (refused for a plan this node cannot carry out)."""
    from atdnode.plans import decide

    decide(node_home(home), plan, "accept")
    typer.echo(f"accepted plan {plan}")


@plan_app.command("decline")
def decline_cmd(plan: str = typer.Argument(..., help="Plan id (or unique prefix)."), home: Path = HOME_OPT,
                reason: str = typer.Option("", "--reason", help="One line recorded with the decision (default: none).")) -> None:
    """Record this member's signed refusal: it runs none of the plan's steps; the others go on without it."""
    from atdnode.plans import decide

    decide(node_home(home), plan, "decline", reason)
    typer.echo(f"declined plan {plan}")


def _follow(home: Path, plan: str, timeout: Optional[float], as_json: bool) -> None:
    from atdnode.node import sklearn_warnings_to_log
    from atdnode.plans import follow

    sklearn_warnings_to_log(node_home(home))  # scikit-learn's warnings go to HOME/logs/cli.log
    def said(adv) -> None:
        if not as_json:
            for sid in adv.ran:
                typer.echo(f"step {sid}: recorded")

    adv = follow(node_home(home), plan, timeout=timeout, on_step=said)
    if as_json:
        typer.echo(json.dumps({"plan": adv.plan, "decision": adv.decision, "waiting": adv.waiting,
                               "refused": adv.refused}))
    elif adv.refused:
        raise CliError(f"plan {adv.plan[:16]}: {adv.refused}")
    elif adv.decision != "accept":
        typer.echo(f"plan {adv.plan[:16]}: {adv.decision or 'not accepted here (`atd plan accept`)'}")
    elif adv.waiting:
        raise CliError(f"plan {adv.plan[:16]}: timed out; steps {', '.join(adv.waiting)} still wait for inputs")
    else:
        typer.echo(f"plan {adv.plan[:16]}: this node's steps are done (`atd plan status {adv.plan[:16]}`)")


TIMEOUT_OPT = typer.Option(None, "--timeout", help="Give up after this many seconds (default: until every own step has a result; each waits at most until its inputs' deadlines).")


@plan_app.command("follow")
def follow_cmd(plan: str = typer.Argument(..., help="Plan id (or unique prefix)."), home: Path = HOME_OPT,
               timeout: Optional[float] = TIMEOUT_OPT,
               as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Carry out this member's steps here, in the foreground, as their inputs arrive: for a node
    whose daemon does not carry out plans (`[plans] daemon = false`); the daemon still
    replicates and fetches. Resumable: run it again after a kill and finished steps are skipped."""
    _follow(home, plan, timeout, as_json)


def _daemon_runs_plans(h) -> bool:
    """Whether a daemon runs on home `h` and carries out its plans (`[plans] daemon`, default true)."""
    from atdnode.node import control
    from atdnode.plans import PlanPolicy

    return control.daemon_running(h.control_socket) and PlanPolicy.load(h).daemon


def _watch(h, plan: str, timeout: Optional[float], as_json: bool) -> None:
    from atdnode.plans import member_names, watch
    from ledger import Ledger

    with Ledger.open(h.ledger_db) as led:
        names = member_names(led)
    rows = watch(h, plan, timeout=timeout, on_row=None if as_json else lambda r: typer.echo(_row_line(r, names)))
    waiting = [r for r in rows if r["state"] == "waiting" and r["decision"] == "accept"]
    failed = [r for r in rows if r["state"] == "failed"]
    if as_json:
        typer.echo(json.dumps({"plan": plan, "steps": rows}))
    if waiting:
        raise CliError(f"plan {plan[:16]}: {len(waiting)} member step(s) have no result yet (timed out or past "
                       f"the plan's last deadline; `atd plan status {plan[:16]}`)")
    if failed:
        raise CliError(f"plan {plan[:16]}: {len(failed)} member step(s) failed, first {failed[0]['step']}: "
                       f"{failed[0]['reason']}")
    if not as_json:
        done = sum(r["state"] == "done" for r in rows)
        typer.echo(f"plan {plan[:16]}: {done} of {len(rows)} member steps done"
                   + (f", {len(rows) - done} left out (declined or undecided)" if done < len(rows) else ""))


@plan_app.command("run")
def run_cmd(file: Path = typer.Argument(..., help="Plan file (TOML)."), home: Path = HOME_OPT,
            timeout: Optional[float] = TIMEOUT_OPT,
            as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Propose a plan, accept it here, and show every member's step results as they arrive until
    the plan is over; the members' daemons carry it out. Without a daemon carrying out plans on
    this home, this node's own steps run in this process (`atd plan follow`)."""
    from atdnode.node import NodeIdentity
    from atdnode.plans import decide, load_view
    from ledger import Ledger

    plan = _propose(home, file)
    if not as_json:
        typer.echo(f"plan {plan}")
    h = node_home(home)
    with Ledger.open(h.ledger_db) as led:
        members = load_view(led, plan).body["members"]
    member = NodeIdentity.load(h).peer_id in members
    if member:
        decide(h, plan, "accept")
    if _daemon_runs_plans(h):
        _watch(h, plan, timeout, as_json)
    elif member:
        _follow(home, plan, timeout, as_json)


@plan_app.command("status")
def status_cmd(plan: str = typer.Argument(..., help="Plan id (or unique prefix)."), home: Path = HOME_OPT,
               as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Each member's decision and state per step, as this node's ledger shows them."""
    from atdnode.plans import load_view, member_names, progress
    from ledger import Ledger

    h = node_home(home)
    with Ledger.open(h.ledger_db) as led:
        view, names = load_view(led, plan, check=False), member_names(led)
    rows = progress(view)
    if as_json:
        typer.echo(json.dumps({"plan": view.id, "name": view.body["name"], "steps": rows}))
        return
    typer.echo(f"plan {view.id[:16]} {view.body['name']!r} by {names.get(view.author, view.author[-8:])}")
    for r in rows:
        typer.echo(_row_line(r, names))


def _row_line(r: dict, names: dict[str, str]) -> str:
    """One member's state of one step, as `atd plan status` prints it."""
    who = names.get(r["member"], r["member"][-8:])
    acc = r["metrics"].get("accuracy")
    extra = (f"accuracy {acc:.3f} " if isinstance(acc, (int, float)) else "") + (
        r["reason"] or (f"without {', '.join(names.get(m, m[-8:]) for m in r['missing'])}" if r["missing"] else ""))
    return f"  {r['step']:<14} {r['kind']:<15} {who:<12} {r['decision']:<10} {r['state']:<9} {extra}".rstrip()


def register(app: typer.Typer) -> None:
    app.add_typer(plan_app, name="plan")
