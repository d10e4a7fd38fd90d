"""Progress of long steps: the library's tasks keep to their totals, and the CLI draws them.

A recording reporter (`atdnode.progress.Reporter`) runs the library's reported steps —
checking and averaging weight blobs, CLS features, a resumable blob download as another
process sees it — and fails on any update past a known total or a task that finishes
short of it. `atd ledger wait --blobs` with ATD_PROGRESS=1 draws its bars on stderr.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atdnode import progress
from atdnode.aggregation import average_blobs
from atdnode.blobs import BlobStore, partial_bytes
from atdnode.blobs.store import Manifest
from atdnode.data import LabeledImages
from atdnode.learning import build_model, extract_features, resolve_config
from atdnode.models import save_weights

REPO = Path(__file__).resolve().parents[1]


class Recorder:
    """Every task's updates; a task past its total or finished short of it is an error."""

    def __init__(self) -> None:
        self.tasks: dict[int, dict] = {}

    def start(self, description, total, unit):
        h = len(self.tasks)
        self.tasks[h] = {"description": description, "total": total, "unit": unit, "done": 0, "finished": False}
        return h

    def update(self, h, completed, total):
        t = self.tasks[h]
        t["total"] = total
        assert total is None or completed <= total, (t["description"], completed, total)
        assert completed >= t["done"], (t["description"], "went backwards")
        t["done"] = completed

    def finish(self, h):
        self.tasks[h]["finished"] = True


def check_all_done(rec: Recorder) -> None:
    assert rec.tasks
    for t in rec.tasks.values():
        assert t["finished"] and t["total"] is not None and t["done"] == t["total"], t


