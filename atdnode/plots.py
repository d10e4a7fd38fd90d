"""The one way atd draws a PNG: matplotlib's Agg back-end (no display), a figure closed
even when drawing fails, parent folders created."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def pyplot():
    """``matplotlib.pyplot`` on the Agg back-end (imported lazily: a daemon that never draws
    never pays for matplotlib)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def png_figure(path: Path | str, **subplots) -> Iterator[tuple]:
    """``with png_figure(path, figsize=...) as (fig, axes):`` draw, and on a clean exit the
    figure is laid out and written to ``path`` as PNG; it is closed either way."""
    plt = pyplot()
    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
    except BaseException:
        plt.close(fig)
        raise
    save_png(fig, path)  # closes it


def save_png(fig, path: Path | str) -> Path:
    """Lay out ``fig``, write it to ``path`` as PNG (parents created), close it; the path."""
    path = Path(path)
    try:
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        pyplot().close(fig)
    return path
