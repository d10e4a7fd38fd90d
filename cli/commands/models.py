"""`atd models [list | rm ID | prune]`: the node's model registry."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer

from cli.errors import CliError
from cli.options import HOME_ENV, HOME_HELP, HOME_OPT, node_home

models_app = typer.Typer(help="The node's models: list (default), remove, prune to the size limit.",
                         invoke_without_command=True)

# (header, width); every cell is cut to its width, so long names never shift the columns
COLUMNS = (("", 1), ("id", 16), ("created", 16), ("made", 12), ("model", 22), ("img/patch/dim/depth", 19),
           ("classes", 20), ("samples", 7), ("acc", 6), ("f1", 6), ("scored on", 28))
RIGHT = {"samples", "acc", "f1"}


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")


def _fit(text: str, width: int, right: bool = False) -> str:
    text = text if len(text) <= width else text[:width - 1] + "…"
    return text.rjust(width) if right else text.ljust(width)


def row(cells: list[str]) -> str:
    return "  ".join(_fit(c, w, h in RIGHT) for c, (h, w) in zip(cells, COLUMNS)).rstrip()


@models_app.callback()
def models_cmd(
    ctx: typer.Context,
    home: Optional[Path] = typer.Option(None, "--home", envvar=HOME_ENV, show_envvar=True, help=HOME_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the full records as a JSON list."),
) -> None:
    """List the models in this node's registry: how each was made (trained / horizontal /
    vertical / hierarchical / split), its latest metrics (the newest `atd classify`, else
    its training test split), config, label space and samples. `*` marks the model in use
    (what `atd classify`, `atd predict`, the dashboard and `atd report` take without a model
    id), with the `[aggregate] keep` policy in force and why it is in use."""
    if ctx.invoked_subcommand is not None:
        return
    if home is None:
        raise CliError(f"atd models needs --home DIR (or {HOME_ENV})")
    _list(home, as_json)


@models_app.command("list")
def list_cmd(
    home: Path = HOME_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print the full records as a JSON list."),
) -> None:
    """List the models (the same as `atd models` with no command)."""
    _list(home, as_json)


def _list(home: Path, as_json: bool) -> None:
    from atdnode.aggregation import keep_policy, short_class
    from atdnode.models import model_in_use
    from atdnode.data import caution_of
    from atdnode.models import ModelRegistry, made_by

    h = node_home(home)
    reg = ModelRegistry(h)
    recs = reg.list()
    use = model_in_use(h) if recs else None
    if as_json:
        out = []
        for r in recs:
            latest, source = reg.latest_metrics(r)
            out.append({**r.to_dict(), "made_by": made_by(r), "latest_metrics": latest, "latest_source": source,
                        "in_use": r.id == use.record.id})
        typer.echo(json.dumps(out, indent=2, sort_keys=True))
        return
    if not recs:
        typer.echo("no models yet (run `atd train`)")
        return
    typer.echo(row([c for c, _ in COLUMNS]))
    marked = False
    for r in recs:
        c = r.model
        m, source = reg.latest_metrics(r)
        caution = caution_of(m)  # a small test split: "!" beside the metrics it makes unreliable
        acc, f1 = (f"{m[k]:.3f}" + ("!" if caution and caution.affects(k) else "") if isinstance(m.get(k), (int, float))
                   else "-" for k in ("accuracy", "f1"))
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created))
        typer.echo(row(["*" if r.id == use.record.id else "", r.id, created, made_by(r), c["name"],
                        f"{c['img_size']}/{c['patch_size']}/{c['embed_dim']}/{c['depth']}",
                        f"{len(r.labels)}: {','.join(r.labels)}", str(r.samples), acc, f1, source or "-"]))
        cands = r.provenance.get("candidates")
        if isinstance(cands, dict) and r.provenance.get("kept"):  # what the node kept, and why
            by = "balanced_accuracy" if "balanced_accuracy" in cands.get("own", {}) else "accuracy"

            def score(k: str) -> str:  # "0.750 (SE 0.180)": the SE of its difference from the consortium's
                se = cands.get(k, {}).get("se") if by == "balanced_accuracy" else None
                return f"{cands.get(k, {}).get(by, float('nan')):.3f}" + (f" (SE {se:.3f})" if se is not None else "")

            typer.echo(f"{'':19}  candidates on its {cands.get('scored_on')} data ({by.replace('_', ' ')}): own "
                       f"{score('own')}, consortium {score('consortium')}"
                       + (f", raw-pixels {score('raw-pixels')}" if "raw-pixels" in cands else "")
                       + f"; kept {r.provenance['kept']}"
                       + (f" ({short})" if (short := short_class(cands)) else
                          " (one-SE rule)" if "se" in cands.get("own", {}) else "")
                       + (f" — WARNING: {cands['warning']}" if cands.get("warning") else ""))
        marked = marked or caution is not None
    typer.echo(f"* in use: {use.record.id}, {use.why} (keep policy: [aggregate] keep = {keep_policy(h)})")
    if marked:
        typer.echo("! unreliable: scored on a small test split (under 20 images, or a class under 5); see --json caution")


@models_app.command("rm")
def rm_cmd(
    model: str = typer.Argument(..., help="Model id (or unique prefix) from `atd models`."),
    home: Path = HOME_OPT,
) -> None:
    """Remove a model: its record, its weight blobs (unless another model uses them) and its
    training run folder. Refused when a ledger entry names one of its blobs (it is served)."""
    from atdnode.models import remove_model

    res = remove_model(node_home(home), model)
    typer.echo(f"removed model {res.model_id}: {len(res.blobs)} blob(s), {res.bytes / 1e6:.1f} MB freed")


@models_app.command("prune")
def prune_cmd(
    home: Path = HOME_OPT,
    max_bytes: Optional[int] = typer.Option(None, "--max-bytes", min=1, help="Limit to apply (default: [models] "
                                            "max_bytes in config.toml)."),
) -> None:
    """Remove the oldest unserved models until model blobs fit the size limit (the newest model stays)."""
    from atdnode.models import enforce_limit, size_limit

    h = node_home(home)
    limit = max_bytes or size_limit(h)
    if not limit:
        raise CliError("no size limit: set [models] max_bytes in config.toml or pass --max-bytes")
    enforce_limit(h, limit)  # what it removes is printed by `reporting_removals` (held around every command)


class _EchoHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        typer.echo(record.getMessage(), err=True)


@contextmanager
def reporting_removals() -> Iterator[None]:
    """Print, one line each on stderr, the models the library removes under the size limit
    (`atdnode.models.gc` logs them on `atd.models` wherever a model is registered, whichever
    command registers it: `atd train`, `atd aggregate`, `atd rounds`, `atd base build`);
    the app holds it around every command (`cli.app`)."""
    handler = _EchoHandler(logging.WARNING)
    logger = logging.getLogger("atd.models")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
