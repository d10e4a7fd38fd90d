"""`atd report MODEL --out card.html`: the model card, opened in a real headless Chromium and
checked against the signed ledger it was made from.

Three homes (tests.vgs_homes.skewed_trio: a base published by a, fine-tuned and published by
a, b and c on npz files) are combined by a horizontal aggregate on a, scored once with
`atd classify`, and the card of the global model is rendered. The browser's DOM must name
exactly the entries that made the model (the aggregate and its three inputs), each with the author the ledger records; mark the aggregate re-verified;
list every member; carry the evaluations' confusion matrices as inline PNGs; and name no
file path. Before that annex, a reader sees Mitchell et al.'s sections in order: a plain
summary, the data owner's intended use and data description (set with `atd config set
card.*`), performance per site (one row per member that trained), metrics with n and 95 %
intervals, the reliability plot, limitations and the keep decision; the ledger check is
said in words. A forged aggregate of the same result (wrong weights, signed by a) must show as
failing, and an aggregate whose inputs are not held here as not checked.
"""
from __future__ import annotations

import base64
import re

import pytest
from typer.testing import CliRunner

from atdnode.blobs import BlobStore
from atdnode.learning import run_classify as classify
from atdnode.aggregation.horizontal import aggregate_horizontal
from atdnode.node import NodeIdentity
from cli.app import app
from ledger import Ledger, peer_id_from_public_key
from tests.browser import browser, text_of
from tests.vgs_homes import copy_homes, peer_ids, small_ensemble

runner = CliRunner()
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")]


@pytest.fixture
def skewed(vgs_template, tmp_path):
    template = vgs_template("skewed")
    return copy_homes(template, tmp_path / "homes")


def render(home, model: str, out, *more: str) -> str:
    r = runner.invoke(app, ["report", model, "--home", str(home.root), "--out", str(out), *more])
    assert r.exit_code == 0, (r.output, r.exception)
    assert out.is_file()
    return browser("--dump-dom", out.as_uri())


def rows(dom: str, attr: str) -> list[dict[str, str]]:
    """The data-* attributes of every element carrying `attr`."""
    out = []
    for tag in re.findall(r"<[a-z]+\s[^>]*" + attr + r'="[^"]*"[^>]*>', dom):
        out.append(dict(re.findall(r'data-([a-z]+)="([^"]*)"', tag)))
    return out


