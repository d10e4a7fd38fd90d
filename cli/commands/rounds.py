"""`atd rounds`: serverless round-based training (FedAvg, FedWAvg or a robust aggregator; optionally adversarial) on the fabric."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from atdnode.learning import apply_device
from atdnode.node import NodeHome, sklearn_warnings_to_log
from cli.options import (node_home, ADV_RATIO_OPT, ADVERSARIAL_HELP, DEPTH_OPT, DEVICE_OPT, EMBED_DIM_OPT, HEADS_OPT, HOME_OPT,
                         IMG_SIZE_OPT, IN_CHANS_OPT, MLP_RATIO_OPT, MODEL_OPT, PATCH_SIZE_OPT, PGD_EPS_OPT,
                         PGD_STEP_OPT, PGD_STEPS_OPT, STEM_OPT, Stem, model_config, pgd_transform)
from cli.choices import choice
from protocols.weightings import ROUND_AGGREGATORS, weightings

ROUND_WEIGHTINGS = weightings("round")  # the weighted means (as protocols.rounds; this module loads no torch)
RoundWeighting = choice("RoundWeighting", ROUND_WEIGHTINGS)
Aggregator = choice("Aggregator", ROUND_AGGREGATORS)

HELP = "\n\n".join([
    "Train a global model over several rounds with the consortium's other members, no server.",
    "Each round every member starts from the previous round's global model, trains locally, publishes its "
    "weights (a signed `weights` entry with the round number), waits until --min-peers members' weights are "
    "here or --deadline passes, and the global model is the --aggregator's combination of the round's inputs "
    "in canonical order, recorded as an `aggregate` entry (mode round) that names late members; every member "
    "recomputes it bit for bit. A member is waited for until --deadline, and an aggregate that leaves out an "
    "input that reached this node in time is not adopted. All members must give the same data label space, model and --seed (they "
    "define the shared initial model and the campaign). The daemon must be running for gossip and fetch. "
    "Run it again after a crash: it resumes at the current round.",
])


def rounds(
    home: Path = HOME_OPT,
    n_rounds: int = typer.Option(..., "--rounds", min=1, help="Number of rounds."),
    weighting: Optional[RoundWeighting] = typer.Option(None, "--weighting", help=f"{' | '.join(ROUND_WEIGHTINGS)} (the weighted "
                                            "means; same as --aggregator)."),
    aggregator: Optional[Aggregator] = typer.Option(None, "--aggregator", help="How a round's inputs become the global "
                                             "model (default fedwavg): " + "; ".join(
                                                 f"{name}: {text}" for name, text in ROUND_AGGREGATORS.items()) + "."),
    byzantine: int = typer.Option(1, "--byzantine", min=0, help="f, the hostile members a robust aggregator "
                                  "(median, trimmed-mean, krum, multi-krum) is sized for: trimmed from each end, "
                                  "Krum's f."),
    q: float = typer.Option(10.0, "--q", help="FedWAvg softmax scale q (default: protocols.fedwavg.ROUNDS_Q, chosen "
                                              "by measurement: weights move measurably off 1/K on skewed shards, not on IID ones)."),
    data: str = typer.Option("digits", "--data", help="This node's data spec."),
    model: str = MODEL_OPT,
    img_size: Optional[int] = IMG_SIZE_OPT,
    patch_size: Optional[int] = PATCH_SIZE_OPT,
    embed_dim: Optional[int] = EMBED_DIM_OPT,
    depth: Optional[int] = DEPTH_OPT,
    heads: Optional[int] = HEADS_OPT,
    in_chans: Optional[int] = IN_CHANS_OPT,
    mlp_ratio: Optional[float] = MLP_RATIO_OPT,
    stem: Optional[Stem] = STEM_OPT,
    local_epochs: int = typer.Option(1, "--local-epochs", min=1, help="Local epochs per round."),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Local batch size."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak AdamW rate (default as `atd train`)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the shared initial model (same on every member)."),
    deadline: float = typer.Option(120.0, "--deadline", min=0.0, help="Seconds to wait for a round's inputs."),
    min_peers: Optional[int] = typer.Option(None, "--min-peers", min=1, help="Stop waiting once this many members' weights are here (default: every live member, i.e. all but those disconnected from this node's daemon for --absent-grace s)."),
    absent_grace: float = typer.Option(20.0, "--absent-grace", min=0.0, help="Stop waiting for a member disconnected this long."),
    name: str = typer.Option("", "--name", help="Campaign name (to run several campaigns with one config; default: none)."),
    adversarial: bool = typer.Option(False, "--adversarial", help=ADVERSARIAL_HELP),
    adv_ratio: float = ADV_RATIO_OPT,
    pgd_eps: str = PGD_EPS_OPT,
    pgd_step: str = PGD_STEP_OPT,
    pgd_steps: int = PGD_STEPS_OPT,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per round on stdout."),
    device: Optional[str] = DEVICE_OPT,
) -> None:
    import trio

    from atdnode import progress
    from atdnode.rounds import RoundRunner, RoundsConfig, RoundsError, current_round
    from cli.progress import bars
    from ledger import Ledger

    if weighting is not None and aggregator is not None and weighting != aggregator:
        raise RoundsError(f"--weighting {weighting} and --aggregator {aggregator}: give one")
    rule = aggregator or weighting or "fedwavg"
    h = node_home(home)
    apply_device(device, h)  # checked before anything loads; every step of the command uses it
    sklearn_warnings_to_log(h)  # scikit-learn's warnings go to HOME/logs/cli.log, not stderr
    cfg = model_config(model, img_size=img_size, patch_size=patch_size, embed_dim=embed_dim, depth=depth,
                       heads=heads, in_chans=in_chans, mlp_ratio=mlp_ratio, stem=stem)
    transform = None
    if adversarial:
        transform = pgd_transform(adv_ratio=adv_ratio, pgd_eps=pgd_eps, pgd_step=pgd_step, pgd_steps=pgd_steps,
                                  in_chans=cfg.in_chans)
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    conf = RoundsConfig(data=data, cfg=cfg, rounds=n_rounds, weighting=rule, byzantine=byzantine, q=q, local_epochs=local_epochs,
                        batch_size=batch_size, lr=lr, seed=seed, deadline=deadline, min_peers=min_peers, absent_grace=absent_grace, name=name,
                        batch_transform=transform, log=log)
    runner = RoundRunner(h, conf)
    log(f"campaign {runner.campaign} (init {runner.init[:12]})")
    with Ledger.open(h.ledger_db) as led:
        done = current_round(led, runner.campaign)  # a restarted campaign resumes here

    def show(rep) -> None:
        if as_json:
            typer.echo(json.dumps({"campaign": runner.campaign, **rep.to_json()}))
        else:
            typer.echo(f"round {rep.round}: global {rep.blob[:12]} entry {rep.entry[:12]} weights "
                       f"{[round(w, 4) for w in rep.weights]}" + (f" missing {rep.missing}" if rep.missing else ""))

    with bars(quiet=as_json), progress.task(f"rounds of {runner.campaign[:12]}", total=n_rounds) as bar:
        bar.update(done)
        trio.run(runner.run, lambda rep: (show(rep), bar.update(rep.round + 1)))


def register(app: typer.Typer) -> None:
    app.command("rounds", help=HELP)(rounds)