def test_averaging_and_features_report_within_their_totals(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    torch.manual_seed(0)
    blobs = [save_weights(store, {"w": torch.randn(64, 64), "b": torch.randn(64)}, {"part": "extractor", "i": i})
             for i in range(3)]
    cfg = resolve_config("vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                          num_classes=2)
    data = LabeledImages(images=torch.rand(37, 3, 16, 16), labels=torch.randint(0, 2, (37,)), classes=["a", "b"])
    rec = Recorder()
    with progress.use(rec):
        avg = average_blobs(store, blobs, [0.5, 0.25, 0.25], names=["x", "y", "z"], head=True)
        feats, _ = extract_features(build_model(cfg), data, batch_size=8)
    assert set(avg) == {"w", "b"} and feats.shape == (37, 32)
    check_all_done(rec)
    by_name = {t["description"]: t for t in rec.tasks.values()}
    assert by_name["checking 3 input blob(s)"]["total"] == sum(store.size(b) for b in blobs)
    assert by_name["checking 3 input blob(s)"]["unit"] == "bytes"
    assert by_name["CLS features"]["total"] == 37
    # without a reporter the same calls draw nothing and cost nothing visible
    assert average_blobs(store, blobs, [0.5, 0.25, 0.25], names=["x", "y", "z"], head=True)["w"].equal(avg["w"])


def test_partial_bytes_follows_a_download_in_another_process(tmp_path):
    src = BlobStore(tmp_path / "src")
    data = os.urandom(10_000)
    blob = src.put_bytes(data)
    man = Manifest.of_bytes(data, chunk_size=4096)  # chunks of 4096, 4096, 1808 bytes
    dst = BlobStore(tmp_path / "dst")
    assert partial_bytes(dst, blob) == 0  # nothing started
    part = dst.partial(man)
    part.write_chunk(2, data[8192:])
    assert partial_bytes(dst, blob) == 1808  # the short last chunk counts as what it is
    part.write_chunk(0, data[:4096])
    assert partial_bytes(dst, blob) == 4096 + 1808 <= man.size
    part.write_chunk(1, data[4096:8192])
    part.complete()
    assert partial_bytes(dst, blob) == man.size == len(data)


@pytest.mark.parametrize("force", ["1", "0"])
@pytest.mark.slow  # an atd process
def test_ledger_wait_draws_its_bars_when_asked(tmp_path, force):
    from atdnode.node import NodeHome, init_home
    from ledger import Ledger

    h = NodeHome.at(tmp_path / "n")
    ident = init_home(h, name="n", consortium="demo")
    store = BlobStore(h.blobs_dir)
    blob = store.put_bytes(os.urandom(50_000))
    with Ledger.open(h.ledger_db) as led:
        e = led.append(ident.signer, "metrics", {"blob": blob, "size": store.size(blob)})
    env = dict(os.environ, PYTHONPATH=str(REPO), ATD_PROGRESS=force, COLUMNS="120")
    p = subprocess.run([sys.executable, "-m", "cli.app", "ledger", "wait", e.id.hex(), "--blobs", "--home", str(h.root)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "1 entry here with their blobs"
    if force == "1":
        assert "entries" in p.stderr and "1/1" in p.stderr and "blobs" in p.stderr and "50.0" in p.stderr, p.stderr
    else:
        assert p.stderr == ""


def test_waiting_for_entries_is_a_library_call(tmp_path):
    """`atd ledger wait` is `atdnode.replication.wait_for_entries`: it returns once the entries
    (and their blobs) are here, names what is missing when it gives up, refuses a non-id."""
    from atdnode.errors import ConfigError, DaemonError
    from atdnode.node import NodeHome, init_home
    from atdnode.replication import wait_for_entries
    from ledger import Ledger

    h = NodeHome.at(tmp_path / "n")
    ident = init_home(h, name="n", consortium="demo")
    with Ledger.open(h.ledger_db) as led:
        e = led.append(ident.signer, "metrics", {"blob": "cd" * 32, "size": 3})
    wait_for_entries(h, [e.id.hex()], timeout=1)  # here: returns at once
    with pytest.raises(DaemonError, match=f"blobs {'cd' * 8}"):  # the entry is here, its blob is not
        wait_for_entries(h, [e.id.hex()], blobs=True, timeout=0.2, poll=0.05)
    with pytest.raises(DaemonError, match=f"entries {'ab' * 8}"):
        wait_for_entries(h, [e.id.hex(), "ab" * 32], timeout=0.2, poll=0.05)
    with pytest.raises(ConfigError, match="64-hex-digit"):
        wait_for_entries(h, ["xyz"])
    blob = BlobStore(h.blobs_dir).put_bytes(b"abc")
    with Ledger.open(h.ledger_db) as led:
        e2 = led.append(ident.signer, "metrics", {"blob": blob, "size": 3})
    wait_for_entries(h, [e2.id.hex()], blobs=True, timeout=1)


def test_line_reporter_says_each_step_when_it_starts_runs_and_ends(capsys):
    from cli.progress import LineReporter

    now = [100.0]
    rep = LineReporter(every=10.0, clock=lambda: now[0])
    with progress.use(rep):
        with progress.task("averaging 3 weight set(s)", total=3) as t:
            t.advance()  # at once: no line yet
            now[0] += 12
            t.advance()  # 12 s on: one line
            now[0] += 3
            t.advance()
        with progress.task("fetching", total=None, unit="bytes") as t:
            t.update(2_500_000)
    assert capsys.readouterr().err.splitlines() == [
        "averaging 3 weight set(s) ...", "averaging 3 weight set(s): 2/3 (12 s)",
        "averaging 3 weight set(s): done, 3/3 in 15.0 s", "fetching ...", "fetching: done, 2.5 MB in 0.0 s"]


@pytest.mark.slow  # trains a tiny model (a few seconds)
def test_classify_prints_plain_progress_lines_outside_a_terminal(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from atdnode.node import NodeHome, init_home
    from cli.app import app

    monkeypatch.delenv("ATD_PROGRESS", raising=False)  # the default: stderr here is no terminal
    h = NodeHome.at(tmp_path / "n")
    init_home(h, name="n")
    runner = CliRunner()
    tiny = ["--img-size", "16", "--patch-size", "4", "--embed-dim", "32", "--depth", "1", "--heads", "2",
            "--epochs", "1", "--batch-size", "32", "--seed", "0"]
    spec = "digits?classes=0,1&limit=80"
    assert runner.invoke(app, ["train", "--home", str(h.root), "--data", spec, *tiny]).exit_code == 0
    r = runner.invoke(app, ["classify", "--home", str(h.root), "--data", spec])
    assert r.exit_code == 0, r.output
    err = r.stderr.splitlines()
    assert f"reading {spec} [test] ..." in err and any(x.startswith("classifying ") and ": done, " in x for x in err), err
    assert "accuracy" in r.stdout and "classifying" not in r.stdout  # the result stays on stdout
    r = runner.invoke(app, ["classify", "--home", str(h.root), "--data", spec, "--json"])
    assert r.exit_code == 0 and r.stderr == ""  # --json: no lines
