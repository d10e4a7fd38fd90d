"""Signed plans (atdnode.plans): the README's VGS-ATD walkthrough as one plan file on three nodes.

The homes are real (signed entries, SQLite ledgers, blob stores); `tests.vgs_homes.sync`
does what the daemons do between steps (merge every entry everywhere, copy the blobs a daemon
fetches). Each member advances the plan itself, with its own policy; the test drives the
members in turn until every one is finished (a bounded loop, no sleep).
"""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from atdnode import bodies
from atdnode.node import NodeConfig, NodeHome
from atdnode.plans import PlanError, advance, decide, load_view, progress, propose
from ledger import Ledger
from tests.factories import cli
from tests.vgs_homes import consortium, peer_ids, sync

ROOT = Path(__file__).resolve().parent.parent
VGS = ROOT / "examples" / "vgs.toml"
NAMES = ["node1", "node2", "node3"]
SHARDS = {"node1": "digits?shard=1/3&limit=300", "node2": "digits?shard=2/3&limit=300",
          "node3": "digits?shard=3/3&limit=300"}
SMALL = dict(pca_components=16, mlp_hidden="32", mlp_max_iter=100, rf_trees=20)  # the example's ensembles
SMALL_ARGS = ["--pca-components", "16", "--mlp-hidden", "32", "--mlp-max-iter", "100", "--rf-trees", "20"]
VIT = ["--model", "vit_tiny_patch16_224", "--img-size", "16", "--patch-size", "8", "--embed-dim", "32",
       "--depth", "1", "--heads", "2", "--batch-size", "16", "--no-augment"]


def _policy(home: NodeHome, name: str, **plans) -> None:
    cfg = NodeConfig.load(home)
    cfg.extra["plans"] = {"auto_accept_from": ["node1"], "data": {"own": SHARDS[name], "eval": "digits"}, **plans}
    cfg.extra.setdefault("compute", {})["device"] = "cpu"
    cfg.save(home)


def drive(homes: list[NodeHome], plan: str, rounds: int = 40):
    """Each member advances `plan` in turn, the daemons' replication between turns, until all finished."""
    for _ in range(rounds):
        advs = [advance(h, plan) for h in homes]
        sync(homes)
        if all(a.finished for a in advs):
            return advs
    raise AssertionError(f"plan {plan[:16]} not finished after {rounds} rounds: {[a.waiting for a in advs]}")


def _results(home: NodeHome, plan: str) -> dict[tuple[str, str], dict]:
    with Ledger.open(home.ledger_db) as led:
        return load_view(led, plan).results


def _doc(**change) -> dict:
    doc = tomllib.loads(VGS.read_text())
    doc.update(change)
    return doc


@pytest.fixture(scope="module")
def vgs(tmp_path_factory):
    """Three homes that ran examples/vgs.toml (node1 proposed it; node2, node3 auto-accepted)."""
    homes = consortium(tmp_path_factory.mktemp("plans"), NAMES)
    for h, n in zip(homes, NAMES):
        _policy(h, n)
    plan = propose(homes[0], _doc())
    decide(homes[0], plan, "accept")
    sync(homes)
    drive(homes, plan)
    return homes, plan


