"""Server-side HTML of the dashboard: one page, inline CSS, no scripts, no external resources.

Every value from the ledger or the registry is HTML-escaped (`_e`): entry bodies are
written by other nodes. The page refreshes itself every REFRESH_S seconds.
"""
from __future__ import annotations

import html
import time
from typing import Any, Iterable

REFRESH_S = 10

CSS = """
:root { --fg:#1d2430; --muted:#5d6b7e; --line:#dde3ea; --bg:#f6f8fa; --ok:#1a7f37; --bad:#c62828; --warn:#9a6700; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color:var(--fg); background:var(--bg); }
header { background:#1f3a5f; color:#fff; padding:14px 24px; }
header h1 { margin:0; font-size:20px; }
header .sub { color:#c9d6e8; font-size:13px; }
main { padding:16px 24px; max-width:1400px; }
section { background:#fff; border:1px solid var(--line); border-radius:6px; margin:0 0 16px; padding:12px 16px; }
h2 { font-size:16px; margin:0 0 8px; }
.cards { display:flex; gap:12px; flex-wrap:wrap; margin-bottom:16px; }
.card { background:#fff; border:1px solid var(--line); border-radius:6px; padding:10px 16px; min-width:140px; }
.card .n { font-size:24px; font-weight:600; }
.card .l { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
table { border-collapse:collapse; width:100%; }
th, td { text-align:left; padding:4px 8px; border-bottom:1px solid var(--line); vertical-align:top; }
th { color:var(--muted); font-weight:600; font-size:12px; }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size:12px; }
.ok { color:var(--ok); font-weight:600; } .bad { color:var(--bad); font-weight:600; } .warn { color:var(--warn); font-weight:600; }
.muted { color:var(--muted); } .run { color:#2f6fb3; font-weight:600; }
.tag { display:inline-block; padding:0 6px; border-radius:10px; background:#e8eef6; font-size:12px; margin-right:4px; }
.bar { background:#e8eef6; border-radius:3px; height:10px; width:160px; display:inline-block; vertical-align:middle; }
.bar > span { display:block; height:10px; background:#2f6fb3; border-radius:3px; }
img.cm { max-width:320px; border:1px solid var(--line); margin:4px 4px 0 0; }
.card.warn { border-color:var(--warn); background:#fff8e6; } .card.warn .n { color:var(--warn); }
.scroll { max-height:420px; overflow:auto; }
"""


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def _t(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "—"


def _table(headers: Iterable[str], rows: list[str], empty: str, cls: str = "") -> str:
    if not rows:
        return f'<p class="muted">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    return f'<div class="{cls}"><table><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'


def _metrics(m: dict, keys=("accuracy", "f1", "precision", "recall", "robust_accuracy", "n")) -> str:
    """The metrics as spans; accuracy with its 95 % interval where the view has one."""
    ci = m.get("accuracy_ci")
    interval = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if isinstance(ci, list) and len(ci) == 2 else ""
    parts = [f'<span class="metric" data-metric="{_e(k)}">{_e(k)} {m[k]:.3f}{interval if k == "accuracy" else ""}</span>'
             if isinstance(m[k], float)
             else f'<span class="metric" data-metric="{_e(k)}">{_e(k)} {_e(m[k])}</span>' for k in keys if k in m
             if k != "accuracy_ci"]
    return " · ".join(parts) or '<span class="muted">no metrics yet</span>'


def _size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _peers(s: dict) -> str:
    rows = []
    for m in s["members"]:
        flags = [f for f, on in (("this node", m["me"]), ("founder", m["founder"]), ("admin", m["admin"])) if on]
        if m.get("rotated_to"):
            state = f'<span class="muted">rotated to {_e(m["rotated_to"][:16])}</span>'
        elif m["revoked"]:
            state = '<span class="bad">revoked</span>'
        elif m["me"]:
            state = '<span class="ok">this node</span>'
        elif m["connected"]:
            state = '<span class="ok">connected</span>'
        elif m.get("expected"):  # it announced addresses: it should be reachable
            state = ('<span class="warn peer-warning" title="announced addresses but not connected to this node">'
                     '⚠ not connected</span>')
        else:
            state = '<span class="muted">not connected (no address announced)</span>'
        addrs = "<br>".join(f"<code>{_e(a)}</code>" for a in m["addrs"]) or '<span class="muted">no hello yet</span>'
        rows.append(f'<tr class="peer"><td>{_e(m["name"])}<br><code>{_e(m["peer_id"])}</code></td>'
                    f'<td>{_e(m["role"])} {"".join(f"<span class=tag>{_e(f)}</span>" for f in flags)}</td>'
                    f"<td>{state}</td><td>{addrs}</td></tr>")
    return _table(("member", "role", "state", "addresses"), rows, "no members yet")


def _timeline(s: dict) -> str:
    rows = [f'<tr><td class="mono">{e["lamport"]}</td><td>{_e(_t(e["stored"]))}</td>'
            f'<td><span class="tag">{_e(e["kind"])}</span></td><td>{_e(e["author"])} <span class="muted">#{e["seq"]}</span></td>'
            f'<td>{_e(e["summary"])}</td><td class="ok">{"✓ verified" if e["verified"] else ""}</td>'
            f'<td><code>{_e(e["id"][:12])}</code></td></tr>' for e in s["timeline"]]
    return _table(("lamport", "stored here", "kind", "author", "what", "signature & chain", "entry"), rows,
                  "the ledger is empty", "scroll")


def _published(s: dict) -> str:
    rows = [f'<tr><td><code>{_e(p["id"][:12])}</code></td><td>{_e(p["kind"])}</td><td>{_e(p["author"])}</td>'
            f'<td>{_e(p["part"])}</td><td>{_e(p["model"])}</td><td class="carries">{_e(p.get("carries", ""))}</td>'
            f'<td>{_size(p["size"])}</td><td>{_metrics(p["metrics"], ("accuracy", "f1")) if p["kind"] == "weights" else "—"}</td>'
            f'<td>{"<span class=ok>held</span>" if p["held"] else "<span class=muted>not here</span>"}</td></tr>'
            for p in s["published"]]
    return _table(("entry", "kind", "author", "part", "model", "carries", "size", "metrics", "blob"),
                  rows, "nothing published yet (atd publish-weights / share-features)")


def _aggregates(s: dict) -> str:
    rows = []
    for a in s["aggregates"]:
        v = a["verify"]
        cls = {"verified": "ok", "failed": "bad"}.get(v["status"], "warn")
        inputs = "<br>".join(f'<code>{_e(i["id"][:12])}</code> {_e(i["author"])}' for i in a["inputs"])
        weights = ", ".join(f"{w:.4f}" for w in a["weights"])
        rows.append(f'<tr class="aggregate"><td><code>{_e(a["id"][:12])}</code></td><td>{_e(a["author"])}</td>'
                    f'<td>{_e(a["mode"])}</td><td>{_e(a["weighting"])}</td><td>{inputs}</td><td>{_e(weights)}</td>'
                    f'<td><code>{_e(a["blob"][:12])}</code></td>'
                    f'<td class="{cls} verify-status" title="{_e(v["detail"])}">{_e(v["status"])}</td></tr>')
    return _table(("entry", "author", "mode", "weighting", "inputs", "weights", "result", "verify"), rows,
                  "no aggregates yet (atd aggregate)")


def _models(s: dict) -> str:
    rows = []
    for m in s["models"]:
        imgs = [_thumb(f'/models/{_e(m["id"])}/confusion.png')] if m["confusion"] else []
        lines = [f'<div>training test split: {_metrics(m["metrics"])}</div>'] if m["metrics"] else []
        for c in m["classified"][-3:]:
            lines.append(f'<div>classify {_e(c["data"])} {_e(c["split"])}: {_metrics(c["metrics"])}</div>')
            if c.get("png"):
                imgs.append(_thumb(f'/classify/{_e(c["png"])}'))
        rows.append(f'<tr class="model"><td><code>{_e(m["id"])}</code><br><span class="muted">{_t(m["created"])}</span>'
                    + (f'<br><span class="tag default-model" title="{_e(m.get("in_use_why", ""))}">in use: default for '
                       'atd classify and atd predict</span>' if m.get("default") else "")
                    + (f'<br><span class="tag not-kept" title="{_e(m["not_kept"])}">not kept: the node kept its own '
                       'model</span>' if m.get("not_kept") else "")
                    + f'</td><td>{_e(m["kind"])}</td><td>{_e(m["model"])}<br><span class="muted">{_e(m["arch"])}</span></td>'
                    f'<td>{_e(m["classes"])}</td><td>{_e(m["samples"])}</td>'
                    f'<td>{"".join(lines) or "<span class=muted>no metrics yet</span>"}</td><td>{"".join(imgs)}</td></tr>')
    return _table(("model", "made by", "architecture", "classes", "samples", "metrics", "confusion"), rows,
                  "no models yet (atd train)")


def _thumb(src: str) -> str:
    """A confusion-matrix thumbnail that opens the full-size PNG."""
    return f'<a class="cm-link" href="{src}" target="_blank"><img class="cm" alt="confusion matrix" src="{src}"></a>'


def _charts(s: dict) -> str:
    from atdnode.report.dashboard.charts import accuracy_chart, bytes_chart

    names = {m["peer_id"]: m["name"] for m in s["members"]}
    traffic = sorted(((names.get(p, p[:12]), int(v[0]), int(v[1])) for p, v in s.get("bytes_by_peer", {}).items()),
                     key=lambda r: -(r[1] + r[2]))
    return (f'<h3>Accuracy per model</h3>{accuracy_chart(s["models"])}'
            f'<h3>Stream bytes per peer</h3>{bytes_chart(traffic)}')


def _fetches(s: dict) -> str:
    rows = []
    for f in s["fetches"]:
        frac = f["fraction"]
        bar = (f'<span class="bar"><span style="width:{min(100.0, 100 * frac):.0f}%"></span></span> {100 * frac:.0f}%'
               if frac is not None else "")
        rows.append(f'<tr><td><code>{_e(f["blob"][:16])}</code></td><td>{bar}</td>'
                    f'<td>{_size(f["bytes"])} of {_size(f["size"])}</td><td>{_e(len(f["holders"]))}</td></tr>')
    return _table(("blob", "progress", "bytes", "holders"), rows,
                  f"no fetch running ({s['wanted']} announced blob(s) still wanted)")


def _split(s: dict) -> str:
    live = [f'<tr class="campaign"><td>{_e(c["algorithm"])}</td><td>{_e(c["state"])}</td>'
            f'<td>{_e(c["completed"])} of {_e(c["total"])} (open: {_e(c["round"])})</td><td>{_e(c["clients"])}</td>'
            f'<td>{_e(c["detail"])}</td></tr>' for c in s.get("campaigns", [])]
    served = _table(("served here", "state", "rounds done", "clients", ""), live, "") if live else ""
    rows = [f'<tr><td>{_e(v["server"])}</td><td>{_e(v["algorithm"])}</td><td>{_e(", ".join(map(str, v["tasks"])))}</td>'
            f'<td><code>{_e(v["id"][:12])}</code></td></tr>' for v in s["services"]]
    out = _table(("server", "algorithm", "tasks", "offer entry"), rows, "no split-learning server offers")
    recs = [f'<tr><td>{_e(r["side"])}</td><td>{_e(r["algorithm"])}</td><td>{_e(r["task"])}</td>'
            f'<td><code>{_e(r["client"])}</code></td><td><code>{_e(r["server"])}</code></td><td>{_e(r["rounds"])}</td>'
            f'<td>{_metrics(r["metrics"], tuple(r["metrics"]))}</td><td>{_t(r["written"])}</td></tr>' for r in s["split"]]
    return served + out + _table(("side", "algorithm", "task", "client", "server", "rounds", "metrics", "written"), recs,
                        "this node took part in no split-learning session")


PLAN_STATE_CLASS = {"done": "ok", "failed": "bad", "running": "run", "declined": "muted", "waiting": "muted"}
PLAN_STATE_TITLE = {"done": "its result is on the ledger", "failed": "it recorded a failure (the reason beside it)",
                    "running": "its inputs are here: the member is carrying it out (no result yet)",
                    "waiting": "waiting for its inputs, its own earlier steps or the member's decision",
                    "declined": "the member declined the plan: it runs nothing of it"}


def _plans(s: dict) -> str:
    """Per plan, one row per step and member: its state (done, running, failed with the
    reason, waiting, declined), its metrics and who it went on without."""
    out = []
    for p in s.get("plans", []):
        head = (f'<h3>{_e(p["name"])} <span class="sub">by {_e(p["author"])} · <code>{_e(p["id"][:12])}</code> · '
                f'{_e(p["done"])} of {_e(p["total"])} done'
                + "".join(f' · <span class="plan-count {k}">{_e(n)} {_e(k)}</span>'
                          for k, n in (p.get("states") or {}).items() if n and k != "done") + "</span></h3>")
        if p.get("invalid"):
            out.append(head + f'<p class="bad plan-invalid">members decline it: {_e(p["invalid"])}</p>')
            continue
        rows = []
        for r in p["steps"]:
            state = r["state"]
            why = r["reason"] or (("without " + ", ".join(r["missing"])) if r["missing"] else "")
            rows.append(f'<tr class="plan-step {_e(state)}"><td>{_e(r["step"])}</td><td>{_e(r["kind"])}</td>'
                        f'<td>{_e(r["member"])}</td><td>{_e(r["decision"])}</td>'
                        f'<td class="{PLAN_STATE_CLASS.get(state, "")} plan-state" data-step="{_e(r["step"])}" '
                        f'data-member="{_e(r["member"])}" title="{_e(PLAN_STATE_TITLE.get(state, ""))}">{_e(state)}</td>'
                        f'<td>{_metrics(r.get("metrics") or {})}</td><td class="plan-why">{_e(why)}</td></tr>')
        out.append(head + _table(("step", "kind", "member", "decision", "state", "metrics", "why"), rows, ""))
    return "".join(out) or '<p class="muted">no plans (`atd plan propose FILE`)</p>'


def render_page(s: dict) -> str:
    node = s["node"]
    n_members = sum(1 for m in s["members"] if not m["revoked"])
    verified = sum(1 for a in s["aggregates"] if a["verify"]["status"] == "verified")
    expected = [m for m in s["members"] if not m["me"] and not m["revoked"] and not m.get("rotated_to")]
    up = sum(1 for m in expected if m["connected"])
    warn = any(m.get("expected") and not m["connected"] for m in expected)
    cards = [(n_members, "members", "members"), (f"{up} of {len(expected)}", "members connected", "peers"),
             (s["entries"], "ledger entries", "entries"), (len(s["published"]), "published sets", "published"),
             (f'{verified}/{len(s["aggregates"])}', "aggregates verified", "aggregates"),
             (len(s["models"]), "models", "models")]
    card_html = "".join(f'<div class="card{" warn" if key == "peers" and warn else ""}" id="card-{key}">'
                        f'<div class="n">{_e(n)}</div><div class="l">{_e(label)}</div></div>' for n, label, key in cards)
    held = s["states"].get("held", 0)
    evidence = s["states"].get("evidence", 0)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>atd · {_e(node["name"])}</title><style>{CSS}</style></head>
<body><header><h1>atd · {_e(node["name"])} <span class="sub">({_e(node["role"] or "node")})</span></h1>
<div class="sub">consortium <b>{_e(s["consortium"] or "(no genesis yet)")}</b> · peer id <code>{_e(node["peer_id"])}</code>
 · up since {_t(node["started"])} · page built {_t(node["now"])}</div></header>
<main><div class="cards">{card_html}</div>
<section id="peers"><h2>Peers</h2>{_peers(s)}</section>
<section id="plans"><h2>Plans</h2>{_plans(s)}</section>
<section id="aggregates"><h2>Aggregates</h2>{_aggregates(s)}</section>
<section id="models"><h2>Models</h2>{_models(s)}</section>
<section id="charts"><h2>Charts</h2>{_charts(s)}</section>
<section id="published"><h2>Published weights and features</h2>{_published(s)}</section>
<section id="fetches"><h2>Running fetches</h2>{_fetches(s)}</section>
<section id="split"><h2>Split learning</h2>{_split(s)}</section>
<section id="ledger"><h2>Ledger timeline</h2>
<p class="muted">Newest first. Entries carry a Lamport clock, not a wall clock; “stored here” is when this node
stored the entry (its own clock, not signed). Every entry shown is in the log: its signature, hash chain and author's membership were checked
when it was merged ({held} held, {evidence} fork evidence not shown).</p>{_timeline(s)}</section>
</main></body></html>"""
