"""Scores as people read them (`atd classify`, `atd train`): each number with its 95 %
interval and n, lines under 80 columns; the (!) of `atdnode.data.sanity` beside every
number a small split makes unreliable."""
from __future__ import annotations

from atdnode.data import caution_of
from atdnode.learning import interval_text as ci_text


def score_lines(m: dict, *, indent: str = "  ") -> list[str]:
    """The lines of a metrics dict (`atdnode.learning.metrics.classification_metrics`, with
    `per_class` names): per-class n and recall, the overall figures, the binary figures and
    calibration, each with its 95 % interval."""
    ci = m.get("ci") or {}
    c = caution_of(m)

    def mark(key: str) -> str:
        return c.mark(key) if c else ""

    out = []
    rows = m.get("per_class") or {}
    if rows:
        width = min(24, max(len("class"), *(len(k) for k in rows)))
        out.append(f"{indent}{'class':<{width}} {'n':>6}  recall (sensitivity) [95% CI]")
        for name, r in rows.items():
            out.append(f"{indent}{name[:width]:<{width}} {r['n']:>6}  {ci_text(r.get('recall'), r.get('recall_ci'))}")
    out.append(f"{indent}accuracy          {ci_text(m.get('accuracy'), ci.get('accuracy'))}{mark('accuracy')}"
               f"  n={m.get('n')}")
    out.append(f"{indent}balanced accuracy {ci_text(m.get('balanced_accuracy'), ci.get('balanced_accuracy'))}"
               f"{mark('recall')}")
    out.append(f"{indent}macro precision   {ci_text(m.get('precision'), ci.get('precision'))}{mark('precision')}")
    out.append(f"{indent}macro F1          {ci_text(m.get('f1'), ci.get('f1'))}{mark('f1')}")
    b = m.get("binary")
    if isinstance(b, dict):
        bci = b.get("ci") or {}
        pos = b.get("positive_class", "class 1")
        out.append(f"{indent}positive class {pos!r}:")
        out.append(f"{indent}  sensitivity {ci_text(b.get('sensitivity'), bci.get('sensitivity'))}"
                   f"  n={b.get('n_positive')}")
        out.append(f"{indent}  specificity {ci_text(b.get('specificity'), bci.get('specificity'))}"
                   f"  n={b.get('n_negative')}")
        if "auroc" in b:
            out.append(f"{indent}  AUROC       {ci_text(b.get('auroc'), bci.get('auroc'))}")
    cal = m.get("calibration")
    if isinstance(cal, dict):
        out.append(f"{indent}calibration error (ECE, {cal.get('bins')} bins) {ci_text(cal.get('ece'), cal.get('ci'))}")
    if "robust_accuracy" in m:
        out.append(f"{indent}robust accuracy (PGD) {ci_text(m['robust_accuracy'], None)}{mark('robust_accuracy')}")
    if c:
        out.append(indent + c.line())
    return out
