"""One model in use, the same everywhere: `atd models`' mark, the dashboard's badge (read in
a real Chromium), the model card, and what `atd classify` / `atd predict` take without
`--model` (`atdnode.models.model_in_use`).

The registry holds a trained model and, newer, an aggregate whose keep decision (`choose`,
the policy `best`, on scores shaped as `judge_candidates` records them) kept the node's own
model: the newest record is not the one in use. The decision itself on real data is
`tests/test_keep_skewed.py`'s.
"""
from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from atdnode.models import model_in_use, resolve_model
from atdnode.aggregation.keep import choose
from atdnode.learning.predict import model_record
from atdnode.models import ModelRecord, ModelRegistry
from atdnode.node import NodeHome
from atdnode.report import collect_card as collect, write_card_html as write
from atdnode.report.card_html import render
from atdnode.report.dashboard.page import render_page
from atdnode.report.dashboard.view import models_view
from tests.browser import browser, text_of
from tests.factories import cli, make_consortium

CFG = {"name": "vit_tiny_patch16_224", "img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 1,
       "num_heads": 2, "in_chans": 1, "num_classes": 2}


def _record(created: float, provenance: dict) -> ModelRecord:
    return ModelRecord(model=dict(CFG), labels=["neg", "pos"], label_fp="f" * 16, samples=40,
                       metrics={"accuracy": 0.8, "n": 40}, blobs={"full": "ab" * 32},
                       provenance=provenance, created=created)


def _homes(root: Path, own_acc: float, cons_acc: float) -> tuple[NodeHome, str, str]:
    """A node whose registry holds its own trained model and a newer vertical aggregate judged
    against it; returns (home, own id, aggregate id)."""
    home = make_consortium(root, 1)[0]
    reg = ModelRegistry(home)
    own = reg.add(_record(1000.0, {"data": "npz:/secret/a.npz"}))
    scores = {"scored_on": "val", "data": "npz:/secret/a.npz",
              "own": {"model": own, "kind": "model", "accuracy": own_acc, "f1": own_acc, "n": 40},
              "consortium": {"model": "(new)", "kind": "ensemble", "accuracy": cons_acc, "f1": cons_acc, "n": 40}}
    kept, why = choose("best", scores)
    agg = reg.add(_record(2000.0, {"kind": "global-vertical", "candidates": scores, "kept": kept, "kept_why": why,
                                   "keep_policy": "best"}))
    return home, own, agg


def _starred(home: NodeHome) -> tuple[list[str], str]:
    out = cli("models", "--home", str(home.root))
    return [m for m in re.findall(r"^\* +([0-9a-f]{16})", out, re.M)], out


@pytest.mark.slow  # two Chromium processes
def test_a_kept_own_model_is_in_use_everywhere_and_the_rejected_aggregate_says_so(tmp_path: Path) -> None:
    home, own, agg = _homes(tmp_path / "h", own_acc=0.9, cons_acc=0.7)
    assert ModelRegistry(home).get("latest").id == agg  # the newest record is the rejected one
    use = model_in_use(home)
    assert use.record.id == own and use.not_kept is not None and use.not_kept.id == agg
    assert resolve_model(home, "latest").id == own and model_record(home, None).id == own  # classify, predict

    starred, out = _starred(home)
    assert starred == [own], out
    assert "keep policy: [aggregate] keep = best" in out and f"kept over the consortium's model {agg}" in out

    page = tmp_path / "dashboard.html"
    state = {"node": {"peer_id": "12D3KooWme", "name": "a", "role": "node", "addrs": [], "peers": [],
                      "started": 1.0, "now": 2.0},
             "consortium": "test", "entries": 1, "states": {"log": 1}, "wanted": 0, "split": [], "services": [],
             "members": [], "timeline": [], "published": [], "aggregates": [], "campaigns": [], "fetches": [],
             "models": models_view(home)}
    page.write_text(render_page(state))
    dom = browser("--dump-dom", page.as_uri())
    badged = [r for r in re.findall(r'<tr class="model">.*?</tr>', dom, re.S) if "default-model" in r]
    assert len(badged) == 1 and f"<code>{own}</code>" in badged[0]  # the dashboard agrees with the CLI
    (row,) = [r for r in re.findall(r'<tr class="model">.*?</tr>', dom, re.S) if f"<code>{agg}</code>" in r]
    assert "not kept: the node kept its own model" in text_of(row) and "default-model" not in row

    rejected = tmp_path / "rejected.html"
    write(collect(home, agg), rejected)
    seen = html.unescape(text_of(browser("--dump-dom", rejected.as_uri())))
    assert re.search(rf"Not kept on this node: the node kept its own model {own} \(policy best\): its own model "
                     r"scores 0\.900 > the consortium's 0\.700 \(accuracy\) on its val data", seen), seen[:800]
    card = collect(home)  # `atd report` without a model: the one in use
    assert card.model_id == own and card.use["status"] == "in use"
    assert f"In use on this node: kept over the consortium's model {agg}" in html.unescape(text_of(render(card)))


@pytest.mark.parametrize("own_acc,cons_acc", [(0.7, 0.9), (0.8, 0.8)])
def test_a_kept_aggregate_is_in_use(tmp_path: Path, own_acc: float, cons_acc: float) -> None:
    home, own, agg = _homes(tmp_path / "h", own_acc=own_acc, cons_acc=cons_acc)  # ties go to the consortium
    use = model_in_use(home)
    assert use.record.id == agg and use.not_kept is None and "the newest model, kept" in use.why
    assert _starred(home)[0] == [agg]
    assert collect(home, own).use["status"] == "not in use"
    assert [m["id"] for m in models_view(home) if m["default"]] == [agg]
