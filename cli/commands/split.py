"""`atd split configure|join|accept|report|finetune`: split learning (FESTA, p-FESTA, MSD).

A server is a node started with `atd node start --role festa-server|pfesta-server|msd-server`;
`atd split configure` writes what it offers (the `[split]` table of its config.toml);
`atd split accept` accepts members into its p-FESTA / MSD campaign (`[split] accept = "manual"`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from atdnode.learning import apply_device
from atdnode.split import ACCEPT_POLICIES, DEFAULT_BODY, EMBEDDER_HEADS, METHODS, SplitSettings
from cli.choices import choice
from cli.options import DEVICE_OPT, HOME_ENV, HOME_OPT, node_home

Head = choice("Head", EMBEDDER_HEADS)
Accept = choice("Accept", ACCEPT_POLICIES)
CompareMethod = choice("CompareMethod", METHODS)


def _kept(first) -> str:
    """What an absent `configure` option means: the current setting stays (the first time: `first`)."""
    return f"kept; first {first}"


_S = SplitSettings  # its field defaults: the settings of a node never configured (no instance: no torch import)
_BODY = DEFAULT_BODY

split_app = typer.Typer(help="Split learning over libp2p: FESTA, p-FESTA, masked sampling distillation.",
                        no_args_is_help=True)


@split_app.command("configure")
def configure(
    home: Path = HOME_OPT,
    task: List[str] = typer.Option([], "--task", help="NAME:KIND[:OUTPUTS[:LOSS_WEIGHT]] (repeatable), KIND one of "
                                   "classification, regression, segmentation. Replaces the task list."),
    img_size: Optional[int] = typer.Option(None, show_default=_kept(_BODY["img_size"]), help="Body: image size."),
    patch_size: Optional[int] = typer.Option(None, show_default=_kept(_BODY["patch_size"]), help="Body: patch size."),
    in_chans: Optional[int] = typer.Option(None, show_default=_kept(_BODY["in_chans"]), help="Body: image channels."),
    embed_dim: Optional[int] = typer.Option(None, show_default=_kept(_BODY["embed_dim"]), help="Body: embedding width."),
    depth: Optional[int] = typer.Option(None, show_default=_kept(_BODY["depth"]), help="Body: transformer blocks on the server."),
    heads: Optional[int] = typer.Option(None, show_default=_kept(_BODY["num_heads"]), help="Body: attention heads."),
    mlp_ratio: Optional[float] = typer.Option(None, show_default=_kept(_BODY["mlp_ratio"]), help="Body: MLP width / embedding width."),
    rounds: Optional[int] = typer.Option(None, show_default=_kept(_S.rounds), help="Training rounds (FESTA: phase 1)."),
    phase2_rounds: Optional[int] = typer.Option(None, show_default=_kept(_S.phase2_rounds), help="FESTA: extra rounds with the body frozen."),
    steps: Optional[int] = typer.Option(None, "--steps", show_default=_kept(_S.steps_per_round), help="Batches per client per round."),
    unify_every: Optional[int] = typer.Option(None, show_default=_kept(_S.unifying_rounds), help="Average heads/tails per task every n rounds."),
    batch_size: Optional[int] = typer.Option(None, show_default=_kept(_S.batch_size), help="Samples per batch."),
    lr: Optional[float] = typer.Option(None, show_default=_kept(_S.lr), help="AdamW learning rate (server body and, by default, clients)."),
    clients: Optional[int] = typer.Option(None, show_default=_kept(_S.clients), help="Round 1 opens once this many clients are ready ..."),
    start_timeout: Optional[float] = typer.Option(None, show_default=_kept(_S.start_timeout), help="... or after this many seconds with at least one."),
    round_timeout: Optional[float] = typer.Option(None, show_default=_kept(_S.round_timeout), help="Drop a client that has not finished a round by then."),
    msd_steps: Optional[int] = typer.Option(None, show_default=_kept(200), help="MSD: distillation steps on the server."),
    msd_batch: Optional[int] = typer.Option(None, show_default=_kept(128), help="MSD: distillation batch size."),
    seed: Optional[int] = typer.Option(None, show_default=_kept(_S.seed), help="Seed of the server body."),
    head: Optional[Head] = typer.Option(None, show_default=_kept(_S.head), help="p-FESTA ablation: a fixed embedder (the paper's) or a learnable one."),
    pos_embed: Optional[bool] = typer.Option(None, "--pos-embed/--no-pos-embed",
                                             help="p-FESTA ablation: whether the embedder adds a position table."),
    accept: Optional[Accept] = typer.Option(None, show_default=_kept(_S.accept),
                                         help="p-FESTA / MSD: 'members' (the daemon accepts every member that joins "
                                              "and asks) or 'manual' (only members accepted with `atd split accept`)."),
    as_json: bool = typer.Option(False, "--json", help="Print the resulting settings as JSON."),
) -> None:
    """Set what this node offers as a split-learning server (the split table of config.toml)."""
    from atdnode.split import DEFAULT_BODY, SplitSettings, parse_task

    h = node_home(home)
    cur = SplitSettings.load(h)
    body = dict(DEFAULT_BODY)
    body.update(cur.body)
    for key, v in (("img_size", img_size), ("patch_size", patch_size), ("in_chans", in_chans),
                   ("embed_dim", embed_dim), ("depth", depth), ("num_heads", heads), ("mlp_ratio", mlp_ratio)):
        if v is not None:
            body[key] = v
    msd = dict(cur.msd)
    if msd_steps is not None:
        msd["steps"] = msd_steps
    if msd_batch is not None:
        msd["batch_size"] = msd_batch
    new = cur.updated(tasks=tuple(parse_task(t) for t in task) or None, body=body, msd=msd, rounds=rounds,
                      phase2_rounds=phase2_rounds, steps_per_round=steps, unifying_rounds=unify_every,
                      batch_size=batch_size, lr=lr, clients=clients, start_timeout=start_timeout,
                      round_timeout=round_timeout, seed=seed, head=head, pos_embed=pos_embed,
                      accept=accept)
    new.save(h)
    if as_json:
        typer.echo(json.dumps(new.to_dict(), indent=2))
    else:
        tasks = ", ".join(f"{t['name']} ({t['kind']})" for t in new.tasks)
        typer.echo(f"split service: tasks {tasks}; {new.rounds} rounds x {new.steps_per_round} steps, "
                   f"unify every {new.unifying_rounds}, batch {new.batch_size}, {new.clients} client(s) to start")


@split_app.command("join")
def join(
    home: Path = HOME_OPT,
    server: str = typer.Option(..., "--server", help="Peer id (or a unique prefix / suffix) of the split server."),
    task: str = typer.Option(..., "--task", help="Task name, one of those the server offers."),
    data: str = typer.Option(..., "--data", help="Data spec (e.g. 'digits?shard=1/2&limit=200'); see `atd train`."),
    server_addr: List[str] = typer.Option([], "--server-addr", help="Server multiaddr (…/p2p/<id>); default: its "
                                          "hello entry in the local ledger (repeatable)."),
    rounds: Optional[int] = typer.Option(None, "--rounds", help="Take part in at most R rounds (default: all)."),
    test_data: Optional[str] = typer.Option(None, help="Evaluation data spec (default: the test split of --data)."),
    no_eval: bool = typer.Option(False, "--no-eval", help="Skip the task metric at the end."),
    no_sync: bool = typer.Option(False, "--no-sync", help="Do not pull the server's ledger (p-FESTA / MSD still pull what the embedder secret needs)."),
    no_permute: bool = typer.Option(False, "--no-permute", help="p-FESTA/MSD: send patches in order (ablation)."),
    seed: int = typer.Option(0, help="Seed of this client's parts and sampling."),
    lr: Optional[float] = typer.Option(None, help="Client learning rate (default: the server's)."),
    reconnect_timeout: float = typer.Option(60.0, help="Keep re-dialling a lost server this long."),
    read_timeout: float = typer.Option(600.0, help="Give up on a server silent this long."),
    finetune_steps: int = typer.Option(100, help="MSD: local fine-tuning steps after the round."),
    compare_scratch: bool = typer.Option(False, help="MSD: also fine-tune from a random body, for comparison."),
    as_json: bool = typer.Option(False, "--json", help="Print the comm record as JSON."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress on stderr."),
    device: Optional[str] = DEVICE_OPT,
) -> None:
    """Join a split-learning server as a client: run the protocol, report the task metric and
    write a comm record (measured bytes + the paper's parameters) under HOME/split/records.

    Runs without a daemon: a transient libp2p endpoint with this node's identity. With an
    MSD server the client uploads once, receives the distilled body and fine-tunes it here."""
    from atdnode.split import JoinOptions, join as run

    import logging

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    for name in ("libp2p", "multiaddr", "async_service"):
        # py-libp2p logs the cancellation of its tasks at shutdown as errors; keep them for -v
        logging.getLogger(name).setLevel(logging.WARNING if verbose else logging.CRITICAL)
    from atdnode.node import resolve_peer

    h = node_home(home)
    apply_device(device, h)  # checked before anything loads; every step of the command uses it
    server = resolve_peer(h, server)
    opts = JoinOptions(server=server, task=task, data=data, server_addrs=list(server_addr), rounds=rounds,
                       seed=seed, lr=lr, evaluate=not no_eval, test_data=test_data, sync=not no_sync,
                       permute=not no_permute, reconnect_timeout=reconnect_timeout, read_timeout=read_timeout,
                       finetune_steps=finetune_steps, compare_scratch=compare_scratch)
    from cli.progress import bars

    with bars(quiet=as_json):  # upload and rounds as bars on a terminal
        res = run(h, opts)
    if as_json:
        typer.echo(json.dumps(res.record, indent=2, default=str))
        return
    rec = res.record
    metric = " ".join(f"{k}={v:.4f}" for k, v in rec["metrics"].items())
    typer.echo(f"{rec['algorithm']} task {rec['task']['name']}: {len(rec['rounds'])} round(s), {metric or 'no metric'}")
    typer.echo(f"comm record: {res.path}")


@split_app.command("accept")
def accept(
    peers: List[str] = typer.Argument(..., help="Peer ids (or unique prefixes / suffixes) of the members to accept."),
    home: Path = HOME_OPT,
    service: Optional[str] = typer.Option(None, "--service", help="The campaign's service entry id (default: this "
                                          "node's latest service entry)."),
) -> None:
    """Accept members as clients of this server's p-FESTA / MSD campaign: a signed
    `split_accept` entry (a member's join takes effect only once its server accepts it; the
    embedder secret is sealed to exactly the accepted clients). Run it on the server's home;
    works while the daemon runs. With `[split] accept = "members"` the daemon accepts every
    member that joins and asks; with "manual" only the members accepted here."""
    from atdnode.errors import ConfigError
    from atdnode.node import resolve_peer
    from atdnode.node import NodeIdentity
    from atdnode.split import SplitSecretError
    from atdnode.split import accept_clients
    from ledger import Ledger

    h = node_home(home)
    ident = NodeIdentity.load(h)
    full = [resolve_peer(h, p) for p in peers]
    with Ledger.open(h.ledger_db) as led:
        if service is None:
            own = led.query(kind="service", author=ident.public_key)
            if not own:
                raise ConfigError("this node has announced no split service (start it with a split-server --role)")
            service = own[-1].id.hex()
        try:
            e = accept_clients(ident, led, service, full)
        except SplitSecretError as err:
            raise ConfigError(f"split accept: {err}") from None
    if e is None:
        typer.echo(f"already accepted into campaign {service[:12]}: {', '.join(full)}")
    else:
        typer.echo(f"accepted into campaign {service[:12]}: {', '.join(e.body['clients'])} (entry {e.id.hex()})")


@split_app.command("report")
def report(
    home: List[Path] = typer.Option(..., "--home", envvar=HOME_ENV, show_envvar=True,
                                   help="Node home(s) whose comm records to show (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable rows."),
) -> None:
    """Measured bytes per client next to the p-FESTA paper's formulas (T_FL, T_SL, T_FESTA,
    T_p-FESTA) for the same D, B, R, n, F, G, P, and the error against its own algorithm's."""
    from atdnode.split import load_records, render_report as render, report_row

    rows = [report_row(rec) for h in home for rec in load_records(node_home(h))]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
    elif not rows:
        typer.echo("no split comm records")
    else:
        typer.echo(render(rows))


