"""`atd classify`: score the node's model (or ensemble) on a data spec."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from atdnode.node import NodeHome, sklearn_warnings_to_log
from atdnode.data import ALL, SPLITS
from cli.choices import choice
from cli.options import DEVICE_OPT, HOME_OPT, node_home
from cli.errors import CliError

Split = choice("Split", ("auto", ALL, *reversed(SPLITS)))  # auto: atdnode.learning.classify.choose_split


def classify(
    home: Path = HOME_OPT,
    data: str = typer.Option(..., "--data", help="Data spec, e.g. `digits` or `npz:PATH?classes=a,b` (see `atd train --help`)."),
    model: str = typer.Option("latest", "--model", help="Model id (or unique prefix) from `atd models`, or `latest` "
                              "(the model in use, marked * by `atd models`)."),
    split: Split = typer.Option("auto", "--split", help="Which images to score. auto: every image of a "
                              "data source without splits; the test split of one with train/val/test folders "
                              "(or of the data the model was trained on)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Confusion-matrix PNG path (default: HOME/classify/MODEL-SPEC.png)."),
    robust: bool = typer.Option(False, "--robust", help="Also report accuracy under a PGD attack (models with a head)."),
    pgd_eps: str = typer.Option("8/255", "--pgd-eps", help="PGD L-inf radius in pixel units (a number or a fraction)."),
    pgd_step: str = typer.Option("2/255", "--pgd-step", help="PGD step size in pixel units."),
    pgd_steps: int = typer.Option(7, "--pgd-steps", min=0, help="PGD steps."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    device: Optional[str] = DEVICE_OPT,
) -> None:
    """Predict with the node's global model or ensemble and report n per class, accuracy,
    balanced accuracy, precision and F1 (macro over the data's classes), for two classes
    sensitivity, specificity and AUROC, and the calibration error -- each with a 95 %
    interval; writes a confusion-matrix and a reliability PNG. It says which split it scored.

    A model from vertical or hierarchical aggregation predicts with its ensemble over the
    union of the shared label spaces; others with their own head. Samples of classes the
    model does not know count as errors. --robust adds accuracy under the PGD attack of
    `atd train --adversarial` (eps 8/255, step 2/255, 7 steps by default).
    """
    from atdnode.learning import run_classify as run

    from atdnode.learning import resolve_device

    h = node_home(home)
    resolve_device(device, home=h)  # a device this machine lacks: one line, before anything loads
    sklearn_warnings_to_log(h)  # scikit-learn's warnings go to HOME/logs/cli.log, not stderr
    pgd = _pgd(h, model, pgd_eps, pgd_step, pgd_steps) if robust else None
    from cli.progress import bars

    with bars(quiet=as_json, lines=True):  # reading, scoring: bars on a terminal, plain lines in a log
        res = run(h, data, model=model, split=split, out=out, pgd=pgd, device=device)
    if as_json:
        typer.echo(json.dumps(res.to_json()))
        return
    from cli.scoretext import score_lines

    m = res.metrics
    typer.echo(f"model {res.model_id} ({res.kind}) on {data}")
    typer.echo(f"  scored: {res.split} split, n={m['n']} ({res.why})")
    for line in score_lines(m):
        typer.echo(line)
    if m.get("warning"):
        typer.echo(f"  WARNING: {m['warning']}")
    if res.unknown_classes:
        typer.echo(f"  classes the model does not know: {', '.join(res.unknown_classes)}")
    typer.echo(f"  confusion matrix {res.png}")
    typer.echo(f"  reliability plot {res.reliability_png}")


def _pgd(home: NodeHome, model: str, eps: str, step: str, steps: int):
    """The attack `atd train --adversarial` uses, on this model's input normalisation."""
    from atdnode.data import MEAN, STD
    from atdnode.models import ModelRegistry
    from cli.options import fraction
    from protocols.adversarial import AdversarialError, PGDConfig

    chans = int(ModelRegistry.of(home).get(model).model["in_chans"])
    try:
        return PGDConfig(eps=fraction(eps), step=fraction(step), steps=steps, mean=(MEAN,) * chans,
                         std=(STD,) * chans)
    except AdversarialError as exc:
        raise CliError(f"--robust: {exc}") from None


def register(app: typer.Typer) -> None:
    app.command("classify")(classify)
