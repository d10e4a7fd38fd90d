"""Inline SVG bar charts for the dashboard (no scripts, no external resources).

`accuracy_chart(models)`: the latest accuracy of every model, local (trained here) and
consortium (made by aggregation or rounds) in two colours. `bytes_chart(rows)`: stream bytes
sent and received per peer. Every label is HTML-escaped.
"""
from __future__ import annotations

import html

LOCAL, CONSORTIUM = "#7a8ba3", "#2f6fb3"
SENT, RECEIVED = "#2f6fb3", "#9a6700"
_W, _LABEL, _ROW = 620, 200, 20


def _e(v: object) -> str:
    return html.escape(str(v), quote=True)


def _svg(rows: list[str], n: int, legend: list[tuple[str, str]], id_: str) -> str:
    h = 24 + n * _ROW
    keys = "".join(f'<rect x="{_LABEL + 150 * i}" y="2" width="10" height="10" fill="{c}"/>'
                   f'<text x="{_LABEL + 14 + 150 * i}" y="11" font-size="11">{_e(t)}</text>'
                   for i, (t, c) in enumerate(legend))
    return (f'<svg id="{id_}" xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{h}" '
            f'font-family="system-ui, sans-serif" role="img">{keys}{"".join(rows)}</svg>')


def accuracy_chart(models: list[dict]) -> str:
    """One bar per model with a latest accuracy (newest first, at most 15)."""
    scored = [m for m in models if isinstance(m.get("latest_accuracy"), (int, float))][:15]
    if not scored:
        return '<p class="muted">no scored model yet (atd train / atd classify)</p>'
    rows, span = [], _W - _LABEL - 60
    for i, m in enumerate(scored):
        y = 20 + i * _ROW
        acc = max(0.0, min(1.0, float(m["latest_accuracy"])))
        local = m["kind"] == "trained"
        rows.append(f'<g class="acc-bar" data-model="{_e(m["id"])}" data-kind="{"local" if local else "consortium"}">'
                    f'<text x="{_LABEL - 6}" y="{y + 13}" font-size="11" text-anchor="end">{_e(m["id"][:12])} '
                    f'({_e(m["kind"])})</text><rect x="{_LABEL}" y="{y + 3}" width="{span * acc:.1f}" height="13" '
                    f'fill="{LOCAL if local else CONSORTIUM}"/><text x="{_LABEL + span * acc + 4:.1f}" y="{y + 13}" '
                    f'font-size="11">{acc:.3f}</text></g>')
    return _svg(rows, len(scored), [("local (trained here)", LOCAL), ("consortium", CONSORTIUM)], "accuracy-chart")


def bytes_chart(rows_in: list[tuple[str, int, int]]) -> str:
    """(peer label, sent, received) rows: two bars each, scaled to the largest."""
    if not rows_in:
        return '<p class="muted">no stream traffic yet</p>'
    top = max(max(s, r) for _, s, r in rows_in) or 1
    rows, span = [], _W - _LABEL - 90
    for i, (label, sent, recv) in enumerate(rows_in[:15]):
        y = 20 + i * _ROW
        rows.append(f'<g class="peer-bytes" data-peer="{_e(label)}">'
                    f'<text x="{_LABEL - 6}" y="{y + 13}" font-size="11" text-anchor="end">{_e(label)}</text>'
                    f'<rect x="{_LABEL}" y="{y + 2}" width="{span * sent / top:.1f}" height="7" fill="{SENT}"/>'
                    f'<rect x="{_LABEL}" y="{y + 10}" width="{span * recv / top:.1f}" height="7" fill="{RECEIVED}"/>'
                    f'<text x="{_LABEL + span + 6}" y="{y + 13}" font-size="10">{_mb(sent)} / {_mb(recv)}</text></g>')
    return _svg(rows, min(15, len(rows_in)), [("sent", SENT), ("received", RECEIVED)], "bytes-chart")


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"
