"""Local training of a node's ViT (`atd train`): resumable, deterministic on CPU.

`train(home, data_spec, cfg, opts)` loads the data (the spec resolved once for its three
splits), builds (or initialises) the model (`atdnode.learning.train_start`), runs the epochs
(`atdnode.learning.trainer.Trainer`) with a checkpoint after each finished one under
HOME/runs/<run key> (`atdnode.learning.train_options.run_key`), evaluates on the test split
(`atdnode.learning.evaluation`), stores the full / extractor / head weight sets in the blob
store and registers the model (`atdnode.models.gc.register_model`, which applies the
`[models]` size limit). Training shares nothing.

Determinism: the initial weights come from `torch.manual_seed(seed)`; each epoch's
shuffle, augmentation and any dropout are pure functions of (seed, epoch), so a run
killed after epoch e and restarted from its checkpoint ends with the same weights as an
uninterrupted one (bitwise on CPU, where deterministic algorithms are switched on).

The options, the epoch loop and the scoring live in their own modules; their public names
are re-exported here, where callers have always imported them.
"""
from __future__ import annotations

import time

import torch

from atdnode import progress
from atdnode.learning import ddp
from atdnode.data import DataSource, load_dataset, resolve_data
from atdnode.data import caution_for, require_classes
from atdnode.learning.evaluation import evaluate, heldout_loss_accuracy
from atdnode.learning.features import extract_features, predict_classes
from atdnode.node import NodeHandle, NodeHome
from atdnode.progress import RunEta
from atdnode.learning.metrics import save_confusion_png
from atdnode.learning.model import ModelConfig, export_part
from atdnode.models import ModelRecord, ModelRegistry, RunCheckpoint, register_model
from atdnode.learning.probe import fresh_head, probe_head
from atdnode.learning.train_options import (
    FINETUNE_LR,
    OPTIMIZERS,
    SCRATCH_LR_192,
    AdversarialTransform,
    BatchTransform,
    TrainOptions,
    run_key,
)
from atdnode.learning.train_start import base_fingerprint, build_start
from atdnode.learning.trainer import Trainer, lr_at

__all__ = ["train", "TrainOptions", "BatchTransform", "AdversarialTransform", "run_key", "FINETUNE_LR",
           "SCRATCH_LR_192", "OPTIMIZERS", "Trainer", "lr_at", "evaluate", "heldout_loss_accuracy",
           "base_fingerprint", "extract_features", "predict_classes"]


