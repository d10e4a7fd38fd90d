"""The reader-facing part of a model card, in the sections of Mitchell et al. 2019 ("Model
Cards for Model Reporting", FAT* '19, section 4): model details, intended use, factors,
metrics, evaluation data, training data, quantitative analyses, ethical considerations,
caveats and recommendations -- preceded by a plain-language summary and followed (in
`card_html`) by the audit annex read from the ledger.

Deviations from the template: "factors" is reported per site (the member that trained or
scored a model) and per class, the only groups atd knows; demographic factors are left to
the data owner's free text (`[card]`, `atdnode.report.card.card_statement`), since atd never sees
patient attributes. Every number carries n and a 95 % interval: the interval recorded by
`atdnode.learning.metrics`, or for a figure recorded without one (a peer's reported test
accuracy) Wilson's interval from its n.
"""
from __future__ import annotations

import html

from atdnode.learning import interval_text, wilson
from atdnode.report.card import Card

TEMPLATE = 'Mitchell et al. 2019, "Model Cards for Model Reporting" (FAT* \'19), section 4'
HOW_TO_SET = "not stated by the data owner (atd config set card.{key} \"...\")"
LOW_RECALL = 0.5  # a class recalled less often than this is named as a failure mode
HIGH_ECE = 0.1  # calibration error above this is named as a limitation
SMALL_N = 100  # fewer evaluated images than this: the intervals are wide, said in words


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def ci(value, interval) -> str:
    """"0.865 (95 % CI 0.810-0.906)", or "-" (`atdnode.learning.metrics.interval_text`)."""
    return interval_text(value, interval, words=True)


def _accuracy_ci(m: dict, details: dict | None = None) -> list[float] | None:
    rec = ((details or {}).get("ci") or {}).get("accuracy")
    if rec:
        return rec
    n, acc = m.get("n"), m.get("accuracy")
    if isinstance(n, int) and n > 0 and isinstance(acc, (int, float)):
        return wilson(int(round(acc * n)), n)
    return None