@pytest.mark.slow
def test_vgs_plan_runs_every_step_and_matches_by_hand(vgs):
    homes, plan = vgs
    ids = peer_ids(homes)
    res = _results(homes[0], plan)
    with Ledger.open(homes[0].ledger_db) as led:
        rows = progress(load_view(led, plan))
    assert {r["state"] for r in rows} == {"done"}, [r for r in rows if r["state"] != "done"]
    # the horizontal aggregate combined the three published extractors, in the plan's order
    pubs = [res[(s, m)]["results"][0] for s, m in (("base_pub", ids[0]), ("pub2", ids[1]), ("pub3", ids[2]))]
    h_entry = res[("horizontal", ids[0])]["results"][0]
    with Ledger.open(homes[1].ledger_db) as led:
        h_body = led.get(h_entry).body
    assert h_body["inputs"] == pubs and h_body["mode"] == "horizontal"
    # any member recomputes it: node2 verifies node1's aggregate from its inputs
    from atdnode.aggregation import verify_aggregate

    assert verify_aggregate(homes[1], h_entry) == h_body["blob"]
    # by hand: the same aggregate command on node1 gives the same result blob
    out = cli("aggregate", "--home", str(homes[0].root), "--mode", "horizontal", "--inputs", ",".join(pubs),
              *SMALL_ARGS)
    assert h_body["blob"] in out
    # by hand: node2's fine-tune command is the very run the plan made (same run key -> same model)
    with Ledger.open(homes[1].ledger_db) as led:
        base_blob = led.get(pubs[0]).body["blob"]
    by_hand = cli("train", "--home", str(homes[1].root), "--data", SHARDS["node2"], *VIT, "--epochs", "2",
                  "--lr", "1e-3", "--init-from", base_blob)
    assert f"model {res[('finetune', ids[1])]['model']}" in by_hand
    # the vertical aggregate on node1 used the features node2 and node3 sealed to it
    v_entry = res[("vertical", ids[0])]["results"][0]
    shared = [res[("share", m)]["results"][0] for m in ids[1:]]
    with Ledger.open(homes[0].ledger_db) as led:
        v_body = led.get(v_entry).body
    assert sorted(v_body["ensemble"]["features"]) == sorted(shared)
    # the global models classify digits well above chance (10 classes)
    for step in ("classify_h", "classify_v", "classify_hier"):
        assert res[(step, ids[0])]["metrics"]["accuracy"] > 0.3, (step, res[(step, ids[0])]["metrics"])


@pytest.mark.slow
def test_an_aggregate_step_carried_out_again_after_a_kill_signs_nothing_new(vgs):
    """Killed between the library call and the `plan_step` entry: carried out again, each aggregate
    step (horizontal; vertical with shared features; hierarchical, whose group models are entries
    too) finds the aggregate it signed instead of signing a second one."""
    from atdnode.plans import PlanPolicy
    from atdnode.plans.spec import step_inputs
    from atdnode.plans.steps import Inputs, run_step

    homes, plan = vgs
    ids = peer_ids(homes)
    with Ledger.open(homes[0].ledger_db) as led:
        view = load_view(led, plan)
        before = [e.id for e in led.query(kind="aggregate")]
    for sid in ("horizontal", "vertical", "hierarchical"):
        step = view.step(sid)
        entries = {ref: [r for m in view.step(ref)["members"] for r in view.results[(ref, m)]["results"]]
                   for ref in step_inputs(step)}
        got = run_step(homes[0], view.body, step, Inputs(entries=entries, own={}), PlanPolicy.load(homes[0]))
        assert got.results == view.results[(sid, ids[0])]["results"], sid
        assert got.model == view.results[(sid, ids[0])]["model"], sid  # the model registered then, not a second
    with Ledger.open(homes[0].ledger_db) as led:
        assert [e.id for e in led.query(kind="aggregate")] == before


@pytest.mark.slow
def test_an_aggregate_step_killed_before_registering_its_model_registers_it_again(vgs, tmp_path):
    """Killed between the aggregate entry and registering its model (node1's hierarchical step, on a
    copy of its home): carried out again, the step registers the model from the entry it finds (the
    record the run that was not killed wrote, keep decision included), so the classify step after it
    scores the model that run scored."""
    import shutil

    from atdnode.models import ModelRegistry
    from atdnode.plans import PlanPolicy
    from atdnode.plans.spec import step_inputs
    from atdnode.plans.steps import Inputs, run_step

    homes, plan = vgs
    me = peer_ids(homes)[0]
    home = NodeHome.at(shutil.copytree(homes[0].root, tmp_path / "node1"))
    with Ledger.open(home.ledger_db) as led:
        view = load_view(led, plan)
    agg = view.results[("hierarchical", me)]["results"][0]
    reg = ModelRegistry(home)
    (before,) = [r for r in reg.list() if r.provenance.get("aggregate") == agg]
    for rec in reg.list():  # the kill came before its record was written (and any later test's models)
        if rec.created >= before.created:
            reg.path(rec.id).unlink()
    policy = PlanPolicy.load(home)
    step = view.step("hierarchical")
    entries = {ref: [r for m in view.step(ref)["members"] for r in view.results[(ref, m)]["results"]]
               for ref in step_inputs(step)}
    got = run_step(home, view.body, step, Inputs(entries=entries, own={}), policy)
    assert got.results == [agg] and got.model and reg.get("latest").id == got.model
    unchanged = ("id", "created")  # the record `atd aggregate` wrote, keep decision included
    assert {k: v for k, v in reg.get(got.model).to_dict().items() if k not in unchanged} == \
        {k: v for k, v in before.to_dict().items() if k not in unchanged}
    scored = run_step(home, view.body, view.step("classify_hier"), Inputs(entries={}, own={}), policy)
    first = view.results[("classify_hier", me)]
    assert (scored.model, scored.metrics) == (first["model"], first["metrics"])  # the model it used, its scores


