"""`atd models`: how each model was made, latest metrics (incl. `atd classify`), fixed widths;
`atd models rm` / the size limit never remove a model a ledger entry serves;
`atd ledger show` prints when each entry was stored."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from atdnode.blobs import BlobStore
from atdnode.node import NodeConfig, NodeHome, init_home
from atdnode.models.gc import ModelServed
from atdnode.models import ModelRecord, ModelRegistry
from cli.app import app
from cli.commands.models import COLUMNS

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "vit_tiny_patch16_224", "--img-size", "16", "--patch-size", "4", "--embed-dim", "32",
        "--depth", "2", "--heads", "2", "--epochs", "1", "--batch-size", "32", "--lr", "3e-3"]
DATA = "digits?classes=0,1,2&limit=90"
runner = CliRunner()


def cli(*args: str) -> str:
    r = runner.invoke(app, list(args))
    assert r.exit_code == 0, (r.output, r.exception)
    return r.stdout


def train(home: Path, seed: int) -> dict:
    out = cli("train", "--home", str(home), "--data", DATA, *TINY, "--seed", str(seed), "--json")
    return json.loads(out[out.index("{"):])


def listed(home: Path) -> dict[str, dict]:
    return {m["id"]: m for m in json.loads(cli("models", "--home", str(home), "--json"))}


@pytest.mark.slow  # an atd process
def test_made_by_latest_metrics_rm_and_limit(tmp_path: Path) -> None:
    h = NodeHome.at(tmp_path / "n")
    init_home(h, consortium="demo")
    home = str(h.root)
    a, b = train(h.root, 0), train(h.root, 1)
    cli("publish-weights", "--home", home, "--model", a["id"], "--part", "full")
    agg = json.loads(cli("aggregate", "--home", home, "--mode", "horizontal", "--inputs",
                         json.loads(cli("ledger", "show", "--home", home, "--kind", "weights", "--json"))[0]["id"],
                         "--json"))
    g = agg["model"]
    ms = listed(h.root)
    assert {ms[a["id"]]["made_by"], ms[b["id"]]["made_by"], ms[g]["made_by"]} == {"trained", "horizontal"}
    assert ms[g]["made_by"] == "horizontal"
    # aggregation scored both candidates on the node's own data: `atd models` shows it
    c = agg["candidates"]
    assert ms[g]["latest_metrics"]["accuracy"] == c["consortium"]["accuracy"]
    assert ms[g]["latest_source"] == f"{c['data']} [{c['scored_on']}]" and agg["kept"] in ("own", "consortium", "raw-pixels")
    assert (f"candidates on its {c['scored_on']} data (balanced accuracy): own {c['own']['balanced_accuracy']:.3f}"
            in cli("models", "--home", home))
    # `atd classify` scores the aggregated model; `atd models` shows that score, not 0.000
    res = json.loads(cli("classify", "--home", home, "--data", DATA, "--model", g, "--json"))
    ms = listed(h.root)
    assert ms[g]["latest_metrics"]["accuracy"] == res["accuracy"] and ms[g]["latest_source"] == f"{DATA} [test]"
    table = cli("models", "--home", home).splitlines()
    grow = next(ln for ln in table if re.match(rf"[* ]  {g}  ", ln))  # after the in-use column
    assert "horizontal" in grow and f"{res['accuracy']:.3f}" in grow
    in_use = next(ln for ln in table if ln.startswith("* in use: ")).split()[3].rstrip(",")
    assert (grow[0] == "*") == (in_use == g)  # the row's mark agrees with the line on the model in use

    # served models are refused with one line and lose nothing
    blobs = BlobStore(h.blobs_dir)
    for served in (a["id"], g[:8]):
        r = runner.invoke(app, ["models", "rm", served, "--home", home])
        assert isinstance(r.exception, ModelServed) and "\n" not in str(r.exception)
        assert "ledger entry" in str(r.exception)
    assert all(blobs.has(x) for x in a["blobs"].values()) and a["id"] in listed(h.root)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "cli.app", "models", "rm", a["id"], "--home", home],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1 and p.stderr.startswith(f"error: model {a['id']} is served") and p.stderr.count("\n") == 1

    # an unserved model goes with its blobs and its run folder
    run_dir = h.root / Path(b["files"]["history_csv"]).parent
    assert run_dir.is_dir()
    out = cli("models", "rm", b["id"][:6], "--home", home)
    assert f"removed model {b['id']}" in out and b["id"] not in listed(h.root)
    assert not any(blobs.has(x) for x in b["blobs"].values()) and not run_dir.exists()
    r = runner.invoke(app, ["models", "rm", b["id"], "--home", home])
    assert r.exception is not None and "not found" in str(r.exception)

    # size limit: the oldest unserved models go, served and newest ones stay
    c, d = train(h.root, 2), train(h.root, 3)
    cfg = NodeConfig.load(h)
    cfg.extra["models"] = {"max_bytes": 1}
    cfg.save(h)
    r = runner.invoke(app, ["train", "--home", home, "--data", DATA, *TINY, "--seed", "4", "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    e = json.loads(r.stdout[r.stdout.index("{"):])  # training applies the limit after registering; the CLI prints it
    assert f"removed old model {c['id']}" in r.stderr and f"removed old model {d['id']}" in r.stderr
    left = listed(h.root)
    assert c["id"] not in left and d["id"] not in left
    assert {a["id"], g, e["id"]} <= set(left)
    assert not any(blobs.has(x) for x in c["blobs"].values())


def test_table_columns_do_not_shift_with_long_names(tmp_path: Path) -> None:
    h = NodeHome.at(tmp_path / "n")
    init_home(h, consortium="demo")
    reg = ModelRegistry(h)
    cfg = {"name": "vit_tiny_patch16_224", "img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 2}
    for i, (name, labels) in enumerate([("vit_tiny_patch16_224", ["0", "1"]),
                                        ("vit_" + "x" * 60, [f"a_very_long_class_name_{k}" for k in range(40)])]):
        reg.add(ModelRecord(model={**cfg, "name": name}, labels=labels, label_fp="f", samples=10 ** (i * 6),
                            metrics={"accuracy": 0.5, "f1": 0.25}, blobs={}, created=time.time() + i))
    out = cli("models", "--home", str(h.root)).splitlines()
    lines, footer = out[:3], out[3:]  # the header, two models, then the line on the model in use
    assert footer[0].startswith("* in use: ") and footer[0].split()[3].rstrip(",") == reg.get("latest").id
    width = sum(w for _, w in COLUMNS) + 2 * (len(COLUMNS) - 1)
    cells = []
    for ln in lines:  # every line splits at the same fixed offsets, separators included
        ln = ln.ljust(width)
        assert len(ln) == width
        pos, row = 0, []
        for _, w in COLUMNS:
            row.append(ln[pos:pos + w].strip())
            assert ln[pos + w:pos + w + 2] in ("  ", "")
            pos += w + 2
        cells.append(row)
    assert cells[0] == [c for c, _ in COLUMNS]
    for row in cells[1:]:
        assert row[3] == "trained" and row[8] == "0.500" and row[9] == "0.250"
    assert cells[2][4].endswith("…") and cells[2][6].startswith("40: a_very_long") and cells[2][7] == "1000000"
    assert [row[0] for row in cells[1:]] == ["", "*"]  # the newest, trained: in use


def test_ledger_show_has_timestamps(tmp_path: Path) -> None:
    h = NodeHome.at(tmp_path / "n")
    t0 = time.time()
    init_home(h, consortium="demo")
    (e,) = json.loads(cli("ledger", "show", "--home", str(h.root), "--json"))
    assert t0 - 1 <= e["stored_at"] <= time.time() + 1
    line = cli("ledger", "show", "--home", str(h.root)).splitlines()[0]
    assert line.startswith(time.strftime("%Y-%m-%d", time.localtime(e["stored_at"]))) and "genesis" in line