def train(home: NodeHome, data_spec: str | DataSource, cfg: ModelConfig, opts: TrainOptions) -> ModelRecord | None:
    """Train (or resume, or return the finished result of) the run these arguments define.

    `data_spec`: a spec, or the `DataSource` the caller resolved it to (`resolve_data`).
    `cfg.num_classes` is set from the data's label space. Returns the registry record on
    the main process (None on other DDP ranks).
    """
    from atdnode.blobs import BlobStore

    home = NodeHandle.of(home)  # its config, store and registry: opened once for every step below
    log = opts.log or (lambda _msg: None)
    ctx = ddp.init_from_env(opts.device, home=home)
    prev_det = torch.are_deterministic_algorithms_enabled()
    tlog = None
    if ctx.device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        home.make_dirs()
        store = BlobStore.of(home)
        source = resolve_data(data_spec)
        data_spec = source.spec
        data = load_dataset(source, cfg.img_size, cfg.in_chans, "train")
        require_classes(data)  # one class: a "perfect" model that knows nothing
        test = load_dataset(source, cfg.img_size, cfg.in_chans, "test")
        val = load_dataset(source, cfg.img_size, cfg.in_chans, "val") if "val" in data.report.splits else None
        for part in (data, val, test):  # the loader's report: counts, scaling used, skipped files
            if part is not None:
                log(part.report.summary())
        val_origin = data.report.val_origin
        log(f"val split: {val_origin}")
        held, held_name = (val, "val") if val is not None else (test, "test")  # per-epoch figure, reported only
        cfg = cfg.with_classes(len(data.classes))
        key = run_key(data_spec, cfg, opts)
        ck = RunCheckpoint(home.runs_dir / key)
        state = ck.read()
        if state.get("done"):
            log(f"run {key} already finished: model {state['model_id']}")
            return ModelRegistry.of(home).get(state["model_id"]) if ctx.is_main else None
        model, prov = build_start(home, store, cfg, data, opts)
        model.to(ctx.device)
        if not state and fresh_head(prov, opts):  # LP-FT's probe (a resumed run has done it)
            for s in probe_head(model, data, opts, ctx):
                log(f"probe epoch {s['epoch']}/{opts.probe_epochs}: loss {s['loss']:.4f} acc {s['accuracy']:.3f}")
        trainer = Trainer(model, data, opts, ctx)
        start = ck.restore(model, trainer.optimizer) if state else 0
        history = list(state.get("history", []))
        if start:
            log(f"resuming run {key} at epoch {start + 1}/{opts.epochs}")
        else:
            log(f"run {key}: {len(data)} train / {len(test)} test images, {len(data.classes)} classes, "
                f"{cfg.arch()} on {ctx.device} x{ctx.world}")
        if ctx.is_main:
            from atdnode.learning.trainlog import TrainLog

            tlog = TrainLog(ck.dir, key, tensorboard=opts.tensorboard, mlflow_uri=opts.mlflow,
                            params={"data": data_spec, "val_split": val_origin, **cfg.to_dict(),
                                    **opts.key_fields(cfg.embed_dim)})
        t0 = time.perf_counter()
        shown = ctx.is_main and progress.active()  # the per-batch numbers are read only for a bar
        eta = RunEta(epochs=opts.epochs - start, per_epoch=trainer.samples_per_epoch)
        for epoch in range(start, opts.epochs):
            with progress.task(f"epoch {epoch + 1}/{opts.epochs}", total=trainer.samples_per_epoch) as step:
                def cb(n: int, loss: float, acc: float, step=step) -> None:
                    step.advance(n)
                    step.note(f"loss {loss:.4f} acc {acc:.3f} {eta.advance(n)}")

                stats = trainer.train_epoch(epoch, cb if shown else None)
                if ctx.is_main and opts.epoch_eval and len(held):  # named for the split it is: val, else test
                    stats.update(heldout_loss_accuracy(model, held, split=held_name))
                history.append(stats)
                if ctx.is_main:
                    ck.save(epoch + 1, model, trainer.optimizer, history)
                    tlog.epoch(history)
                ctx.barrier()
                eta.epoch_done()
                log(f"epoch {epoch + 1}/{opts.epochs} finished loss={stats['loss']:.4f} acc={stats['accuracy']:.4f}"
                    + (f" {held_name}_acc={stats[held_name + '_accuracy']:.4f}" if held_name + "_accuracy" in stats else "")
                    + f" {eta.text()}")
        train_s = time.perf_counter() - t0
        if not ctx.is_main:
            return None
        metrics = evaluate(model, test, device=ctx.device)
        robust = getattr(opts.batch_transform, "robust", None)
        if robust is not None:  # adversarial training: also report accuracy under the attack
            metrics["robust_accuracy"] = evaluate(model, test, device=ctx.device, transform=robust())["accuracy"]
        caution = caution_for(dict(zip(test.classes, test.class_counts())))
        if caution is not None:  # a small test split: every metric it affects carries the warning
            metrics["caution"] = caution.to_json()
            log(f"test metrics {caution.line()}")
        metrics.update(train_loss=history[-1]["loss"] if history else None,
                       train_accuracy=history[-1]["accuracy"] if history else None,
                       train_seconds=round(train_s, 3), history=history)
        from atdnode.data import public_data_spec as public_spec  # figure titles name no local path

        pngs = {"confusion_png": save_confusion_png(metrics["confusion"], test.classes, ck.dir / "confusion.png",
                title=f"{cfg.arch()}\non {public_spec(data_spec)} (acc {metrics['accuracy']:.3f}, n={metrics['n']})")} \
            if opts.plots else {}
        logged = tlog.finish(history, metrics, list(pngs.values()), title=f"{cfg.arch()} on {public_spec(data_spec)}",
                             curves=opts.plots)
        prov.update(data=data_spec, run_key=key, seed=opts.seed, options=opts.key_fields(cfg.embed_dim),
                    val_split={"origin": val_origin, "counts": data.report.counts.get("val", {})}, **opts.extra_provenance)
        # for the model card (atdnode.report.card): what was trained on, without naming a file
        prov.update(class_counts=dict(zip(data.classes, data.class_counts())), data_fp=data.content_fp())
        common = dict(labels=data.classes, label_fp=data.label_fp, samples=len(data),
                      extra={"provenance": {"data": data_spec, "init_from": prov["init_from"], "run_key": key},
                             "base": prov["base"]})
        model.cpu()
        blobs = {part: export_part(store, model, cfg, part, **common) for part in ("full", "extractor", "head")}
        rec = ModelRecord(model=cfg.to_dict(), labels=data.classes, label_fp=data.label_fp, samples=len(data),
                          metrics=metrics, blobs=blobs, provenance=prov,
                          files={k: str(p.relative_to(home.root)) for k, p in {**pngs, **logged}.items()})
        model_id = register_model(home, rec)  # applies the [models] size limit
        ck.finish(model_id)
        log(f"model {model_id}: test accuracy {metrics['accuracy']:.4f} f1 {metrics['f1']:.4f}")
        return rec
    finally:
        if tlog is not None:
            tlog.close()
        torch.use_deterministic_algorithms(prev_det)
        ddp.shutdown(ctx)