@pytest.mark.slow  # one round of a tiny ViT on 100 images
def test_a_rounds_step_does_not_wait_for_a_member_that_declined(tmp_path):
    """node2 declines a rounds plan and stays in the consortium: node1's rounds run without
    waiting for it (each round would otherwise wait for every member until `round_deadline`)."""
    homes = consortium(tmp_path, NAMES[:2])
    ids = peer_ids(homes)
    for h, n in zip(homes, NAMES):
        _policy(h, n)
    deadline = 60
    doc = {"name": "rounds-without-node2", "deadline": 600, "model": tomllib.loads(VGS.read_text())["model"],
           "steps": [{"id": "fedavg", "kind": "rounds", "members": NAMES[:2], "data": "own", "rounds": 1,
                      "aggregator": "fedavg", "batch_size": 16, "round_deadline": deadline}]}
    plan = propose(homes[0], doc)
    sync(homes)
    decide(homes[1], plan, "decline", "no capacity this week")
    sync(homes)
    adv = advance(homes[0], plan)
    assert adv.ran == ["fedavg"] and adv.finished
    res = _results(homes[0], plan)[("fedavg", ids[0])]
    assert res["status"] == "done" and res["seconds"] < deadline / 2, res
    with Ledger.open(homes[0].ledger_db) as led:
        agg = led.get(res["results"][0]).body
    assert agg["mode"] == "round" and agg["participants"] == [ids[0]] and agg["missing"] == [ids[1]]


@pytest.mark.slow
def test_member_that_declines_runs_nothing_and_others_go_on(vgs):
    homes, _ = vgs
    ids = peer_ids(homes)
    doc = tomllib.loads(VGS.read_text())
    doc["steps"] = doc["steps"][:6]  # base .. horizontal (train runs are finished ones: same run keys)
    doc["name"] = "without-node3"
    doc["steps"][5].update(SMALL)
    plan = propose(homes[0], doc)
    decide(homes[0], plan, "accept")
    sync(homes)
    decide(homes[2], plan, "decline", "no capacity this week")
    sync(homes)
    before = {e.id for e in Ledger.open(homes[2].ledger_db).query(author=NodeIdentity_pk(homes[2]))}
    drive(homes, plan)
    res = _results(homes[0], plan)
    assert not [k for k in res if k[1] == ids[2]]  # node3 recorded no step
    with Ledger.open(homes[2].ledger_db) as led:
        after = {e.id for e in led.query(author=NodeIdentity_pk(homes[2]))}
    assert after == before  # and signed nothing else
    h = res[("horizontal", ids[0])]
    assert h["status"] == "done" and h["missing"] == [ids[2]]
    # node1's base was published by the first plan: the same entry, not a second signature
    first = _results(homes[0], vgs[1])
    assert res[("base_pub", ids[0])]["results"] == first[("base_pub", ids[0])]["results"]
    with Ledger.open(homes[0].ledger_db) as led:
        assert len(led.get(h["results"][0]).body["inputs"]) == 2


