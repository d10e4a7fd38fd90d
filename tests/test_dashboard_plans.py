"""The dashboard's Plans view in a real headless Chromium: each member's progress per step.

Three real homes (signed entries, SQLite ledgers, blob stores) carry out a small plan by
`atdnode.plans.advance`, as `atd plan follow` does; `tests.vgs_homes.sync` does what the
daemons' replication does between them. node3's daemon (an OS process) serves the dashboard:
node3's own step failed, so nothing is left for it to run, and the page shows what its
ledger holds about everyone. The browser reads, per step and member: done, running (its
inputs are here, its result is not), failed with the member's one-line reason, waiting; then
node2's results arrive and a fresh load of the page shows them. A plan signed around the checks
is listed with the reason members decline it, and never breaks the page.
"""
from __future__ import annotations

import json
import re

import pytest

from atdnode.node import NodeConfig, NodeHome
from atdnode.plans import advance, decide, load_view, propose
from ledger import Ledger
from tests.browser import browser, text_of
from tests.nodeprocs import wait_until
from tests.vgs_homes import consortium, peer_ids, sync

NAMES = ["node1", "node2", "node3"]
MODEL = {"name": "vit_tiny_patch16_224", "img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "heads": 2}
PLAN = {"name": "browser-plan", "model": MODEL, "steps": [
    {"id": "t", "kind": "train", "members": NAMES, "data": "own", "epochs": 1, "batch_size": 32, "augment": False},
    {"id": "p1", "kind": "publish", "members": ["node1"], "model": "t"},
    {"id": "p2", "kind": "publish", "members": ["node2"], "model": "t"},
    {"id": "w", "kind": "wait", "members": ["node1"], "inputs": ["p1", "p2"]},
]}


def _policy(home: NodeHome, own: str) -> None:
    cfg = NodeConfig.load(home)
    cfg.extra["plans"] = {"auto_accept_from": ["node1"], "data": {"own": own}}
    cfg.extra.setdefault("compute", {})["device"] = "cpu"
    cfg.save(home)


def _states(dom: str) -> dict[tuple[str, str], tuple[str, str]]:
    """(step, member) -> (state shown, the row's reason cell) of every plan row on the page."""
    out = {}
    for row in re.findall(r'<tr class="plan-step [^"]*">.*?</tr>', dom, re.S):
        cell = re.search(r'data-step="([^"]*)" data-member="([^"]*)"[^>]*>([^<]*)<', row)
        why = re.search(r'<td class="plan-why">(.*?)</td>', row, re.S)
        out[(cell.group(1), cell.group(2))] = (cell.group(3), text_of(why.group(1)).strip())
    return out


@pytest.mark.slow  # a daemon process, two tiny trainings, Chromium
def test_plans_view_shows_each_members_progress_and_updates(short_tmp, procs) -> None:
    homes = consortium(short_tmp / "c", NAMES)
    _policy(homes[0], "digits?shard=1/2&limit=120")
    _policy(homes[1], "digits?shard=2/2&limit=120")
    _policy(homes[2], f"npz:{short_tmp / 'not-there.npz'}")  # node3's data is missing: its step fails
    plan = propose(homes[0], PLAN)
    decide(homes[0], plan, "accept")
    sync(homes)
    decide(homes[1], plan, "accept")  # node2 accepted (`atd plan accept`) and has not run anything yet
    assert advance(homes[2], plan).ran == ["t"]  # auto-accepted; its training fails
    assert advance(homes[0], plan).ran == ["t", "p1"]  # w waits for node2's weights
    sync(homes)
    ids = dict(zip(peer_ids(homes), NAMES))
    with Ledger.open(homes[2].ledger_db) as led:
        res = {(s, ids[m]): b for (s, m), b in load_view(led, plan).results.items()}
    reason = res[("t", "node3")]["reason"]
    assert res[("t", "node3")]["status"] == "failed" and reason

    procs(homes[2], "--dashboard", "127.0.0.1:0")
    url = wait_until(lambda: json.loads((homes[2].root / "daemon.json").read_text()).get("dashboard"), 30,
                     "the dashboard's address")
    dom = browser("--dump-dom", url)
    assert f'<meta http-equiv="refresh"' in dom  # the page reloads itself
    seen = _states(dom)
    assert seen == {("t", "node1"): ("done", ""), ("t", "node2"): ("running", ""), ("t", "node3"): ("failed", reason),
                    ("p1", "node1"): ("done", ""), ("p2", "node2"): ("waiting", ""), ("w", "node1"): ("waiting", "")}
    section = text_of(dom[dom.index('id="plans"'):dom.index('id="aggregates"')])
    assert "browser-plan" in section and "2 of 6 done" in section and "1 running" in section and "1 failed" in section
    acc = res[("t", "node1")]["metrics"]["accuracy"]
    row = re.search(r'<tr class="plan-step done"><td>t</td><td>train</td><td>node1</td>.*?</tr>', dom, re.S).group(0)
    assert f"accuracy {acc:.3f}" in text_of(row)  # the member's own step metrics

    assert advance(homes[1], plan).ran == ["t", "p2"]  # node2 carries out its steps; its results arrive
    sync(homes)
    seen = _states(browser("--dump-dom", url))
    assert seen[("t", "node2")] == ("done", "") and seen[("p2", "node2")] == ("done", "")
    assert seen[("w", "node1")] == ("running", "")  # its inputs are all here now
    assert seen[("t", "node3")] == ("failed", reason) and seen[("t", "node1")] == ("done", "")


def test_a_plan_no_member_can_carry_out_is_listed_with_why(tmp_path) -> None:
    """A member signs plans around the checks (a step with no kind or members, a shell step): the
    Plans view lists each with the reason members decline it, and the page still renders."""
    from atdnode import bodies
    from atdnode.node import NodeIdentity
    from atdnode.report.dashboard.page import _plans
    from atdnode.report.dashboard.view import ledger_view

    homes = consortium(tmp_path, NAMES)
    ids = peer_ids(homes)
    signer = NodeIdentity.load(homes[1]).signer
    with Ledger.open(homes[1].ledger_db) as led:
        for name, step in (("bare", {"id": "x"}), ("<b>shell</b>", {"id": "x", "kind": "shell", "members": ids})):
            bodies.append(led, signer, "plan", {"name": name, "created": 0, "late": "proceed", "members": ids,
                                                "steps": [step]})
    sync(homes)
    with Ledger.open(homes[0].ledger_db) as led:
        plans = ledger_view(led, NodeIdentity.load(homes[0]).public_key)["plans"]
    assert [(p["name"], p["author"], p["steps"]) for p in plans] == [("<b>shell</b>", "node2", []), ("bare", "node2", [])]
    assert "unknown step kind 'shell'" in plans[0]["invalid"] and "unknown step kind None" in plans[1]["invalid"]
    html = _plans({"plans": plans})
    assert html.count('class="bad plan-invalid">members decline it: ') == 2 and "<b>" not in html