@split_app.command("compare")
def compare(
    out: Path = typer.Option(Path("split-compare.json"), "--out", help="Write the report (JSON) here."),
    png: Optional[Path] = typer.Option(None, "--png", help="Also plot accuracy and bytes per method (PNG)."),
    seeds: int = typer.Option(5, help="Seeds per method (the report gives the spread over them)."),
    rounds: int = typer.Option(6, help="Rounds."),
    steps: int = typer.Option(20, "--steps", help="Batches per client per round."),
    unify_every: int = typer.Option(2, help="Average tails/heads (and FL models) every n rounds."),
    samples: int = typer.Option(350, help="Images per client (2 clients per task, disjoint)."),
    img_size: int = typer.Option(28, help="Image size (digits upscaled)."),
    method: List[CompareMethod] = typer.Option([], "--method", help="Run only these methods (repeatable; default: all)."),
    jobs: int = typer.Option(1, help="Worker processes (each run is single-threaded)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
) -> None:
    """FESTA and p-FESTA against centralized, FedAvg, sequential split learning, single-task
    training and p-FESTA's ablations on one two-task setting (digits): accuracy and measured
    bytes per method, the cost formulas beside them, and which of the papers' orderings hold."""
    from rich.progress import Progress

    from atdnode.split import (CompareSetting, render_compare as render, run_compare,
                               write_compare_png as write_png)
    from cli.errors import CliError

    try:
        setting = CompareSetting(seeds=tuple(range(seeds)), rounds=rounds, steps_per_round=steps,
                                 unifying_rounds=unify_every, samples_per_client=samples, img_size=img_size,
                                 methods=tuple(method) or METHODS)
    except ValueError as e:
        raise CliError(f"split compare: {e}") from None
    with Progress(transient=True) as bar:
        job = bar.add_task("split compare", total=len(setting.methods) * len(setting.seeds))
        rep = run_compare(setting, lambda name, seed: bar.update(job, advance=1, description=f"{name} seed {seed}"),
                          jobs=jobs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1))
    if png is not None:
        write_png(rep, png)
    typer.echo(json.dumps(rep, indent=1) if as_json else render(rep))
    typer.echo(f"report: {out}" + (f", plot: {png}" if png else ""), err=as_json)