@pytest.mark.slow
def test_late_member_is_left_out_after_the_deadline(vgs):
    """node3 neither accepts nor declines: node1 waits for its extractor until the deadline, then
    aggregates without it and records it as missing."""
    homes, _ = vgs
    ids = peer_ids(homes)
    _policy(homes[2], "node3", auto_accept_from=[])
    doc = tomllib.loads(VGS.read_text())
    doc.update(name="late", deadline=300, steps=doc["steps"][:6])
    doc["steps"][5].update(SMALL)
    plan = propose(homes[0], doc)
    decide(homes[0], plan, "accept")
    sync(homes)
    for _ in range(6):  # everything node1 and node2 can do before the deadline
        advs = [advance(h, plan) for h in homes]
        sync(homes)
    assert advs[0].waiting == ["horizontal"] and not advs[0].ran and advs[2].decision is None
    with Ledger.open(homes[0].ledger_db) as led:
        created = load_view(led, plan).body["created"]
    adv = advance(homes[0], plan, now=created + 301)
    assert adv.ran == ["horizontal"] and adv.finished
    h = _results(homes[0], plan)[("horizontal", ids[0])]
    assert h["status"] == "done" and h["missing"] == [ids[2]]


def NodeIdentity_pk(home: NodeHome) -> bytes:
    from atdnode.node import NodeIdentity

    return NodeIdentity.load(home).public_key


def _small_consortium(tmp_path: Path) -> list[NodeHome]:
    homes = consortium(tmp_path, NAMES)
    for h, n in zip(homes, NAMES):
        _policy(h, n)
    return homes


def test_unknown_step_kind_and_outsider_refused_at_proposal(tmp_path, capsys):
    homes = _small_consortium(tmp_path)
    doc = _doc()
    doc["steps"] = [dict(doc["steps"][0], kind="shell")]
    with pytest.raises(PlanError, match="unknown step kind 'shell'"):
        propose(homes[0], doc)
    doc = _doc()
    doc["steps"] = [dict(doc["steps"][0], members=["node1", "12D3KooWNotAMemberNotAMemberNotAMemberNotAMemb"])]
    with pytest.raises(PlanError, match="not in the consortium"):
        propose(homes[0], doc)
    with Ledger.open(homes[0].ledger_db) as led:
        assert not led.query(kind="plan")  # nothing signed
    # at the CLI: one line, exit 1
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[[steps]]\nid = "a"\nkind = "shell"\nmembers = ["node1"]\ncommand = "rm -rf /"\n')
    from cli.app import run

    capsys.readouterr()
    assert run(["plan", "propose", str(bad), "--home", str(homes[0].root)]) == 1
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1 and "unknown step kind 'shell'" in err


def test_member_checks_a_plan_signed_around_the_checks(tmp_path):
    """A hostile proposer signs a plan with an unknown step kind directly: members decline it, run nothing."""
    from atdnode.node import NodeIdentity

    homes = _small_consortium(tmp_path)
    ids = peer_ids(homes)
    body = {"name": "evil", "created": 0, "late": "proceed", "members": ids,
            "steps": [{"id": "x", "kind": "shell", "members": ids, "deadline": 60}]}
    with Ledger.open(homes[0].ledger_db) as led:
        plan = bodies.append(led, NodeIdentity.load(homes[0]).signer, "plan", body).id.hex()
    sync(homes)
    adv = advance(homes[1], plan)
    assert adv.finished and "unknown step kind" in adv.refused and adv.decision == "decline"
    with pytest.raises(PlanError, match="unknown step kind"):
        decide(homes[2], plan, "accept")
    with Ledger.open(homes[1].ledger_db) as led:
        assert not led.query(kind="plan_step")


def test_nothing_runs_before_accept_and_policy_refusal(tmp_path):
    homes = _small_consortium(tmp_path)
    _policy(homes[1], "node2", auto_accept_from=[])  # node2 decides by hand
    _policy(homes[2], "node3", kinds=["publish"])  # node3 never trains
    plan = propose(homes[0], _doc())
    sync(homes)
    adv = advance(homes[1], plan)
    assert adv.decision is None and adv.waiting and not adv.ran
    adv = advance(homes[2], plan)  # auto: declined by its policy, with the reason
    assert adv.decision == "decline"
    with pytest.raises(PlanError, match="already signed decline"):  # one decision per member and plan
        decide(homes[2], plan, "accept")
    with Ledger.open(homes[2].ledger_db) as led:
        assert "does not run train steps" in led.query(kind="plan_decision")[0].body["reason"]
    _policy(homes[1], "node2", kinds=["publish"], auto_accept_from=[])
    with pytest.raises(PlanError, match="does not run train steps"):  # accepting by hand checks the policy too
        decide(homes[1], plan, "accept")
    assert advance(homes[1], plan).decision is None


