"""A model card as one self-contained HTML file (`atd report MODEL --out card.html`).

The reader-facing sections (plain-language summary, then Mitchell et al. 2019's sections:
`atdnode.report.card_sections`) come first; the audit annex read from the ledger (who
trained what, aggregation, evaluations in full, members, the entries that prove it) follows.

Figures are drawn from the recorded numbers with the node's own plotting code
(`atdnode.learning.metrics.save_confusion_png`, `atdnode.learning.trainlog.save_curves_png`) and inlined as
base64 PNGs, so the file opens anywhere without the node's home. Every value is HTML-escaped.
Machine-readable facts sit on `data-*` attributes (`data-entry`, `data-verification`,
`data-member`) so a test, or an auditor's script, can check the card against the ledger.
"""
from __future__ import annotations

import base64
import html
import json
import tempfile
import time
from pathlib import Path

from atdnode.report.card import Card, Step
from atdnode.report.card_sections import TEMPLATE
from atdnode.report.card_sections import render as sections

CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222;line-height:1.4}
h1{margin-bottom:.2em} h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em} th,td{border:1px solid #ccc;padding:.25em .5em;
text-align:left;vertical-align:top} th{background:#f3f3f3} code{font-size:.9em;word-break:break-all}
.ok{color:#17692f;font-weight:600} .bad{color:#b00020;font-weight:600} .warn{color:#8a5a00;font-weight:600}
.figs img{max-width:48%;margin:.3em;border:1px solid #ddd} .muted{color:#666}
"""
STATUS_CLASS = {"verified": "ok", "failed": "bad", "not checked": "warn"}


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _png_data(draw) -> str:
    """Run `draw(path)` into a temporary file; its PNG as a data: URI."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "fig.png"
        draw(p)
        return "data:image/png;base64," + base64.b64encode(p.read_bytes()).decode("ascii")


def _who(card: Card, peer_id: str) -> str:
    m = card.members.get(peer_id)
    name = f"{m.name} " if m and m.name else ""
    return f'{_e(name)}<code data-peer="{_e(peer_id)}">{_e(peer_id[-12:])}</code>'


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v, sort_keys=True)
    return str(v)


def _model_section(card: Card) -> str:
    m = card.model
    rows = [("model id", f"<code>{_e(card.model_id)}</code>"), ("made by", _e(card.made_by)),
            ("architecture", _e(f"{card.arch}, {m.get('in_chans')} channel(s)")),
            ("classes", _e(", ".join(card.labels))), ("label-space fingerprint", f"<code>{_e(card.label_fp)}</code>"),
            ("training samples", _e(card.samples)), ("data source kind", _e(card.source_kind))]
    if card.data_fp:
        rows.append(("training data fingerprint", f"<code>{_e(card.data_fp)}</code>"))
    if card.class_counts:
        rows.append(("class counts (training split)",
                     _e(", ".join(f"{k}: {v}" for k, v in card.class_counts.items()))))
    rows += [(f"weights ({part})", f"<code>{_e(b)}</code>") for part, b in sorted(card.blobs.items())]
    return _table(["", ""], rows, header=False)


def _table(head: list[str], rows: list[tuple], *, header: bool = True, attrs: list[str] | None = None) -> str:
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>")
    for i, r in enumerate(rows):
        a = f" {attrs[i]}" if attrs else ""
        out.append(f"<tr{a}>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _aggregates(card: Card) -> str:
    aggs = [s for s in card.steps if s.kind == "aggregate"]
    if not aggs:
        return "<p>This model was not made by aggregation: no aggregate entry names it.</p>"
    parts = []
    for s in aggs:
        v = s.verification or {"status": "not checked", "detail": ""}
        b = s.body
        inputs = b.get("inputs") or []
        weights = b.get("weights") or []
        rows = [(f'<code>{_e(i[:16])}</code>', _e(_fmt(w) if j < len(weights) else "?"),
                 _who(card, _author_of(card, i)))
                for j, (i, w) in enumerate(zip(inputs, list(weights) + [None] * len(inputs)))]
        parts.append(
            f'<div data-aggregate="{_e(s.id)}" data-verification="{_e(v["status"])}">'
            f'<h3>aggregate <code>{_e(s.id[:16])}</code> by {_who(card, s.author)}</h3>'
            f'<p>mode {_e(b.get("mode"))}, weighting {_e(b.get("weighting"))}, part {_e(b.get("part"))}, '
            f'heads averaged: {_e(b.get("head"))}; result <code>{_e(b.get("blob"))}</code></p>'
            f'<p>re-verification here: <span class="{STATUS_CLASS.get(v["status"], "warn")}">{_e(v["status"])}'
            f'</span> <span class="muted">{_e(v.get("detail", ""))}</span></p>'
            + _table(["input entry", "weight", "author"], rows)
            + (f'<p class="muted">left out: {_e(_fmt(b["skipped"]))}</p>' if b.get("skipped") else "")
            + "</div>")
    return "\n".join(parts)


def _author_of(card: Card, entry_id: str) -> str:
    for s in card.steps:
        if s.id == entry_id:
            return s.author
    return "?"


def _training(card: Card) -> str:
    ws = [s for s in card.steps if s.kind == "weights"]
    if not ws:
        return "<p>No weights entry names this model or its inputs (it was not published).</p>"
    rows = []
    for s in ws:
        b = s.body
        m = b.get("metrics") or {}
        counts = b.get("class_counts") if isinstance(b.get("class_counts"), dict) else {}
        classes = ", ".join(f"{c}: {counts[c]}" if c in counts else str(c) for c in map(str, b.get("labels") or []))
        rows.append((_who(card, s.author), f"<code>{_e(s.id[:16])}</code>", _e(b.get("part")), _e(classes),
                     f"<code>{_e(str(b.get('label_fp', ''))[:16])}</code>"
                     + (f"<br>data <code>{_e(str(b['data_fp'])[:16])}</code>" if b.get("data_fp") else ""),
                     _e(b.get("samples")), f"<code>{_e(str(b.get('base', '-'))[:16])}</code>",
                     _e(", ".join(f"{k} {_fmt(v)}" for k, v in m.items()))))
    return _table(["trained by", "weights entry", "part", "classes (training counts)", "fingerprints", "samples",
                   "shared base",
                   "reported metrics"], rows)


def _evaluations(card: Card) -> str:
    if not card.evaluations:
        return "<p>No evaluation recorded yet (run <code>atd classify</code>).</p>"
    from atdnode.learning import save_confusion_png, save_curves_png, save_reliability_png

    parts = []
    for i, ev in enumerate(card.evaluations):
        m = ev["metrics"]
        when = f" at {time.strftime('%Y-%m-%d %H:%M', time.gmtime(ev['time']))} UTC" if ev.get("time") else ""
        figs = []
        if ev.get("confusion") and ev.get("classes"):
            uri = _png_data(lambda p: save_confusion_png(ev["confusion"], ev["classes"], p,
                                                         title=f"{ev['what']} (acc {m.get('accuracy', 0):.3f})"))
            figs.append(f'<a href="{uri}" target="_blank"><img alt="confusion matrix {i}" src="{uri}"></a>')
        cal = (ev.get("details") or {}).get("calibration")
        if cal and cal.get("table"):
            uri = _png_data(lambda p: save_reliability_png(cal, p, title=f"{ev['what']}: reliability"))
            figs.append(f'<a href="{uri}" target="_blank"><img alt="reliability plot {i}" src="{uri}"></a>')
        if ev.get("history"):
            uri = _png_data(lambda p: save_curves_png(ev["history"], p, title="training curves"))
            figs.append(f'<a href="{uri}" target="_blank"><img alt="training curves" src="{uri}"></a>')
        parts.append(f'<div data-evaluation="{i}"><h3>{_e(ev["what"])}{_e(when)}</h3>'
                     f'<p>data {_e(ev["source"])}; '
                     + _e(", ".join(f"{k} {_fmt(v)}" for k, v in m.items())) + "</p>"
                     + (f'<div class="figs">{"".join(figs)}</div>' if figs else
                        '<p class="muted">no confusion matrix recorded for this evaluation</p>') + "</div>")
    return "\n".join(parts)


def _reliability(card: Card) -> str:
    """The reliability plot of the evaluation the summary quotes (the newest), if it recorded one."""
    from atdnode.learning import save_reliability_png

    ev = card.evaluations[-1] if card.evaluations else None
    cal = ((ev or {}).get("details") or {}).get("calibration")
    if not cal or not cal.get("table"):
        return ""
    uri = _png_data(lambda p: save_reliability_png(cal, p, title=f"{ev['what']}: reliability"))
    return (f'<div class="figs"><img id="reliability" alt="reliability plot" src="{uri}"></div>'
            '<p class="muted">Reliability: each dot is a bin of predictions with similar confidence; on the '
            'dashed line the model is right exactly as often as it claims.</p>')


def _members(card: Card) -> str:
    steps_by: dict[str, list[Step]] = {}
    for s in card.steps:
        steps_by.setdefault(s.author, []).append(s)
    rows, attrs = [], []
    for pid, m in sorted(card.members.items(), key=lambda kv: (kv[1].name, kv[0])):
        status = "revoked" if m.revoked else ("founder" if m.founder else ("admin" if m.admin else "member"))
        did = ", ".join(f"{s.kind} {s.id[:8]}" for s in steps_by.get(pid, [])) or "-"
        rows.append((_e(m.name or "-"), f"<code>{_e(pid)}</code>", _e(status), _e(m.role), _e(did)))
        attrs.append(f'data-member="{_e(pid)}" data-status="{_e(status)}"')
    return _table(["name", "peer id", "membership", "announced role", "steps in this model"], rows, attrs=attrs)


def _proof(card: Card) -> str:
    rows, attrs = [], []
    for s in card.steps:
        cls = "ok" if s.signature == "valid" else "bad"
        rows.append((f"<code>{_e(s.id)}</code>", _e(s.kind), _who(card, s.author), _e(s.seq), _e(s.lamport),
                     _e(s.state), f'<span class="{cls}">{_e(s.signature)}</span>',
                     _e(", ".join(x[:8] for x in s.links) or "-")))
        attrs.append(f'data-entry="{_e(s.id)}" data-kind="{_e(s.kind)}" data-author="{_e(s.author)}"')
    return _table(["entry id", "kind", "author", "seq", "lamport", "state", "signature", "names"], rows, attrs=attrs)


def _use(card: Card) -> str:
    """Whether this node uses the model, and why (the keep decision after an aggregation)."""
    if not card.use:
        return ""
    cls = {"in use": "ok", "not kept": "bad"}.get(card.use["status"], "warn")
    return (f'<p id="use" class="{cls}" data-status="{_e(card.use["status"])}"><b>{_e(card.use["status"].capitalize())}'
            f'</b> on this node: {_e(card.use["why"])}.</p>')


def render(card: Card) -> str:
    """The card as one HTML document (no external resources)."""
    fails = [s for s in card.steps if (s.verification or {}).get("status") == "failed"]
    unchecked = [s for s in card.steps if (s.verification or {}).get("status") == "not checked"]
    verdict = ("bad", f"{len(fails)} aggregate(s) do NOT re-verify") if fails else (
        ("warn", f"{len(unchecked)} aggregate(s) not checked here (inputs not held)") if unchecked else
        ("ok", "every aggregate re-verifies here" if any(s.kind == "aggregate" for s in card.steps)
         else "no aggregate to re-verify"))
    verdict_words = {"ok": "The steps that combined members' models were recomputed here and match: ",
                     "warn": "Some combining steps could not be recomputed here: ",
                     "bad": "WARNING: a combining step does not match its recomputation: "}[verdict[0]] \
        + verdict[1] + "."
    if not any(s.kind == "aggregate" for s in card.steps):
        verdict_words = ("No step combined members' models into this one: nothing to recompute "
                         "(no aggregate to re-verify).")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Model card {_e(card.model_id)}</title>
<style>{CSS}</style></head>
<body data-model="{_e(card.model_id)}">
<h1>Model card: <code>{_e(card.model_id)}</code></h1>
<p class="muted">Consortium <b>{_e(card.consortium or "(none)")}</b>. Generated
{_e(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))} from this node's signed ledger, following
{_e(TEMPLATE)}; the audit annex after the caveats shows the records it was read from.</p>
{_use(card)}
{sections(card, _reliability(card))}
<h2 id="audit-annex">Audit annex</h2>
<p>Checks on this node: <span id="verdict" class="{verdict[0]}">{_e(verdict_words)}</span>
<span id="ledger-check" class="{"ok" if card.ledger_ok else "bad"}">{_e(card.ledger_check)}</span></p>
<h2>The model (annex)</h2>{_model_section(card)}
<h2>Who trained what</h2>{_training(card)}
<h2>Aggregation</h2>{_aggregates(card)}
<h2>Evaluations</h2>{_evaluations(card)}
<h2>Members and their roles</h2>{_members(card)}
<h2>Ledger entries that prove it</h2>
<p class="muted">Each id is the hash of the entry's signed bytes; <code>atd ledger show</code> prints them.</p>
{_proof(card)}
</body></html>
"""


def write(card: Card, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(card), encoding="utf-8")
    tmp.replace(out)
    return out