def test_model_card_matches_the_ledger(skewed, tmp_path):
    a, b, c = skewed
    with Ledger.open(a.ledger_db) as led:
        weights = led.query(kind="weights")
    tuned = weights[1:]  # a's base, then the three fine-tuned full sets
    res = aggregate_horizontal(a, inputs=[e.id.hex() for e in tuned], classifier="head",
                               options=small_ensemble())
    classify(a, "digits?limit=200", model=res.model_id)
    said = {"intended_use": "Second reader for handwritten digit triage in the demo ward",
            "data_description": "Scanned forms from three sites, 2019-2021, all writers adults"}
    for key, value in said.items():
        r = runner.invoke(app, ["config", "set", f"card.{key}", value, "--home", str(a.root)])
        assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["config", "set", "card.data_description", "see /srv/pacs/export", "--home", str(a.root)])
    assert r.exit_code != 0 and "file path" in str(r.exception or r.output)  # described, never located
    dom = render(a, res.model_id, tmp_path / "card.html", "--pdf", str(tmp_path / "card.pdf"))
    text = text_of(dom)
    # the reader's part, in the template's order, before the audit annex
    order = ["summary", "model-details", "intended-use", "factors", "metrics", "evaluation-data", "training-data",
             "quantitative-analyses", "ethical-considerations", "caveats", "keep-decision", "audit-annex"]
    at = [dom.find(f'id="{h}"') for h in order]
    assert all(i >= 0 for i in at) and at == sorted(at), dict(zip(order, at))
    assert "Mitchell et al. 2019" in text and all(v in text for v in said.values())
    summary = text_of(re.search(r'id="plain-summary">(.*?)</p>', dom, re.S).group(1))
    assert "right" in summary and "95 % confidence" in summary and "10 classes" in summary
    site_rows = re.findall(r"<tr>", re.search(r'data-table="per-site">(.*?)</table>', dom, re.S).group(1))
    assert len(site_rows) == 1 + 3  # a header and one row per member that trained
    quant = text_of(re.search(r'data-table="quantitative">(.*?)</table>', dom, re.S).group(1))
    assert quant.count("95 % CI") >= 4 and "atd classify" in quant
    assert 'id="reliability"' in dom and "ECE" in quant or "calibration" in quant
    assert re.search(r'data-field="limitations">.*<li>', dom, re.S)
    assert "ok:" not in text and "in log" not in text and "re-checked on this node" in text
    assert (tmp_path / "card.pdf").read_bytes()[:5] == b"%PDF-"  # printed by the same browser

    with Ledger.open(a.ledger_db) as led:
        agg = led.get(res.entry.id)
        expected = {agg.id.hex(): agg, **{e.id.hex(): e for e in tuned}}
        shown = {r["entry"]: r for r in rows(dom, "data-entry")}
        assert set(shown) == set(expected), (set(shown) ^ set(expected))
        for eid, r in shown.items():
            e = led.get(eid)
            assert r["kind"] == e.kind and r["author"] == peer_id_from_public_key(e.author)
    assert rows(dom, "data-aggregate") == [{"aggregate": res.entry.id.hex(), "verification": "verified"}]
    assert "every aggregate re-verifies here" in text and agg.body["blob"] in text
    for e in tuned:  # who trained on what: class counts that add up to the samples, a data fingerprint
        counts = e.body["class_counts"]
        assert sum(counts.values()) == e.body["samples"] and e.body["data_fp"][:16] in dom
        assert ", ".join(f"{c}: {n}" for c, n in counts.items()) in text
    members = {r["member"]: r["status"] for r in rows(dom, "data-member")}
    assert set(members) == set(peer_ids([a, b, c])) and members[peer_ids([a])[0]] == "founder"
    # the evaluation from `atd classify`, with its confusion matrix drawn from the recorded numbers
    assert "atd classify" in text and "accuracy" in text
    pngs = re.findall(r'src="data:image/png;base64,([^"]+)"', dom)
    assert pngs and all(base64.b64decode(p)[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    # nothing local: no home, no data file, no temp folder
    for leak in (str(tmp_path), str(a.root), ".npz", "/tmp/"):
        assert leak not in dom, leak


def test_model_card_shows_a_forged_or_unchecked_aggregate(skewed, tmp_path):
    a, b, c = skewed
    with Ledger.open(a.ledger_db) as led:
        tuned = led.query(kind="weights")[1:]
    res = aggregate_horizontal(a, inputs=[e.id.hex() for e in tuned], classifier="head",
                               options=small_ensemble())
    ident = NodeIdentity.load(a)
    with Ledger.open(a.ledger_db) as led:  # the same result claimed with other weights
        body = {**led.get(res.entry.id).body, "weights": [0.5, 0.25, 0.25]}
        forged = led.append(ident.signer, "aggregate", body).id.hex()
    dom = render(a, res.model_id, tmp_path / "forged.html")
    status = {r["aggregate"]: r["verification"] for r in rows(dom, "data-aggregate")}
    assert status == {res.entry.id.hex(): "verified", forged: "failed"}
    assert "do NOT re-verify" in text_of(dom)
    BlobStore(a.blobs_dir).path(tuned[1].body["blob"]).unlink()  # an input not held here
    dom = render(a, res.model_id, tmp_path / "unheld.html")
    status = {r["aggregate"]: r["verification"] for r in rows(dom, "data-aggregate")}
    assert status[res.entry.id.hex()] == "not checked"