@split_app.command("finetune")
def finetune(
    home: Path = HOME_OPT,
    task: str = typer.Option(..., "--task", help="Task name (one of the MSD service's tasks)."),
    data: str = typer.Option(..., "--data", help="Labelled data spec to fine-tune and evaluate on."),
    weights: str = typer.Option("latest", "--weights", help="The MSD weights entry id (or prefix, or latest)."),
    steps: int = typer.Option(100, help="Fine-tuning steps."),
    lr: float = typer.Option(2e-3, help="Fine-tuning learning rate."),
    seed: int = typer.Option(0, help="Seed of the tail, sampling."),
    compare_scratch: bool = typer.Option(False, help="Also fine-tune from a random body."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    device: Optional[str] = DEVICE_OPT,
) -> None:
    """Fine-tune body + task tail from a published MSD body and report the task metric."""
    from atdnode.split import finetune_from_entry

    h = node_home(home)
    apply_device(device, h)  # checked before anything loads
    out = finetune_from_entry(h, task=task, data=data, ref=weights, steps=steps, lr=lr,
                              seed=seed, compare_scratch=compare_scratch)
    if as_json:
        typer.echo(json.dumps(out, indent=2))
    else:
        metric = " ".join(f"{k}={v:.4f}" for k, v in out["metrics"].items())
        typer.echo(f"fine-tuned {task} from {out['entry'][:12]} on {out['samples']} samples: {metric}")


def register(app: typer.Typer) -> None:
    app.add_typer(split_app, name="split")
