"""examples/rounds.toml and examples/pfesta.toml, each with one `atd plan run` on one `atd local up -n 3`
consortium (real daemons; the `atd` commands OS processes forked from one warm interpreter,
tests/atd_forkserver.py, so torch is imported once, not by each command): the daemons carry out
the `rounds` and `split` steps with the library functions `atd rounds` and `atd split join` call.
The FedAvg campaign is deterministic, so the by-hand `atd rounds` commands (another campaign
name, the same options, one round) give the global model of the example's round 0 (the same
tensors: the blobs' metadata name the campaign); a p-FESTA session is not (the embedder secret is
drawn at random), so there each member's step records the task metric of the comm record its
session wrote."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from atdnode.node import NodeConfig, NodeHome
from atdnode.split import load_records
from tests.atd_forkserver import forkserver
from tests.nodeprocs import _env, atd, ledger_rows

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = {"node1": "digits?shard=1/3&limit=150", "node2": "digits?shard=2/3&limit=150",
          "node3": "digits?shard=3/3&limit=150"}
SPLIT = {"node2": "digits?shard=1/2&limit=120", "node3": "digits?shard=2/2&limit=120"}
VIT = ["--model", "vit_tiny_patch16_224", "--img-size", "16", "--patch-size", "8", "--embed-dim", "32",
       "--depth", "1", "--heads", "2"]


def _tensors(home: Path, blob: str) -> dict:
    from safetensors.torch import load_file

    from atdnode.blobs import BlobStore

    return load_file(BlobStore(NodeHome.at(home).blobs_dir).path(blob))


def _atd(warm: list[str], *args: str, timeout: float = 300) -> str:
    """`atd ARGS` forked from the warm interpreter; its output (it must succeed)."""
    p = subprocess.run([*warm, *args], capture_output=True, text=True, env=_env(), timeout=timeout)
    assert p.returncode == 0, (args, p.stdout, p.stderr[-2000:])
    return p.stdout


def _atd_all(warm: list[str], *commands: list[str]) -> list[str]:
    """Several `atd` commands at once (each node its own); their outputs (all must succeed)."""
    procs = [subprocess.Popen([*warm, *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for c in commands]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    return [out for out, _ in outs]


def _plan_run(warm: list[str], d: Path, example: str) -> tuple[str, list[dict]]:
    out = _atd(warm, "plan", "run", str(ROOT / "examples" / example), "--home", str(d / "node1"), "--timeout", "500",
               timeout=600)
    plan = out.splitlines()[0].split()[1]
    return plan, json.loads(_atd(warm, "plan", "status", plan, "--home", str(d / "node1"), "--json"))["steps"]


@pytest.mark.slow  # three daemons as OS processes; a 2-round FedAvg campaign, its round 0 by hand, a p-FESTA campaign
def test_rounds_and_pfesta_examples_run_with_one_command(tmp_path: Path) -> None:
    d = tmp_path / "c"
    atd("local", "up", "-n", "3", "--dir", str(d), "--init-only")
    for name in ROUNDS:
        h = NodeHome.at(d / name)
        cfg = NodeConfig.load(h)
        # the data name `own` of the rounds example; the split example's `own` is set below
        cfg.extra["plans"] = {"auto_accept_from": ["node1"], "data": {"own": ROUNDS[name]}}
        cfg.extra["compute"] = {"device": "cpu"}
        cfg.save(h)
    with forkserver(tmp_path, _env()) as warm:
        try:
            _run_examples(warm, d)
        finally:
            atd("local", "down", "--dir", str(d), check=False)


def _run_examples(warm: list[str], d: Path) -> None:
    _atd(warm, "split", "configure", "--home", str(d / "node1"), "--task", "digit:classification:10", "--task",
         "ink:segmentation::0.5", "--rounds", "2", "--steps", "3", "--batch-size", "16", "--clients", "2",
         "--start-timeout", "120", "--round-timeout", "120")
    nodes = json.loads(_atd(warm, "local", "up", "--dir", str(d), "--role", "node1=pfesta-server", "--json"))
    ids = {n["name"]: n["peer_id"] for n in nodes}
    plan, rows = _plan_run(warm, d, "rounds.toml")
    assert [(r["step"], r["state"]) for r in rows] == [("fedavg", "done")] * 3, rows
    finals = {r["results"][0] for r in rows}
    assert len(finals) == 1  # every member ended on the same round-1 aggregate
    aggs = ledger_rows(d / "node2", "aggregate")
    final = next(r for r in aggs if r["id"] in finals)
    assert final["body"]["mode"] == "round" and final["body"]["round"] == 1
    assert len(final["body"]["inputs"]) == 3
    assert "verifies" in _atd(warm, "aggregate", "--verify", final["id"], "--home", str(d / "node3"))
    # by hand: `atd rounds` on every node at once, the example's options, one round, another campaign name
    by_hand = _atd_all(warm, *[["rounds", "--home", str(d / n), "--data", spec, "--rounds", "1", "--aggregator",
                                "fedavg", *VIT, "--local-epochs", "1", "--batch-size", "16", "--deadline", "300",
                                "--name", "by-hand", "--json"] for n, spec in ROUNDS.items()])
    blobs = {json.loads(out.splitlines()[-1])["blob"] for out in by_hand}
    assert len(blobs) == 1
    # the example's round 0: the global its round 1 started from (that aggregate's reference)
    first = next(r for r in aggs if r["body"].get("campaign") == final["body"]["campaign"]
                 and r["body"]["round"] == 0 and r["body"]["blob"] == final["body"]["reference"])
    hand, planned = _tensors(d / "node1", blobs.pop()), _tensors(d / "node1", first["body"]["blob"])
    init = _tensors(d / "node1", first["body"]["reference"])
    assert hand.keys() == planned.keys()
    # equal up to rounding (the entry-id order of the round's inputs differs between campaigns):
    # the gap is under 0.1 % of how far the round moved the weights
    moved = max((planned[k] - init[k]).abs().max().item() for k in planned)
    gap = max((planned[k] - hand[k]).abs().max().item() for k in planned)
    assert gap < 1e-3 * moved, (gap, moved)

    for name, spec in SPLIT.items():  # the data name `own` of the split example
        h = NodeHome.at(d / name)
        cfg = NodeConfig.load(h)
        cfg.extra["plans"]["data"] = {"own": spec}
        cfg.save(h)
    plan, rows = _plan_run(warm, d, "pfesta.toml")
    assert [(r["step"], r["member"], r["state"]) for r in rows] == [("digit", ids["node2"], "done"),
                                                                   ("ink", ids["node3"], "done")], rows
    for r, name in zip(rows, ("node2", "node3")):
        rec = [x for x in load_records(NodeHome.at(d / name)) if x["side"] == "client"][-1]
        assert rec["algorithm"] == "pfesta" and rec["server"] == ids["node1"] and rec["rounds"]
        assert r["metrics"] and r["metrics"] == {k: v for k, v in rec["metrics"].items()}
