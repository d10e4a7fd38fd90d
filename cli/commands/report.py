"""`atd report MODEL --out card.html`: a model card for an ethics board or a regulator."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cli.errors import CliError
from cli.options import HOME_OPT, node_home

HELP = """Write a model card: one self-contained HTML file with everything the signed ledger says about one model.

Who trained it on what (label spaces, fingerprints, sample and class counts; never file paths), which weight sets and weights made each aggregate and whether each aggregate re-verifies here (as `atd aggregate --verify`), metrics of every evaluation with confusion matrices and training curves, the members and their roles at each step, and the ledger entries that prove it.

--pdf also prints it to PDF with a Chromium or Google Chrome installed here (no PDF library is a dependency of atd); without one, open the HTML in any browser and print it.
"""


def report(
    model: str = typer.Argument("latest", help="Model id (or unique prefix) from `atd models`, or `latest` (the model "
                                "in use, marked * by `atd models`)."),
    home: Path = HOME_OPT,
    out: Path = typer.Option(Path("card.html"), "--out", help="Where to write the HTML card."),
    pdf: Optional[Path] = typer.Option(None, "--pdf", help="Also print the card to this PDF file (needs Chromium or "
                                       "Google Chrome on PATH)."),
) -> None:
    from atdnode.report import collect_card as collect, write_card_html as write

    if out.is_dir():
        raise CliError(f"--out {out}: is a folder; give a file name such as card.html")
    card = collect(node_home(home), model)
    write(card, out)
    agg = [s.verification["status"] for s in card.steps if s.verification]
    typer.echo(f"model card for {card.model_id}: {out} ({len(card.steps)} ledger entries, "
               f"{agg.count('verified')}/{len(agg)} aggregates re-verified; {card.use['status']} on this node)")
    if pdf is not None:
        from atdnode.report import print_pdf

        typer.echo(f"printed to {print_pdf(out, pdf)}")


def register(app: typer.Typer) -> None:
    app.command("report", help=HELP)(report)
