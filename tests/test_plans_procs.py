"""A plan on `atd local up -n 3` (real daemons over libp2p, `atd plan` as OS processes): one member's
follower and daemon are killed mid-plan and started again; the plan finishes with nothing signed twice."""
from __future__ import annotations

import os
import signal
import subprocess
import tomllib
from pathlib import Path

import pytest

from atdnode.node import NodeConfig, NodeHome
from tests.nodeprocs import ATD, _env, atd, atd_json, ledger_rows, wait_until

ROOT = Path(__file__).resolve().parent.parent
SHARDS = {"node1": "digits?shard=1/3&limit=300", "node2": "digits?shard=2/3&limit=300",
          "node3": "digits?shard=3/3&limit=300"}


def _plan_file(tmp: Path) -> Path:
    """examples/vgs.toml up to the horizontal aggregate, one epoch each, a small ensemble."""
    doc = tomllib.loads((ROOT / "examples" / "vgs.toml").read_text())
    steps = doc["steps"][:6]
    for s in steps:
        if s["kind"] == "train":
            s["epochs"] = 1
    steps[5].update(pca_components=16, mlp_hidden="32", mlp_max_iter=100, rf_trees=20)
    model = "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in doc["model"].items())
    text = f'name = "short"\ndeadline = 600\n[model]\n{model}'
    for s in steps:
        text += "[[steps]]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in s.items())
    path = tmp / "short.toml"
    path.write_text(text)
    return path


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return f'"{v}"' if isinstance(v, str) else repr(v)


def _follow(d: Path, name: str, plan: str) -> subprocess.Popen:
    return subprocess.Popen([*ATD, "plan", "follow", plan, "--home", str(d / name), "--timeout", "400"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _own_steps(d: Path, name: str, author: str) -> list[str]:
    return [r["body"]["step"] for r in ledger_rows(d / name, "plan_step") if r["author"] == author]


@pytest.mark.slow  # three daemons and their followers as OS processes, tiny ViTs trained
def test_plan_on_local_daemons_survives_kill_and_restart(tmp_path: Path) -> None:
    d = tmp_path / "c"
    atd("local", "up", "-n", "3", "--dir", str(d), "--init-only")
    for name, spec in SHARDS.items():
        h = NodeHome.at(d / name)
        cfg = NodeConfig.load(h)
        cfg.extra["plans"] = {"auto_accept_from": ["node1"], "data": {"own": spec, "eval": "digits"}}
        cfg.extra["compute"] = {"device": "cpu"}
        cfg.save(h)
    nodes = atd_json("local", "up", "--dir", str(d), "--json")
    ids = {n["name"]: n["peer_id"] for n in nodes}
    try:
        plan = atd("plan", "propose", str(_plan_file(tmp_path)), "--home", str(d / "node1")).stdout.strip()
        atd("plan", "accept", plan, "--home", str(d / "node1"))
        for n in ("node2", "node3"):
            atd("ledger", "wait", plan, "--home", str(d / n))
        procs = {n: _follow(d, n, plan) for n in SHARDS}
        # node2 is killed (follower and daemon, SIGKILL) as soon as its fine-tune is recorded
        wait_until(lambda: "finetune" in _own_steps(d, "node2", ids["node2"]), 300, "node2's finetune step")
        procs["node2"].kill()
        procs["node2"].wait()
        os.kill(nodes[1]["pid"], signal.SIGKILL)
        wait_until(lambda: not atd_json("local", "status", "--dir", str(d), "--json")[1]["running"], 30,
                   "node2's daemon to die")
        atd("local", "up", "--dir", str(d))  # node2's daemon again; then its follower
        procs["node2"] = _follow(d, "node2", plan)
        for n, p in procs.items():
            out, err = p.communicate(timeout=400)
            assert p.returncode == 0, (n, out, err[-2000:])
        status = atd_json("plan", "status", plan, "--home", str(d / "node3"), "--json")
        assert {r["state"] for r in status["steps"]} == {"done"}, status
        # nothing signed twice: one plan_step per member and step, one weights entry per publish
        mine = _own_steps(d, "node1", ids["node2"])
        assert sorted(mine) == ["finetune", "pub2"]
        weights = [r for r in ledger_rows(d / "node1", "weights") if r["author"] == ids["node2"]]
        assert len(weights) == 1
        # the horizontal aggregate names all three extractors and verifies on node3
        h = next(r for r in status["steps"] if r["step"] == "horizontal")["results"][0]
        atd("ledger", "wait", h, "--home", str(d / "node3"))  # as the walkthrough: the inputs are what verify needs
        assert "verifies" in atd("aggregate", "--verify", h, "--home", str(d / "node3")).stdout
        agg = next(r for r in ledger_rows(d / "node3", "aggregate") if r["id"] == h)
        assert len(agg["body"]["inputs"]) == 3 and weights[0]["id"] in agg["body"]["inputs"]
    finally:
        atd("local", "down", "--dir", str(d), check=False)
