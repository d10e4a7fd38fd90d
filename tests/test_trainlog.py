"""Training metrics: per-epoch CSV + curve PNG always; TensorBoard and MLflow on request;
one-line errors when an optional extra is missing; the CLI log file rotates by size."""
from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from atdnode.errors import ConfigError
from atdnode.node import NodeHome, init_home
from cli.app import app

torch.set_num_threads(1)
TINY = ["--model", "vit_tiny_patch16_224", "--img-size", "16", "--patch-size", "4", "--embed-dim", "32",
        "--depth", "2", "--heads", "2", "--batch-size", "32", "--seed", "0", "--lr", "3e-3"]
DATA = "digits?classes=0,1,2&limit=120"
runner = CliRunner()


def _home(tmp_path) -> NodeHome:
    h = NodeHome.at(tmp_path / "node")
    init_home(h, consortium="demo")
    return h


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_png_tensorboard_mlflow(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # atd opts in for a local store itself
    h = _home(tmp_path)
    tb, ml = tmp_path / "tb", f"file://{tmp_path / 'mlruns'}"
    r = runner.invoke(app, ["train", "--home", str(h.root), "--data", DATA, *TINY, "--epochs", "3",
                            "--tensorboard", str(tb), "--mlflow", ml, "--json"])
    assert r.exit_code == 0, r.output
    import json

    rec = json.loads(r.stdout[r.stdout.index("{"):])
    csv_path, png = h.root / rec["files"]["history_csv"], h.root / rec["files"]["curves_png"]
    assert csv_path.parent == png.parent == (h.root / rec["files"]["confusion_png"]).parent
    rows = _rows(csv_path)
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    hist = rec["metrics"]["history"]
    for row, hst in zip(rows, hist):  # the CSV is the run's history, held-out columns filled
        assert float(row["train_loss"]) == pytest.approx(hst["loss"])
        assert float(row["val_accuracy"]) == pytest.approx(hst["val_accuracy"])
        assert float(row["val_loss"]) > 0
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])  # it learned something
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000

    (run_dir,) = tb.iterdir()
    assert run_dir.name == rec["provenance"]["run_key"]
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert {"train/loss", "train/accuracy", "val/loss", "val/accuracy", "test/accuracy"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([h_["loss"] for h_ in hist])
    assert acc.Scalars("test/accuracy")[0].value == pytest.approx(rec["metrics"]["accuracy"])

    client = MlflowClient(ml)
    (exp,) = [e for e in client.search_experiments() if e.name == "atd"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.tags["atd.run_key"] == rec["provenance"]["run_key"]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "val_accuracy")] == pytest.approx(
        [h_["val_accuracy"] for h_ in hist])
    assert run.data.metrics["test_accuracy"] == pytest.approx(rec["metrics"]["accuracy"])
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"curves.png", "confusion.png", "history.csv"} <= arts


def test_missing_extra_is_one_line(tmp_path, monkeypatch):
    h = _home(tmp_path)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    monkeypatch.setitem(sys.modules, "mlflow", None)
    for flag, value, pkg in (("--tensorboard", str(tmp_path / "tb"), "tensorboard"), ("--mlflow", "file:///x", "mlflow")):
        r = runner.invoke(app, ["train", "--home", str(h.root), "--data", DATA, *TINY, "--epochs", "1", flag, value])
        assert isinstance(r.exception, ConfigError)
        msg = str(r.exception)
        assert "\n" not in msg and f"atd[{pkg}]" in msg
    assert not list((h.root / "runs").glob("*/history.csv"))  # refused before any epoch ran


def test_bad_mlflow_uri_is_one_line(tmp_path):
    h = _home(tmp_path)
    r = runner.invoke(app, ["train", "--home", str(h.root), "--data", DATA, *TINY, "--epochs", "1",
                            "--mlflow", "nosuchscheme://x"])
    assert isinstance(r.exception, ConfigError) and "\n" not in str(r.exception)
    assert str(r.exception).startswith("--mlflow nosuchscheme://x: ")


def test_cli_log_rotates_by_size(tmp_path):
    from atdnode.node import NodeConfig, file_handler

    h = _home(tmp_path)
    cfg = NodeConfig.load(h)
    cfg.extra["logs"] = {"max_bytes": 2048, "backups": 2}
    cfg.save(h)
    logger = logging.getLogger("test.rotation")
    logger.propagate = False
    handler = file_handler(h, "cli")
    logger.addHandler(handler)
    try:
        for i in range(400):
            logger.warning("line %04d %s", i, "x" * 40)
    finally:
        logger.removeHandler(handler)
        handler.close()
    files = sorted(p.name for p in h.logs_dir.iterdir())
    assert files == ["cli.log", "cli.log.1", "cli.log.2"]  # 2 backups kept, older ones dropped
    assert all((h.logs_dir / f).stat().st_size <= 2048 for f in files)
    assert "line 0399" in (h.logs_dir / "cli.log").read_text()
    cfg.extra["logs"] = {"max_bytes": 10}
    with pytest.raises(ConfigError, match="logs.max_bytes"):  # not written
        cfg.save(h)
    h.config_file.write_text(h.config_file.read_text().replace("max_bytes = 2048", "max_bytes = 10"))
    with pytest.raises(ConfigError, match="logs.max_bytes"):  # nor read, when edited by hand
        file_handler(h, "cli")
