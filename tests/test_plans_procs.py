"""A plan on `atd local up -n 3` (real daemons over libp2p, `atd` as OS processes): `atd plan run FILE`
on node1 proposes it and shows progress; the three daemons carry it out. node2's daemon is killed
mid-plan and started again; the plan finishes with nothing signed twice and its aggregate equals
the by-hand command's. A member that declines a second plan runs nothing of it.

The `atd` commands are forked from one warm interpreter (tests/atd_forkserver.py: torch and
scikit-learn imported once, not by each command); the daemons are started cold, as `atd local up`
starts them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tomllib
from pathlib import Path

import pytest

from atdnode.node import NodeConfig, NodeHome
from tests.atd_forkserver import forkserver
from tests.nodeprocs import ATD, _env, atd, ledger_rows, wait_until

ROOT = Path(__file__).resolve().parent.parent
SHARDS = {"node1": "digits?shard=1/3&limit=300", "node2": "digits?shard=2/3&limit=300",
          "node3": "digits?shard=3/3&limit=300"}


def _plan_file(tmp: Path, name: str) -> Path:
    """examples/vgs.toml up to the horizontal aggregate, a short base, a small ensemble (the
    fine-tune keeps a few epochs: the test kills a daemon in its middle)."""
    doc = tomllib.loads((ROOT / "examples" / "vgs.toml").read_text())
    steps = doc["steps"][:6]
    steps[0]["epochs"] = 1
    steps[2]["epochs"] = 2
    steps[5].update(pca_components=16, mlp_hidden="32", mlp_max_iter=100, rf_trees=20)
    model = "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in doc["model"].items())
    text = f'name = "{name}"\ndeadline = 600\n[model]\n{model}'
    for s in steps:
        text += "[[steps]]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in s.items())
    path = tmp / f"{name}.toml"
    path.write_text(text)
    return path


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return f'"{v}"' if isinstance(v, str) else repr(v)


def _run(warm: list[str], d: Path, path: Path) -> subprocess.Popen:
    return subprocess.Popen([*warm, "plan", "run", str(path), "--home", str(d / "node1"), "--timeout", "500"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _atd(warm: list[str], *args: str) -> str:
    """`atd ARGS` forked from the warm interpreter; its output (it must succeed)."""
    p = subprocess.run([*warm, *args], capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 0, (args, p.stdout, p.stderr[-2000:])
    return p.stdout


def _steps_of(d: Path, name: str, author: str) -> list[str]:
    return [r["body"]["step"] for r in ledger_rows(d / name, "plan_step") if r["author"] == author]


def _plan_id(d: Path, name: str) -> str:
    return wait_until(lambda: next((r["id"] for r in ledger_rows(d / "node1", "plan") if r["body"]["name"] == name),
                                   None), 60, f"plan {name} signed")


@pytest.mark.slow  # three daemons as OS processes carry out two plans, tiny ViTs trained
def test_daemons_carry_out_a_plan_across_a_kill_and_a_member_that_declines_runs_nothing(tmp_path: Path) -> None:
    d = tmp_path / "c"
    atd("local", "up", "-n", "3", "--dir", str(d), "--init-only")
    for name, spec in SHARDS.items():
        h = NodeHome.at(d / name)
        cfg = NodeConfig.load(h)
        # node3 decides by hand (`atd plan accept|decline`); node1 and node2 trust node1's plans
        trusted = [] if name == "node3" else ["node1"]
        cfg.extra["plans"] = {"auto_accept_from": trusted, "data": {"own": spec, "eval": "digits"}}
        cfg.extra["compute"] = {"device": "cpu"}
        cfg.save(h)
    up = subprocess.Popen([*ATD, "local", "up", "--dir", str(d), "--json"], env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)  # the daemons start while the fork server imports
    try:
        with forkserver(tmp_path, _env()) as warm:
            out, err = up.communicate(timeout=300)
            assert up.returncode == 0, err[-2000:]
            _carry_out_two_plans(warm, tmp_path, d, json.loads(out))
    finally:
        atd("local", "down", "--dir", str(d), check=False)


def _carry_out_two_plans(warm: list[str], tmp_path: Path, d: Path, nodes: list[dict]) -> None:
    ids = {n["name"]: n["peer_id"] for n in nodes}
    run = _run(warm, d, _plan_file(tmp_path, "short"))
    plan = _plan_id(d, "short")
    _atd(warm, "ledger", "wait", plan, "--home", str(d / "node3"))
    assert not _steps_of(d, "node1", ids["node3"])  # nothing runs on node3 before it accepts
    _atd(warm, "plan", "accept", plan, "--home", str(d / "node3"))
    # node2's daemon is killed (SIGKILL) in the middle of its fine-tune step
    log = d / "node2" / "logs" / "daemon.log"
    wait_until(lambda: f"plan {plan[:16]}: step finetune starts" in log.read_text(), 300, "node2's finetune")
    os.kill(nodes[1]["pid"], signal.SIGKILL)
    wait_until(lambda: not json.loads(_atd(warm, "local", "status", "--dir", str(d), "--json"))[1]["running"], 30,
               "node2's daemon to die")
    _atd(warm, "local", "up", "--dir", str(d))  # node2's daemon again: it resumes the plan by itself
    out, err = run.communicate(timeout=500)
    assert run.returncode == 0, (out, err[-2000:])
    assert "horizontal" in out and "7 of 7 member steps done" in out, out
    def status_on_node3() -> dict:  # once node3's daemon merged node1's last plan_step
        got = json.loads(_atd(warm, "plan", "status", plan, "--home", str(d / "node3"), "--json"))
        return got if {r["state"] for r in got["steps"]} == {"done"} else {}

    status = wait_until(status_on_node3, 60, "every step done on node3's ledger")
    # nothing signed twice: one plan_step per member and step, one weights entry per publish
    assert sorted(_steps_of(d, "node1", ids["node2"])) == ["finetune", "pub2"]
    assert f"plan {plan[:16]}: step finetune done" not in log.read_text().split("listening on")[1]  # killed mid-step
    weights = [r for r in ledger_rows(d / "node1", "weights") if r["author"] == ids["node2"]]
    assert len(weights) == 1
    # the horizontal aggregate names all three extractors, verifies on node3, and is the blob
    # the by-hand command makes from the same inputs
    h = next(r for r in status["steps"] if r["step"] == "horizontal")["results"][0]
    _atd(warm, "ledger", "wait", h, "--home", str(d / "node3"))
    assert "verifies" in _atd(warm, "aggregate", "--verify", h, "--home", str(d / "node3"))
    agg = next(r for r in ledger_rows(d / "node3", "aggregate") if r["id"] == h)
    assert len(agg["body"]["inputs"]) == 3 and weights[0]["id"] in agg["body"]["inputs"]
    by_hand = json.loads(_atd(warm, "aggregate", "--home", str(d / "node1"), "--mode", "horizontal", "--inputs",
                              ",".join(agg["body"]["inputs"]), "--pca-components", "16", "--mlp-hidden", "32",
                              "--mlp-max-iter", "100", "--rf-trees", "20", "--json"))
    assert by_hand["blob"] == agg["body"]["blob"]

    # a second plan: node3 declines it; its daemon runs nothing, the others go on without it
    before = {r["id"] for r in ledger_rows(d / "node3") if r["author"] == ids["node3"]}
    run = _run(warm, d, _plan_file(tmp_path, "without-node3"))
    plan2 = _plan_id(d, "without-node3")
    _atd(warm, "ledger", "wait", plan2, "--home", str(d / "node3"))
    _atd(warm, "plan", "decline", plan2, "--home", str(d / "node3"), "--reason", "no capacity this week")
    out, err = run.communicate(timeout=500)
    assert run.returncode == 0, (out, err[-2000:])
    rows = json.loads(_atd(warm, "plan", "status", plan2, "--home", str(d / "node1"), "--json"))["steps"]
    assert {r["state"] for r in rows if r["member"] == ids["node3"]} == {"declined"}
    h2 = next(r for r in rows if r["step"] == "horizontal")
    assert h2["state"] == "done" and h2["missing"] == [ids["node3"]]
    mine = [r for r in ledger_rows(d / "node3") if r["author"] == ids["node3"] and r["id"] not in before]
    assert [r["kind"] for r in mine if r["kind"] != "hello"] == ["plan_decision"]  # its decline, nothing else
