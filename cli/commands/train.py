"""`atd train`: train the node's ViT on its own data (shares nothing)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from atdnode.node import NodeHome, sklearn_warnings_to_log
from atdnode.learning import FINETUNE_LR, SCRATCH_LR_192, TrainOptions
from cli.options import (node_home, ADV_RATIO_OPT, ADVERSARIAL_HELP, DEPTH_OPT, DEVICE_OPT, EMBED_DIM_OPT, HEADS_OPT, HOME_OPT,
                         IMG_SIZE_OPT, IN_CHANS_OPT, MLP_RATIO_OPT, MODEL_OPT, PATCH_SIZE_OPT, PGD_EPS_OPT,
                         PGD_STEP_OPT, PGD_STEPS_OPT, STEM_OPT, Stem, model_config, pgd_transform)
from cli.errors import CliError
from cli.progress import bars

if TYPE_CHECKING:
    from atdnode.data import DataSource

HELP = f"""Train a timm ViT on this node's private images and register it locally.

Optimiser: AdamW with the VGS-ATD defaults (--lr {FINETUNE_LR:g}, --weight-decay {TrainOptions.weight_decay:g}), linear warmup (--warmup-epochs) then cosine decay per step, cross-entropy. Those rates suit fine-tuning (--init-from a peer's extractor, --pretrained). From random init a ViT needs a lower rate, lower the wider it is, so the default there is {SCRATCH_LR_192:g} x 192 / embed-dim (why: atdnode.learning.train_options). Tiny models (embed 32, depth 2) tolerate higher rates; try --lr.

DATA is `digits`, `npz:PATH`, `folder:PATH`, `dicom:PATH` or `nifti:PATH` with options such as `digits?classes=0,1,2&shard=1/3&limit=300&seed=0` or `dicom:PATH?window=-1000,400` (README: data specs; `atd data inspect SPEC` shows what would be read).

Interrupted runs (Ctrl-C, kill -9) continue from the last finished epoch when the same command is run again; a finished run just prints its result. The model goes to the blob store (full / extractor / head weight sets) and to `atd models`; the test confusion matrix, a per-epoch CSV (history.csv: train and held-out loss/accuracy) and its curves (curves.png) are written under HOME/runs/<run key>/; --tensorboard DIR and --mlflow URI log the same numbers there too. Nothing is published: that is a separate, signed step.

Several processes or GPUs: --nproc-per-node N (re-runs itself under torchrun), or `torchrun --standalone --nproc_per_node N --no-python atd train ...`.
"""


def register(app: typer.Typer) -> None:
    app.command("train", help=HELP)(train_cmd)


def train_cmd(
    home: Path = HOME_OPT,
    data: str = typer.Option("digits", "--data", help="Data spec: digits | npz:PATH | folder:PATH | dicom:PATH | nifti:PATH [?options]."),
    model: str = MODEL_OPT,
    img_size: Optional[int] = IMG_SIZE_OPT,
    patch_size: Optional[int] = PATCH_SIZE_OPT,
    embed_dim: Optional[int] = EMBED_DIM_OPT,
    depth: Optional[int] = DEPTH_OPT,
    heads: Optional[int] = HEADS_OPT,
    in_chans: Optional[int] = IN_CHANS_OPT,
    mlp_ratio: Optional[float] = MLP_RATIO_OPT,
    stem: Optional[Stem] = STEM_OPT,
    epochs: int = typer.Option(3, "--epochs", min=1, help="Training epochs."),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Global batch size over all processes (small data sets need many steps; raise it for large ones / GPUs)."),
    lr: Optional[float] = typer.Option(None, "--lr", help=f"Peak AdamW learning rate (default: {FINETUNE_LR:g} from weights; from scratch {SCRATCH_LR_192:g} x 192/embed-dim)."),
    weight_decay: float = typer.Option(TrainOptions.weight_decay, "--weight-decay", help="AdamW weight decay."),
    warmup_epochs: float = typer.Option(TrainOptions.warmup_epochs, "--warmup-epochs", help="Linear warmup length in epochs."),
    init_from: Optional[str] = typer.Option(None, "--init-from", help="Blob hash (or prefix) in this node's store, a checkpoint file (safetensors / timm), or a model id from `atd models` (e.g. an MSD base from `atd base build`: train it with --model vit_base_patch16_gap_224 and the base's sizes)."),
    freeze_blocks: int = typer.Option(0, "--freeze-blocks", min=0, help="Freeze embeddings + the first K blocks."),
    probe_epochs: int = typer.Option(0, "--probe-epochs", min=0, help="LP-FT: with --init-from an extractor (or --pretrained), first train the fresh head alone on the frozen start for N epochs, then fine-tune (atdnode.learning.probe; keeps the start's features)."),
    probe_lr: Optional[float] = typer.Option(None, "--probe-lr", help="The probe's rate (default: 5 x --lr)."),
    seed: int = typer.Option(0, "--seed", help="Training seed (init, shuffle, augmentation)."),
    augment: bool = typer.Option(True, "--augment/--no-augment", help="VGS-ATD augmentation of small classes."),
    augment_threshold: int = typer.Option(1000, "--augment-threshold", help="Classes with fewer samples are augmented."),
    augment_prob: float = typer.Option(0.5, "--augment-prob", min=0.0, max=1.0, help="--augment-inplace: chance that a sample of a small class is replaced by an augmented one."),
    augment_inplace: bool = typer.Option(False, "--augment-inplace", help="Replace small-class samples in place instead of the paper's rule (enlarge each small class with extra samples made by three of five operations)."),
    pretrained: bool = typer.Option(False, "--pretrained", help="Start from timm's pretrained weights (needs a model hub)."),
    device: Optional[str] = DEVICE_OPT,
    compile_model: bool = typer.Option(False, "--compile/--no-compile", help="torch.compile the model (CUDA: faster after a warm-up of a minute or so; not in the run key)."),
    adversarial: bool = typer.Option(False, "--adversarial", help=ADVERSARIAL_HELP),
    adv_ratio: float = ADV_RATIO_OPT,
    pgd_eps: str = PGD_EPS_OPT,
    pgd_step: str = PGD_STEP_OPT,
    pgd_steps: int = PGD_STEPS_OPT,
    tensorboard: Optional[Path] = typer.Option(None, "--tensorboard", help="Also log per-epoch loss/accuracy to TensorBoard in this directory (pip install 'atd[tensorboard]')."),
    mlflow: Optional[str] = typer.Option(None, "--mlflow", help="Also log params, per-epoch metrics and the PNGs to this MLflow tracking URI (pip install 'atd[mlflow]')."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", min=1, help="Train with N processes via torchrun (DDP)."),
    as_json: bool = typer.Option(False, "--json", help="Print the registry record as JSON."),
) -> None:
    from atdnode.data import resolve_data
    from atdnode.learning import train

    h = node_home(home)
    sklearn_warnings_to_log(h)  # scikit-learn's warnings go to HOME/logs/cli.log, not stderr
    if nproc_per_node > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        from atdnode.learning import ENV, check_nproc, configured_device

        check_nproc(nproc_per_node, device or os.environ.get(ENV) or configured_device(h))  # one line, before torchrun starts
        _relaunch(nproc_per_node)
        return
    main = int(os.environ.get("RANK", "0")) == 0
    sizes = dict(img_size=img_size, patch_size=patch_size, embed_dim=embed_dim, depth=depth, heads=heads)
    source: "str | DataSource" = data  # resolved in `train`, after its device is checked
    if all(v is None for v in sizes.values()) and init_from is None and not pretrained:
        source = resolve_data(data)  # parsed and listed once: for the sizes and for every split
        sizes = _auto_sizes(h, source, device, say=main and not as_json)
    cfg = model_config(model, **sizes, in_chans=in_chans, mlp_ratio=mlp_ratio, stem=stem)
    transform = None
    if adversarial:
        transform = pgd_transform(adv_ratio=adv_ratio, pgd_eps=pgd_eps, pgd_step=pgd_step, pgd_steps=pgd_steps,
                                  in_chans=cfg.in_chans)
    opts = TrainOptions(epochs=epochs, batch_size=batch_size, lr=lr, weight_decay=weight_decay,
                        warmup_epochs=warmup_epochs, init_from=init_from, freeze_blocks=freeze_blocks, seed=seed,
                        probe_epochs=probe_epochs, probe_lr=probe_lr,
                        augment=augment, augment_threshold=augment_threshold, augment_prob=augment_prob,
                        augment_mode="inplace" if augment_inplace else "enlarge", pretrained=pretrained, device=device,
                        compile=compile_model,
                        log=_logger(h) if main else None,
                        batch_transform=transform, tensorboard=str(tensorboard) if tensorboard else None,
                        mlflow=mlflow)
    try:
        with bars(quiet=as_json or not main):
            rec = train(h, source, cfg, opts)
    except KeyboardInterrupt:  # the finished epochs are on disk; say so and exit 130
        raise CliError("interrupted; run the same command again to continue from the last finished epoch",
                       exit_code=130) from None
    if rec is None:  # a non-main DDP rank
        return
    if as_json:
        typer.echo(json.dumps(rec.to_dict(), indent=2, sort_keys=True))
        return

    m = rec.metrics
    from atdnode.learning import ModelConfig
    from cli.scoretext import score_lines

    typer.echo(f"model {rec.id} on {data}: {rec.samples} samples, {len(rec.labels)} classes")
    typer.echo(f"  {ModelConfig.from_dict(rec.model).arch()}")
    typer.echo(f"  test split, n={m['n']}  (training {m.get('train_seconds', 0):.0f} s)")
    for line in score_lines(m, indent="  "):
        typer.echo(line)
    typer.echo(f"  full weights {rec.blobs['full']}")
    typer.echo(f"  extractor    {rec.blobs['extractor']}")
    typer.echo(f"  confusion    {h.root / rec.files.get('confusion_png', '')}")
    if "curves_png" in rec.files:
        typer.echo(f"  curves       {h.root / rec.files['curves_png']}  (per epoch: {h.root / rec.files['history_csv']})")


def _auto_sizes(home: NodeHome, data: "DataSource", device: str | None, *, say: bool) -> dict:
    """Model sizes chosen from the data (`atdnode.learning.autosize`), said in one line on stderr."""
    from atdnode.data import peek
    from atdnode.learning import choose_size
    from atdnode.learning import resolve_device

    images, side = peek(data)
    choice = choose_size(side, images, resolve_device(device, home=home).type)
    if say:
        typer.echo(f"model size from the data: {choice.why} (--img-size/--patch-size/--embed-dim/--depth/--heads "
                   f"to choose)", err=True)
    if choice.threads and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(choice.threads)
    o = choice.overrides()
    return dict(img_size=o["img_size"], patch_size=o["patch_size"], embed_dim=o["embed_dim"], depth=o["depth"],
                heads=o["num_heads"])


def _logger(home: NodeHome):
    """Progress lines on stderr, also kept in HOME/logs/cli.log (rotated by size, atdnode.node.logs)."""
    import logging

    from atdnode.node import file_handler

    logger = logging.getLogger("atd.train")
    if not logger.handlers:
        logger.addHandler(file_handler(home, "cli"))
        logger.setLevel(logging.INFO)
        logger.propagate = False

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
        logger.info(msg)

    return log


def _relaunch(nproc: int) -> None:
    """Re-run this very command under torchrun with N processes."""
    from atdnode.learning import torchrun_argv
    from atdnode.errors import ConfigError

    atd = shutil.which("atd") or sys.argv[0]
    args, skip = [], False
    for a in sys.argv[1:]:  # drop our --nproc-per-node so the children train
        if skip:
            skip = False
            continue
        if a == "--nproc-per-node":
            skip = True
            continue
        if a.startswith("--nproc-per-node="):
            continue
        args.append(a)
    rc = subprocess.call(torchrun_argv(nproc, [atd, *args]))
    if rc != 0:
        raise ConfigError(f"torchrun with {nproc} processes failed (exit {rc})")
