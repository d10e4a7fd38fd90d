"""`atd aggregate`: one-time aggregation (horizontal / vertical / hierarchical), recorded on the ledger."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from atdnode.learning import apply_device
from atdnode.node import sklearn_warnings_to_log
from cli.choices import choice
from cli.options import DEVICE_OPT, HOME_OPT, node_home
from protocols.weightings import (CLASSIFIERS, MODES, PRIORS, choices_help, help_for, mode_help,
                                  weighting_help_by_mode, weightings)
from cli.errors import CliError
from cli.progress import bars

HELP = "\n\n".join([
    "Combine published weight sets into this node's global model and record how.",
    'horizontal: average compatible weight sets (heads too when every input is a full set over the same '
    'labels), then (default, as in the paper) the PCA -> MLP + RF + SVM ensemble on the fused extractor\'s '
    'CLS features; --classifier head lets the averaged model predict directly. vertical: average extractors, then fit PCA -> MLP + RF '
    "+ SVM (soft vote) on CLS features of this node's data plus the features peers sealed to it with the "
    'same fused extractor (`atd share-features`); run it again after peers shared. hierarchical: each '
    '--group NAME=ENTRY_ID,... is averaged once (a stored group model with the same name and members is '
    'reused, never rebuilt; NAME=AGGREGATE_ENTRY reuses that aggregate), then group models combine with '
    'sqrt-classes or model-count weights, then the ensemble as in vertical mode.',
    'The `aggregate` entry names the input entries, the weighting, the exact weights and the result blob,'
    ' so any peer holding the inputs can recompute and check it with --verify.',
])


Mode = choice("Mode", MODES)
Weighting = choice("Weighting", dict.fromkeys(weightings("average") + weightings("group")))
GroupWeighting = choice("GroupWeighting", weightings("average"))
Classifier = choice("Classifier", CLASSIFIERS)
Prior = choice("Prior", PRIORS)


def _split(values: Optional[List[str]]) -> list[str] | None:
    out = [v.strip() for item in values or [] for v in item.split(",") if v.strip()]
    return out or None


def aggregate(
    home: Path = HOME_OPT,
    mode: Mode = typer.Option("horizontal", "--mode", help=f"{mode_help()}."),
    weighting: Optional[Weighting] = typer.Option(None, "--weighting", help=f"{weighting_help_by_mode()}."),
    inputs: Optional[List[str]] = typer.Option(None, "--inputs", help="Weights entry ids (or unique prefixes) to combine, repeatable or comma-separated (default: every compatible one held)."),
    group: Optional[List[str]] = typer.Option(None, "--group", help="Hierarchical: NAME=WEIGHTS_ENTRY,... (averaged once into the group's model), or NAME=AGGREGATE_ENTRY (reused as it); repeatable."),
    group_weighting: GroupWeighting = typer.Option("uniform", "--group-weighting", help=f"Hierarchical: how a new group averages its members: {help_for('average')}."),
    features: Optional[List[str]] = typer.Option(None, "--features", help="Vertical/hierarchical: use exactly these features entries (default: every one sealed to this node that fits)."),
    data: Optional[str] = typer.Option(None, "--data", help="Vertical/hierarchical: this node's data spec for its own features (default: its model's training data)."),
    classifier: Classifier = typer.Option("ensemble", "--classifier", help=f"Horizontal: {choices_help(CLASSIFIERS)}."),
    q: float = typer.Option(1.0, "--q", help="FedWAvg softmax scale q (the reference is this node's current model: its previous global model, or its own)."),
    pca_components: int = typer.Option(500, "--pca-components", min=1, help="Ensemble PCA components (capped by feature width and samples)."),
    mlp_max_iter: int = typer.Option(300, "--mlp-max-iter", min=1, help="Ensemble MLP max iterations."),
    mlp_hidden: str = typer.Option("256", "--mlp-hidden", help="Ensemble MLP hidden layer sizes, comma-separated."),
    rf_trees: int = typer.Option(100, "--rf-trees", min=1, help="Ensemble random-forest trees."),
    seed: int = typer.Option(0, "--seed", help="Ensemble seed."),
    prior: Prior = typer.Option("balanced", "--prior", help=f"Ensemble class-prior correction: {choices_help(PRIORS)}."),
    strict: bool = typer.Option(False, "--strict", help="Hierarchical: refuse groups that do not descend from one shared base (default: warn)."),
    verify: Optional[str] = typer.Option(None, "--verify", help="Recompute this aggregate entry (id or unique prefix) from its inputs and check its weights and result hash."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    device: Optional[str] = DEVICE_OPT,
) -> None:
    from atdnode.node import resolve_entry_ids

    h = node_home(home)
    apply_device(device, h)  # checked before anything loads; every step of the command uses it
    sklearn_warnings_to_log(h)  # scikit-learn's warnings go to HOME/logs/cli.log, not stderr
    if verify:
        from atdnode.aggregation import verify_aggregate

        verify = resolve_entry_ids(h, [verify], ("aggregate",), what="aggregate")[0]
        with bars(quiet=as_json, lines=True):
            blob = verify_aggregate(h, verify)
        typer.echo(json.dumps({"verified": True, "blob": blob}) if as_json else f"aggregate {verify[:16]} verifies: {blob}")
        return
    from atdnode.aggregation import check_arguments, default_weighting, run_aggregate

    ids, feats = _split(inputs), _split(features)
    check_arguments(mode, inputs=ids, groups=group or (), classifier=classifier, data_spec=data, features=feats,
                    strict=strict, weighting=weighting)  # before any entry id is resolved
    ids = ids and resolve_entry_ids(h, ids, ("weights",), what="input")  # ids or unique prefixes -> full ids
    feats = feats and resolve_entry_ids(h, feats, ("features",), what="features")
    from atdnode.aggregation import EnsembleOptions

    try:
        hidden = tuple(int(x) for x in mlp_hidden.split(",") if x.strip())
    except ValueError:
        hidden = ()
    if not hidden or min(hidden) < 1:
        raise CliError(f"--mlp-hidden {mlp_hidden!r}: expected positive integers like 256 or 128,64")
    opts = EnsembleOptions(pca_components=pca_components, mlp_hidden=hidden, mlp_max_iter=mlp_max_iter, rf_trees=rf_trees,
                           seed=seed, prior=prior)
    specs = []
    if mode == "hierarchical":
        from atdnode.aggregation import GroupSpec

        specs = [GroupSpec.parse(g) for g in group or []]
        specs = [GroupSpec(g.name, tuple(resolve_entry_ids(h, g.refs, ("weights", "aggregate"),
                                                           what=f"group {g.name}"))) for g in specs]
    with bars(quiet=as_json, lines=True):  # the library's steps (blob checks, averaging, features, fits) as bars
        res = run_aggregate(h, mode, weighting=weighting, inputs=ids, groups=specs, group_weighting=group_weighting,
                            q=q, classifier=classifier, data_spec=data, features=feats, options=opts, strict=strict)
    for w in res.details.get("warnings", []):
        typer.echo(f"warning: {w}", err=True)
    if as_json:
        typer.echo(json.dumps(res.to_json()))
        return
    d = res.details
    typer.echo(f"{mode}: combined {len(res.inputs)} {'groups' if mode == 'hierarchical' else 'weight sets'} "
               f"({default_weighting(mode, weighting)}, weights "
               f"{', '.join(f'{w:.4f}' for w in res.weights)}) -> {res.blob}")
    for g in d.get("groups", []):
        typer.echo(f"  group {g['name']}: {'reused' if g['reused'] else 'built'} {g['entry'][:16]} "
                   f"({g['n_classes']} classes, {g['n_models']} base model(s))")
    if "ensemble" in d:
        typer.echo(f"  ensemble over {len(d['classes'])} classes from {d['samples']} samples "
                   f"({len(d['features'])} shared feature sets) -> {d['ensemble']}")
    for s in d.get("skipped", []):
        typer.echo(f"  skipped features {s['entry'][:16]}: {s['why']}")
    for s in d.get("skipped_inputs", []):
        typer.echo(f"  skipped weights {s['entry'][:16]}: {s['why']}")
    cands = d.get("candidates")
    if cands:
        by = "balanced_accuracy" if "balanced_accuracy" in cands["own"] else "accuracy"
        typer.echo(f"  candidates on this node's {cands['scored_on']} data ({cands.get('val_from') or '?'}), "
                   f"{by.replace('_', ' ')}: own model {cands['own'][by]:.3f}, consortium {cands['consortium'][by]:.3f}"
                   + (f", own raw-pixel ensemble {cands['raw-pixels'][by]:.3f}" if "raw-pixels" in cands else ""))
        if cands.get("warning"):
            typer.echo(f"  WARNING: {cands['warning']}")
    if d.get("kept_why"):
        typer.echo(f"  kept: {d.get('kept')} — {d['kept_why']}")
    typer.echo(f"entry {res.entry.id.hex()}; global model {res.model_id}")


def register(app: typer.Typer) -> None:
    app.command("aggregate", help=HELP)(aggregate)
