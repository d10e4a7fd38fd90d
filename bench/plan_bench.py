"""The README's VGS-ATD walkthrough by hand vs as one plan (examples/vgs.toml), on `atd local up -n 3`.

By hand: the walkthrough's bash block, run as written (every `atd` a fresh process). As a plan:
`atd local up`, each node's `[plans]` table (data names -> its shard, auto-accept node1's
plans), one `atd plan run examples/vgs.toml` on node1 (the three daemons carry the plan out;
the command returns once every member's every step has its result), then node2 verifies
node1's horizontal aggregate (the walkthrough's last step), `atd local down`.
Prints JSON: both wall times and their ratio (plan / by hand), whether the horizontal aggregates
are the same blob in both runs (deterministic training: they should be), and the coordination
overhead per step: from the moment the step's inputs were stored in the member's ledger (the
entries named by the input steps' results and the member's own previous step) to the step's start.

    PYTHONPATH=. nice -n 10 python3 bench/plan_bench.py [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from atdnode.node import NodeConfig, NodeHome  # noqa: E402
from atdnode.plans import load_view  # noqa: E402
from atdnode.plans.spec import step_inputs  # noqa: E402
from ledger import Ledger  # noqa: E402

SHARDS = {"node1": "digits?shard=1/3&limit=300", "node2": "digits?shard=2/3&limit=300",
          "node3": "digits?shard=3/3&limit=300"}
ATD = [sys.executable, "-m", "cli.app"]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", ATD_PROGRESS="0")
    return env


def atd(*args: str) -> str:
    p = subprocess.run([*ATD, *args], capture_output=True, text=True, env=_env())
    if p.returncode:
        raise SystemExit(f"atd {' '.join(args)} failed: {p.stderr.strip()[-500:]}")
    return p.stdout.strip()


def walkthrough() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- walkthrough: vgs -->\n```bash\n") + len("<!-- walkthrough: vgs -->\n```bash\n")
    return text[start:text.index("```", start)]


def horizontal_blob(home: Path) -> str:
    with Ledger.open(NodeHome.at(home).ledger_db) as led:
        return next(e.body["blob"] for e in led.query(kind="aggregate") if e.body.get("mode") == "horizontal")


def by_hand(work: Path) -> tuple[float, str]:
    work.mkdir(parents=True)
    script = work / "walkthrough.sh"
    script.write_text(f'atd() {{ {" ".join(ATD)} "$@"; }}\npython() {{ {sys.executable} "$@"; }}\n' + walkthrough())
    t = time.monotonic()
    subprocess.run(["bash", "-euo", "pipefail", str(script)], cwd=work, env=_env(), check=True,
                   capture_output=True)
    return time.monotonic() - t, horizontal_blob(work / "consortium" / "node1")


def as_plan(work: Path) -> tuple[float, str, str]:
    d = work / "consortium"
    t = time.monotonic()
    atd("local", "up", "-n", "3", "--dir", str(d), "--init-only")
    for name, spec in SHARDS.items():
        h = NodeHome.at(d / name)
        cfg = NodeConfig.load(h)
        cfg.extra["plans"] = {"auto_accept_from": ["node1"], "data": {"own": spec, "eval": "digits"}}
        cfg.save(h)
    atd("local", "up", "--dir", str(d))
    plan = atd("plan", "run", str(ROOT / "examples" / "vgs.toml"), "--home", str(d / "node1")).splitlines()[0].split()[1]
    with Ledger.open(NodeHome.at(d / "node1").ledger_db) as led:
        h = next(e.body["results"][0] for e in led.query(kind="plan_step") if e.body["step"] == "horizontal")
    atd("ledger", "wait", "--home", str(d / "node2"), h)
    atd("aggregate", "--home", str(d / "node2"), "--verify", h)
    took = time.monotonic() - t
    blob = horizontal_blob(d / "node1")
    return took, blob, plan


def overheads(d: Path, plan: str) -> list[dict]:
    """Per member and step: seconds from its inputs' arrival in the member's ledger (the entries the
    input steps' results name, their `plan_step` entries, the member's own previous `plan_step`)
    to the step's start in its daemon."""
    from atdnode.node import NodeIdentity

    out = []
    for name in SHARDS:
        ident = NodeIdentity.load(NodeHome.at(d / name))
        me = ident.peer_id
        with Ledger.open(NodeHome.at(d / name).ledger_db) as led:
            view = load_view(led, plan)
            prev = None
            for step in view.steps:
                res = view.results.get((step["id"], me))
                if res is None:
                    continue
                ids = [bytes.fromhex(r) for sid in step_inputs(step) for m in view.step(sid)["members"]
                       for r in (view.results.get((sid, m)) or {}).get("results", [])]
                ids += [e.id for e in led.query(kind="plan_step") if e.body.get("plan") == view.id and
                        e.body.get("step") in step_inputs(step)]
                if prev is not None:
                    ids.append(prev)
                stored = led.stored_at(ids)
                if stored:
                    out.append({"step": step["id"], "member": name,
                                "s": round(max(0.0, res["started"] - max(stored.values())), 3)})
                prev = next(e.id for e in led.query(kind="plan_step", author=ident.public_key) if e.body.get("plan") == view.id and e.body.get("step") == step["id"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="plan-bench-"))
    try:
        hand_s, hand_blob = by_hand(work / "by-hand")
    finally:
        subprocess.run([*ATD, "local", "down", "--dir", str(work / "by-hand" / "consortium")], env=_env(),
                       capture_output=True)
    try:
        plan_s, plan_blob, plan = as_plan(work / "plan")
        steps = overheads(work / "plan" / "consortium", plan)
        over = [x["s"] for x in steps]
    finally:
        subprocess.run([*ATD, "local", "down", "--dir", str(work / "plan" / "consortium")], env=_env(),
                       capture_output=True)
    print(json.dumps({"by_hand_s": round(hand_s, 1), "plan_s": round(plan_s, 1), "ratio": round(plan_s / hand_s, 3),
                      "same_horizontal_blob": hand_blob == plan_blob, "horizontal_blob": plan_blob,
                      "step_start_overhead_s": {"n": len(over), "median": round(statistics.median(over), 3),
                                                "max": round(max(over), 3), "per_step": steps},
                      "cpus": os.cpu_count(), "load": os.getloadavg()[0]}, indent=2))


if __name__ == "__main__":
    main()
