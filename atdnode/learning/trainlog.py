"""Where a training run's numbers go: a CSV and a curve PNG always, TensorBoard and MLflow on request.

Per run (HOME/runs/<run key>/, next to confusion.png):

    history.csv   one row per finished epoch: epoch, train_loss, train_accuracy,
                  val_loss, val_accuracy (after that epoch, on the val split: the
                  source's, e.g. MedMNIST's, or the one carved from training),
                  test_loss, test_accuracy (only where there is no val split, `val=train`
                  or `val=test`: reported under their true name, chosen on by nothing)
    curves.png    loss and accuracy per epoch, train and held-out (val, else test)

The CSV is rewritten from the run's history after every epoch, so a resumed run (the
history lives in the checkpoint) has one row per epoch, never duplicates.

TensorBoard (`--tensorboard DIR`, extra `atd[tensorboard]`): scalars `train/loss`,
`train/accuracy`, `val/loss`, `val/accuracy` per epoch and the final `test/*` metrics,
through `torch.utils.tensorboard`, in DIR/<run key> (a resumed run appends there).

MLflow (`--mlflow URI`, extra `atd[mlflow]`): one MLflow run per atd run, tagged
`atd.run_key` (a resumed run continues the same MLflow run), with the training options as
params, the same metrics per epoch (step = epoch) and the PNGs and CSV as artifacts.
A local directory (`--mlflow ./mlruns` or `file:` URI) uses MLflow's file store (opted in
via MLFLOW_ALLOW_FILE_STORE unless set). A missing package or a tracking URI MLflow
refuses is a one-line ConfigError before any epoch runs.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

from atdnode.errors import ConfigError

COLUMNS = ("epoch", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "test_loss", "test_accuracy")
_SCALARS = {"loss": "train/loss", "accuracy": "train/accuracy", "val_loss": "val/loss", "val_accuracy": "val/accuracy",
            "test_loss": "test/epoch_loss", "test_accuracy": "test/epoch_accuracy"}


def write_history_csv(history: list[dict], path: Path) -> Path:
    """One row per epoch (columns COLUMNS); written to a temp file and renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for h in history:
            w.writerow([h.get("epoch"), h.get("loss"), h.get("accuracy"), h.get("val_loss"), h.get("val_accuracy"),
                        h.get("test_loss"), h.get("test_accuracy")])
    tmp.replace(path)
    return path


def save_curves_png(history: list[dict], path: Path, *, title: str = "") -> Path:
    """Loss (left) and accuracy (right) per epoch, train and held-out, as PNG (matplotlib Agg)."""
    from atdnode.plots import png_figure

    epochs = [h["epoch"] for h in history]
    with png_figure(path, ncols=2, figsize=(9, 3.6), dpi=100) as (fig, (ax_l, ax_a)):
        for ax, key, label in ((ax_l, "loss", "loss"), (ax_a, "accuracy", "accuracy")):
            ax.plot(epochs, [h.get(key) for h in history], marker="o", label="train")
            for held in ("val", "test"):
                if any(h.get(f"{held}_{key}") is not None for h in history):
                    ax.plot(epochs, [h.get(f"{held}_{key}") for h in history], marker="s", label=held)
                    break
            ax.set_xlabel("epoch")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend()
        ax_a.set_ylim(0, 1)
        if title:
            fig.suptitle(title, fontsize=10)
    return path


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install 'atd[tensorboard]'") from None
    return SummaryWriter


def _mlflow():
    try:
        import mlflow
    except ImportError:
        raise ConfigError("--mlflow needs the mlflow package: pip install 'atd[mlflow]'") from None
    return mlflow


class TrainLog:
    """Per-epoch and final logging of one run. `epoch(history)` after each finished epoch,
    `finish(history, metrics, files)` once at the end, `close()` always."""

    def __init__(self, run_dir: Path, run_key: str, *, tensorboard: str | None = None, mlflow_uri: str | None = None,
                 params: dict | None = None, experiment: str = "atd") -> None:
        self.run_dir = Path(run_dir)
        self.run_key = run_key
        self.tb = None
        self.mlflow = None
        if tensorboard:
            self.tb = _summary_writer()(log_dir=str(Path(tensorboard).expanduser() / run_key))
        if mlflow_uri:
            mlflow = _mlflow()
            if "://" not in mlflow_uri or mlflow_uri.startswith("file:"):
                # a local directory: recent MLflow wants an explicit opt-in for its file store
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            try:
                mlflow.set_tracking_uri(mlflow_uri)
                mlflow.set_experiment(experiment)
                self.mlflow = mlflow
                mlflow.start_run(run_id=self._existing_run(experiment), run_name=run_key,
                                 tags={"atd.run_key": run_key})
            except Exception as exc:  # MLflow raises many types; the user needs one line
                self.mlflow = None
                self.close()
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ConfigError(f"--mlflow {mlflow_uri}: {first}") from None
            if params:
                flat = {k: str(v) for k, v in params.items()}
                try:
                    self.mlflow.log_params(flat)
                except Exception:  # a resumed run already holds these params (MLflow forbids changes)
                    pass

    def _existing_run(self, experiment: str) -> str | None:
        client = self.mlflow.tracking.MlflowClient()
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return None
        runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`atd.run_key` = '{self.run_key}'",
                                  max_results=1)
        return runs[0].info.run_id if runs else None

    def epoch(self, history: list[dict]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_history_csv(history, self.run_dir / "history.csv")
        last = history[-1]
        step = int(last["epoch"])
        values = {tag: float(last[k]) for k, tag in _SCALARS.items() if last.get(k) is not None}
        if self.tb is not None:
            for tag, v in values.items():
                self.tb.add_scalar(tag, v, step)
            self.tb.flush()
        if self.mlflow is not None:
            self.mlflow.log_metrics({tag.replace("/", "_"): v for tag, v in values.items()}, step=step)

    def finish(self, history: list[dict], metrics: dict, files: list[Path], *, title: str = "",
               curves: bool = True) -> dict[str, Path]:
        """Write the CSV and (`curves`) the curve PNG; log test metrics and artifacts; returns {name: path}."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        out = {"history_csv": write_history_csv(history, self.run_dir / "history.csv")}
        if curves:
            out["curves_png"] = save_curves_png(history, self.run_dir / "curves.png", title=title)
        final = {f"test/{k}": float(metrics[k]) for k in ("accuracy", "precision", "recall", "f1", "robust_accuracy")
                 if isinstance(metrics.get(k), (int, float))}
        step = int(history[-1]["epoch"]) if history else 0
        if self.tb is not None:
            for tag, v in final.items():
                self.tb.add_scalar(tag, v, step)
            self.tb.flush()
        if self.mlflow is not None:
            self.mlflow.log_metrics({t.replace("/", "_"): v for t, v in final.items()}, step=step)
            for p in [*out.values(), *files]:
                self.mlflow.log_artifact(str(p))
        return out

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.mlflow is not None:
            self.mlflow.end_run()
            self.mlflow = None