@pytest.mark.slow
def test_dashboard_shows_each_members_progress_per_step(vgs):
    from atdnode.node import NodeIdentity
    from atdnode.report.dashboard.page import _plans
    from atdnode.report.dashboard.view import ledger_view

    homes, plan = vgs
    with Ledger.open(homes[1].ledger_db) as led:
        state = ledger_view(led, NodeIdentity.load(homes[1]).public_key)
    shown = next(p for p in state["plans"] if p["id"] == plan)
    assert shown["author"] == "node1" and shown["done"] == shown["total"] == 16
    assert ("share", "node3", "accept", "done") in {(r["step"], r["member"], r["decision"], r["state"])
                                                    for r in shown["steps"]}
    html = _plans({"plans": [shown]})
    assert html.count('<tr class="plan-step done">') == 16 and "vgs-three-modes" in html
    evil = dict(shown, name="<script>x</script>", steps=[dict(shown["steps"][0], reason="<img src=x>", state="failed")])
    html = _plans({"plans": [evil]})
    assert "<script" not in html and "<img" not in html and '<tr class="plan-step failed">' in html


MEMBERS = {"12D3KooWaaaa", "12D3KooWbbbb"}


def _body(*steps: dict) -> dict:
    return {"name": "p", "created": 0, "late": "proceed", "members": sorted(MEMBERS), "steps": list(steps)}


TRAIN = {"id": "t", "kind": "train", "members": ["12D3KooWaaaa"], "data": "own"}


@pytest.mark.parametrize("steps,says", [
    ([dict(TRAIN, command="rm -rf /")], "train steps have no option 'command'"),
    ([dict(TRAIN, epochs="3")], "epochs must be int"),
    ([TRAIN, {"id": "p", "kind": "publish", "members": ["12D3KooWbbbb"], "model": "t"}],
     "publishes only a model it trained"),
    ([{"id": "a", "kind": "aggregate", "members": ["12D3KooWaaaa"], "mode": "horizontal", "inputs": ["p"]}],
     "names 'p', not an earlier step"),
    ([TRAIN, {"id": "a", "kind": "aggregate", "members": ["12D3KooWaaaa"], "mode": "horizontal", "inputs": ["t"]}],
     "names 't', a train step"),
    ([{"id": "a", "kind": "aggregate", "members": ["12D3KooWaaaa"], "mode": "hierarchical", "groups": {"g": "t"}}],
     "groups must map"),
    ([{"id": "s", "kind": "share_features", "members": ["12D3KooWaaaa"], "to": ["12D3KooWzzzz"]}],
     "12D3KooWzzzz is not in the consortium"),
    ([{"id": "j", "kind": "split", "members": ["12D3KooWaaaa"], "server": "12D3KooWzzzz", "task": "t",
       "data": "own"}], "12D3KooWzzzz is not in the consortium"),
    ([{"id": "r", "kind": "rounds", "members": sorted(MEMBERS), "data": "own"}], "rounds steps need 'rounds'"),
    ([{"id": "r", "kind": "rounds", "members": sorted(MEMBERS), "data": "own", "rounds": 2, "script": "x"}],
     "rounds steps have no option 'script'"),
    ([TRAIN, dict(TRAIN)], "unique id"),
    ([], "at least one step"),
])
def test_check_plan_refuses_what_no_member_can_carry_out(steps, says):
    from atdnode.plans import check_plan

    with pytest.raises(PlanError, match=says):
        check_plan(_body(*steps), MEMBERS)
    check_plan(_body(TRAIN), MEMBERS)  # the same checks pass a good plan


