"""Hierarchical VGS-ATD over one horizontal and one vertical aggregate (the paper's phase 3
combines the earlier phases' global models, §3.3): C_i and n_i come from the signed entries."""
from __future__ import annotations

import math

import pytest

from atdnode.aggregation.lineage import group_stats
from atdnode.node import NodeIdentity
from ledger import Ledger
from tests.factories import cli_json as cli
from tests.vgs_homes import ENSEMBLE_ARGS, copy_homes, sync

pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")


@pytest.mark.slow  # fine-tunes and aggregates on three homes
def test_hierarchical_groups_one_horizontal_one_vertical(vgs_template, tmp_path):
    a, b, c = copy_homes(vgs_template("disjoint"), tmp_path / "h")
    with Ledger.open(a.ledger_db) as led:  # a: digits 0-2, b: 3-5, c: 6-9; each published its extractor
        wa, wb, wc = (led.query(kind="weights", author=NodeIdentity.load(h).public_key)[0] for h in (a, b, c))
    # phase-1-like horizontal global model on a (a, b); phase-2-like vertical global model on c (a, b, c)
    hor = cli("aggregate", "--home", str(a.root), "--mode", "horizontal", "--classifier", "head",
              "--inputs", f"{wa.id.hex()},{wb.id.hex()}")
    ver = cli("aggregate", "--home", str(c.root), "--mode", "vertical", *ENSEMBLE_ARGS,
              "--inputs", ",".join(w.id.hex() for w in (wa, wb, wc)))
    sync([a, b, c])

    res = cli("aggregate", "--home", str(b.root), "--mode", "hierarchical", *ENSEMBLE_ARGS,
              "--group", f"h={hor['entry']}", "--group", f"v={ver['entry']}")
    with Ledger.open(b.ledger_db) as led:
        entry = led.get(res["entry"])
        groups = entry.body["groups"]
        assert [g["entry"] for g in groups] == entry.body["inputs"] == [hor["entry"], ver["entry"]]
        made = [led.get(g["entry"]).body for g in groups]
        assert [m["mode"] for m in made] == ["horizontal", "vertical"]
        assert [m["weighting"] for m in made] == ["uniform", "uniform"]  # the paper's default (Eq. 2)
        # C_i: the union of the label spaces of the weight sets behind the group; n_i: how many
        # base models it averaged -- both read from the signed weights entries, not passed in
        expected = []
        for g in groups:
            inputs = [led.get(h) for h in led.get(g["entry"]).body["inputs"]]
            labels = {str(x) for e in inputs for x in e.body["labels"]}
            expected.append((len(labels), len(inputs)))
            assert group_stats(led, led.get(g["entry"]))[:2] == (len(labels), len(inputs))
    assert expected == [(6, 2), (10, 3)]  # h: digits 0-5 from a and b; v: 0-9 from a, b and c
    assert [(g["n_classes"], g["n_models"]) for g in groups] == expected
    # the paper's default for groups: sqrt of the class count (Eq. 11)
    assert entry.body["weighting"] == "sqrt-classes"
    assert res["weights"] == pytest.approx([math.sqrt(6) / (math.sqrt(6) + math.sqrt(10)),
                                            math.sqrt(10) / (math.sqrt(6) + math.sqrt(10))], abs=1e-12)
    counted = cli("aggregate", "--home", str(b.root), "--mode", "hierarchical", "--weighting", "model-count",
                  *ENSEMBLE_ARGS, "--group", f"h={hor['entry']}", "--group", f"v={ver['entry']}")
    assert counted["weights"] == pytest.approx([2 / 5, 3 / 5], abs=1e-12)  # Eq. 12
    sync([a, b, c])
    assert cli("aggregate", "--home", str(a.root), "--verify", res["entry"])["verified"]
    assert cli("aggregate", "--home", str(c.root), "--verify", counted["entry"])["verified"]