def _table(head: list[str], rows: list[list[str]], *, section: str = "") -> str:
    a = f' data-table="{_e(section)}"' if section else ""
    out = [f"<table{a}>", "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows]
    return "\n".join(out + ["</table>"])


def _best_eval(card: Card) -> dict | None:
    """The evaluation the summary quotes: the newest scoring by `atd classify`, else training's test split."""
    return card.evaluations[-1] if card.evaluations else None


def summary(card: Card) -> str:
    """The plain-language summary (what it is, how well, how sure, whether in use)."""
    ev = _best_eval(card)
    sites = sorted({s.author for s in card.steps if s.kind == "weights"})
    what = (f"This model sorts images into {len(card.labels)} classes "
            f"({', '.join(card.labels[:8])}{' ...' if len(card.labels) > 8 else ''}).")
    made = (f" It was trained on {card.samples} images" + (f" and combined from the work of {len(sites)} site(s)"
            if len(sites) > 1 else "") + "; the images never left the sites that hold them.")
    if ev:
        m, d = ev["metrics"], ev.get("details") or {}
        acc = m.get("accuracy")
        lo_hi = _accuracy_ci(m, d)
        perf = ""
        if isinstance(acc, float):
            perf = f" On {m.get('n')} held-out images ({ev['what']}) it was right {acc:.0%} of the time"
            if lo_hi:
                perf += f"; with 95 % confidence the true rate lies between {lo_hi[0]:.0%} and {lo_hi[1]:.0%}"
            perf += "."
        b = d.get("binary") or {}
        if isinstance(b.get("sensitivity"), float) and isinstance(b.get("specificity"), float):
            perf += (f" It finds {b['sensitivity']:.0%} of {b.get('positive_class', 'positive')} cases "
                     f"(sensitivity) and clears {b['specificity']:.0%} of the others (specificity).")
        if isinstance(m.get("n"), int) and m["n"] < SMALL_N:
            perf += f" That is fewer than {SMALL_N} images: treat these figures as rough."
    else:
        perf = " It has not been scored on held-out images yet: its performance is unknown."
    use = (" It is the model this node uses for predictions." if card.in_use else
           " It is NOT the model this node uses for predictions" + (f": {card.keep['kept_why']}."
                                                                     if card.keep.get("kept_why") else "."))
    return f'<p id="plain-summary">{_e(what + made + perf + use)}</p>'


def details(card: Card) -> str:
    rows = [["model id", f"<code>{_e(card.model_id)}</code>"], ["architecture", _e(card.arch)],
            ["made by", _e(card.made_by)], ["consortium", _e(card.consortium or "(none)")],
            ["classes", _e(", ".join(card.labels))],
            ["card template", _e(TEMPLATE)]]
    return _table(["", ""], rows, section="details")


def intended_use(card: Card) -> str:
    st = card.statement
    use = st.get("intended_use") or HOW_TO_SET.format(key="intended_use")
    out = st.get("out_of_scope_use") or HOW_TO_SET.format(key="out_of_scope_use")
    return (f'<h3>Intended use</h3><p data-field="intended_use">{_e(use)}</p>'
            f'<h3>Out-of-scope use</h3><p data-field="out_of_scope_use">{_e(out)}</p>'
            '<p class="muted">Always out of scope: images of another modality or body part than the training data, '
            'classes outside the list above, and any use as the sole basis of a clinical decision without a local '
            'clinical validation.</p>')


def factors(card: Card) -> str:
    """Per-site performance (each weights entry's reported test metrics) and per-class recall."""
    rows = []
    for s in card.steps:
        if s.kind != "weights" or not isinstance(s.body.get("metrics"), dict):
            continue
        m = s.body["metrics"]
        who = card.members.get(s.author)
        site = (who.name if who and who.name else s.author[-12:])
        rows.append([_e(site), _e(s.body.get("samples", "-")), _e(m.get("n", "-")),
                     _e(ci(m.get("accuracy"), _accuracy_ci(m))), _e(ci(m.get("f1"), None))])
    if not rows:  # trained here and not published: this node's own test split is the one site known
        own = next((ev for ev in card.evaluations if ev["what"] == "training test split"), None)
        if own is not None:
            m = own["metrics"]
            rows.append([_e("this node (" + card.made_by + ")"), _e(card.samples), _e(m.get("n", "-")),
                         _e(ci(m.get("accuracy"), _accuracy_ci(m, own.get("details")))),
                         _e(ci(m.get("f1"), ((own.get("details") or {}).get("ci") or {}).get("f1")))])
    site_table = (_table(["site", "training images", "test images (n)", "accuracy", "macro F1"], rows,
                         section="per-site") if rows else
                  '<p data-table="per-site">No site published test figures for this model\'s inputs: '
                  'per-site performance is unknown.</p>')
    ev = _best_eval(card)
    pc = ((ev or {}).get("details") or {}).get("per_class") or {}
    class_rows = [[_e(c), _e(r.get("n")), _e(ci(r.get("recall"), r.get("recall_ci")))] for c, r in pc.items()]
    class_table = ""
    if class_rows:
        class_table = (f"<p>Per class, on the evaluation quoted in the summary ({_e(ev['what'])}):</p>"
                       + _table(["class", "n", "recall (sensitivity)"], class_rows, section="per-class"))
    return ("<p>Sites (members that trained on their own data) are the groups atd can report; patient groups "
            "(age, sex, scanner) are for the data owner to describe below.</p><h3>Performance by site</h3>"
            + site_table + class_table)


def metrics_explained() -> str:
    return ("<p>Accuracy (share of images classified correctly) with Wilson's 95 % interval; balanced accuracy, "
            "macro precision and macro F1 (means over the classes present) with seeded bootstrap intervals "
            "(1000 resamples); for two classes, sensitivity and specificity (Wilson) and the area under the ROC "
            "curve (bootstrap); calibration: the expected calibration error over 15 confidence bins (Guo et al. "
            "2017) and a reliability plot. n is the number of images each figure rests on.</p>")


def evaluation_data(card: Card) -> str:
    rows = []
    for ev in card.evaluations:
        pc = (ev.get("details") or {}).get("per_class") or {}
        counts = ", ".join(f"{c}: {r.get('n')}" for c, r in pc.items()) or "-"
        rows.append([_e(ev["what"]), _e(ev.get("source")), _e(ev.get("split") or "-"),
                     _e(ev["metrics"].get("n", "-")), _e(counts)])
    if not rows:
        return "<p>None yet: run <code>atd classify</code> on held-out labelled images.</p>"
    return _table(["evaluation", "data (kind)", "split", "n", "images per class"], rows, section="evaluation-data")


def training_data(card: Card) -> str:
    desc = card.statement.get("data_description") or HOW_TO_SET.format(key="data_description")
    counts = ", ".join(f"{k}: {v}" for k, v in (card.class_counts or {}).items()) or "-"
    return (f'<p data-field="data_description">{_e(desc)}</p>'
            + _table(["", ""], [["images", _e(card.samples)], ["data source kind", _e(card.source_kind)],
                                ["images per class (this node's training split)", _e(counts)]], section="training"))


def quantitative(card: Card) -> str:
    rows = []
    for ev in card.evaluations:
        m, d = ev["metrics"], ev.get("details") or {}
        c = d.get("ci") or {}
        b = d.get("binary") or {}
        bc = b.get("ci") or {}
        cal = d.get("calibration") or {}
        rows.append([_e(ev["what"]), _e(m.get("n", "-")), _e(ci(m.get("accuracy"), _accuracy_ci(m, d))),
                     _e(ci(m.get("balanced_accuracy"), c.get("balanced_accuracy"))),
                     _e(ci(m.get("f1"), c.get("f1"))),
                     _e(ci(b.get("sensitivity"), bc.get("sensitivity"))) if b else "-",
                     _e(ci(b.get("specificity"), bc.get("specificity"))) if b else "-",
                     _e(ci(b.get("auroc"), bc.get("auroc"))) if b.get("auroc") is not None else "-",
                     _e(ci(cal.get("ece"), cal.get("ci"))) if cal else "-"])
    if not rows:
        return "<p>No evaluation recorded yet.</p>"
    return _table(["evaluation", "n", "accuracy", "balanced accuracy", "macro F1", "sensitivity", "specificity",
                   "AUROC", "calibration error (ECE)"], rows, section="quantitative")


def ethics() -> str:
    return ("<p>Privacy: the images stayed at the sites that hold them; members shared model weights (or "
            "encrypted features) and signed records, never images or patient data. Every step named below is "
            "signed by its author and re-checked here. Fairness across patient groups was not measured by atd "
            "(it never sees patient attributes).</p>")


def limitations(card: Card) -> list[str]:
    """Known limitations and failure modes, from the recorded figures and the data owner's text."""
    out = []
    if card.statement.get("limitations"):
        out.append(card.statement["limitations"])
    ev = _best_eval(card)
    if ev is None:
        out.append("Not evaluated on held-out images: performance unknown.")
    else:
        m, d = ev["metrics"], ev.get("details") or {}
        if isinstance(m.get("n"), int) and m["n"] < SMALL_N:
            out.append(f"Evaluated on only {m['n']} images: the intervals are wide.")
        for c, r in (d.get("per_class") or {}).items():
            if isinstance(r.get("recall"), float) and r["recall"] < LOW_RECALL:
                out.append(f"Class {c!r} is often missed: recall {ci(r['recall'], r.get('recall_ci'))} "
                           f"on {r.get('n')} images.")
        cal = d.get("calibration") or {}
        if isinstance(cal.get("ece"), float) and cal["ece"] > HIGH_ECE:
            out.append(f"Its stated confidence is poorly calibrated (ECE {cal['ece']:.3f}): do not read its "
                       f"probabilities as risks.")
        if (d.get("caution") or {}).get("reason"):
            out.append(f"Small evaluation set: {d['caution']['reason']}.")
    if len({s.author for s in card.steps if s.kind == 'weights'}) <= 1:
        out.append("Trained at one site: performance at other sites (other scanners, populations) is unknown.")
    out.append(f"Knows only the classes {', '.join(card.labels[:12])}: any other finding is forced into one of them.")
    return out


def caveats(card: Card) -> str:
    return "<ul data-field=\"limitations\">" + "".join(f"<li>{_e(x)}</li>" for x in limitations(card)) + "</ul>"


def keep_decision(card: Card) -> str:
    k = card.keep
    use = ("This is the model this node uses for <code>atd classify</code> and <code>atd predict</code>."
           if card.in_use else "This is not the model this node uses for predictions.")
    if not k.get("kept"):
        return f'<p data-field="keep">{use} No keep decision was recorded for it (it was not an aggregation ' \
               f'judged against the node\'s own model).</p>'
    cands = k.get("candidates") or {}
    rows = [[_e(name), _e((cands.get(name) or {}).get("model", "-"))[:16],
             _e(ci((cands.get(name) or {}).get("accuracy"), None)), _e((cands.get(name) or {}).get("n", "-"))]
            for name in ("own", "consortium") if name in cands]
    return (f'<p data-field="keep">{use} Policy <b>{_e(k.get("keep_policy", "?"))}</b>: kept '
            f'<b>{_e(k["kept"])}</b> because {_e(k.get("kept_why", "-"))}.</p>'
            + (_table(["candidate", "model", f"accuracy on its {cands.get('scored_on', '?')} data", "n"], rows,
                      section="keep") if rows else ""))


def render(card: Card, reliability: str) -> str:
    """Every reader-facing section, in the template's order (`reliability`: figures HTML)."""
    return f"""<h2 id="summary">Summary</h2>{summary(card)}
<h2 id="model-details">Model details</h2>{details(card)}
<h2 id="intended-use">Intended use</h2>{intended_use(card)}
<h2 id="factors">Factors</h2>{factors(card)}
<h2 id="metrics">Metrics</h2>{metrics_explained()}
<h2 id="evaluation-data">Evaluation data</h2>{evaluation_data(card)}
<h2 id="training-data">Training data</h2>{training_data(card)}
<h2 id="quantitative-analyses">Quantitative analyses</h2>{quantitative(card)}{reliability}
<h2 id="ethical-considerations">Ethical considerations</h2>{ethics()}
<h2 id="caveats">Caveats and recommendations (limitations, known failure modes)</h2>{caveats(card)}
<h2 id="keep-decision">Keep decision</h2>{keep_decision(card)}
"""