def test_a_plans_model_may_name_a_stem():
    """[model] stem (atd train --stem) is a plan's model key: checked by every member, built by
    each train step."""
    from atdnode.plans import check_plan
    from atdnode.plans.steps import _model_config

    model = {"name": "vit_tiny_patch16_224", "img_size": 16, "patch_size": 4, "embed_dim": 16, "depth": 1,
             "heads": 2, "stem": "conv"}
    check_plan(dict(_body(TRAIN), model=model), MEMBERS)
    assert _model_config({"model": model}).stem == "conv"
    with pytest.raises(PlanError, match="model: stem must be one of patch, conv, got 'cnn'"):
        check_plan(dict(_body(TRAIN), model=dict(model, stem="cnn")), MEMBERS)


@pytest.mark.slow
def test_a_result_naming_anothers_entry_is_left_out(vgs):
    """node3 signs its plan_step results naming node2's weights entry: node1 aggregates without it."""
    from atdnode.node import NodeIdentity

    homes, _ = vgs
    ids = peer_ids(homes)
    doc = tomllib.loads(VGS.read_text())
    doc.update(name="hostile", steps=doc["steps"][:6])
    doc["steps"][5].update(SMALL)
    plan = propose(homes[0], doc)
    decide(homes[0], plan, "accept")
    sync(homes)
    for _ in range(4):
        advs = [advance(h, plan) for h in homes[:2]]
        sync(homes)
    pub2 = _results(homes[0], plan)[("pub2", ids[1])]["results"]
    with Ledger.open(homes[2].ledger_db) as led:
        signer = NodeIdentity.load(homes[2]).signer
        bodies.append(led, signer, "plan_decision", {"plan": plan, "decision": "accept"})
        for step in ("finetune", "pub3"):
            bodies.append(led, signer, "plan_step", {"plan": plan, "step": step, "status": "done", "results": pub2})
    sync(homes)
    adv = advance(homes[0], plan)
    assert adv.ran == ["horizontal"] and advs[1].finished
    h = _results(homes[0], plan)[("horizontal", ids[0])]
    assert h["missing"] == [ids[2]]
    with Ledger.open(homes[0].ledger_db) as led:
        assert led.get(h["results"][0]).body["inputs"].count(pub2[0]) == 1


@pytest.mark.slow
def test_plan_run_proposes_accepts_and_follows(tmp_path, capsys):
    """`atd plan run FILE` on a plan of node1's alone: every step done, `atd plan status` says so."""
    import json

    from cli.app import run

    homes = _small_consortium(tmp_path)
    doc = VGS.read_text().split("[[steps]]")
    path = tmp_path / "solo.toml"
    path.write_text("[[steps]]".join(doc[:3]).replace("epochs = 3", "epochs = 1"))  # base + base_pub
    capsys.readouterr()
    assert run(["plan", "run", str(path), "--home", str(homes[0].root), "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    plan = out.splitlines()[0].split()[1]
    assert "step base: recorded" in out and "step base_pub: recorded" in out
    assert run(["plan", "status", plan, "--home", str(homes[0].root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    assert [(r["step"], r["state"]) for r in rows] == [("base", "done"), ("base_pub", "done")]
    with Ledger.open(homes[0].ledger_db) as led:
        assert [e.id.hex() for e in led.query(kind="weights")] == rows[1]["results"]


def test_daemon_runs_plans_unless_the_policy_says_no(tmp_path):
    """`[plans] daemon = false` keeps plans out of the daemon (then `atd plan follow`); a malformed
    value is a ConfigError naming the key."""
    from atdnode.errors import ConfigError
    from atdnode.plans import PlanPolicy, PlanService, plan_services

    homes = _small_consortium(tmp_path)
    assert [type(s) for s in plan_services(homes[0], NodeConfig.load(homes[0]))] == [PlanService]
    _policy(homes[0], "node1", daemon=False)
    assert plan_services(homes[0], NodeConfig.load(homes[0])) == [] and not PlanPolicy.load(homes[0]).daemon
    cfg = NodeConfig.load(homes[0])
    cfg.extra["plans"]["daemon"] = "no"
    with pytest.raises(ConfigError, match="plans.daemon"):
        PlanPolicy.from_config(cfg)
