"""Local training of a node's ViT: AdamW + cross-entropy, resumable, deterministic on CPU.

`train(home, data_spec, cfg, opts)` loads the data, builds (or initialises) the model,
runs the epochs with a checkpoint after each finished one under HOME/runs/<run key>,
evaluates on the test split, stores the full / extractor / head weight sets in the blob
store and a record in the model registry. Training shares nothing.

Determinism: the initial weights come from `torch.manual_seed(seed)`; each epoch's
shuffle, augmentation and any dropout are pure functions of (seed, epoch), so a run
killed after epoch e and restarted from its checkpoint ends with the same weights as an
uninterrupted one (bitwise on CPU, where deterministic algorithms are switched on).

Hook for adversarial training (issue 5): `TrainOptions.batch_transform` is called on
every training batch as `transform(model, images, labels) -> images` after augmentation
(with the bare model, not the DDP wrapper); its `describe()` dict enters the run key and
the provenance. `evaluate(..., transform=...)` gives accuracy under the same transform.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from atdnode import ddp
from atdnode.augment import SmallClassAugment
from atdnode.data import LabeledImages, load_dataset
from atdnode.data.sanity import caution_for, require_classes
from atdnode.devdata import DeviceImages
from atdnode.device import to_device, use_amp
from atdnode.errors import ConfigError
from atdnode.features import device_batches, extract_features, predict_classes, progress_bar  # noqa: F401  (re-exported, INTERFACES)
from atdnode.home import NodeHome
from atdnode.metrics import classification_metrics, save_confusion_png
from atdnode.model import ModelConfig, build_model, export_part, extractor_state, freeze_blocks
from atdnode.model_gc import register_model
from atdnode.registry import ModelRecord, ModelRegistry, RunCheckpoint


class BatchTransform(Protocol):
    """`transform(model, images, labels, generator) -> images`; `generator` is seeded from
    (seed, epoch, batch, rank) by the loop, so a resumed run draws the same randomness."""

    def __call__(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                 generator: torch.Generator) -> torch.Tensor: ...

    def describe(self) -> dict: ...


class AdversarialTransform:
    """Federated adversarial training (FedWAvg): a share `pgd.ratio` of each batch is
    replaced by PGD examples (protocols.adversarial); `robust()` is the eval-time attack."""

    def __init__(self, pgd) -> None:  # pgd: protocols.adversarial.PGDConfig
        self.pgd = pgd

    def __call__(self, model, images, labels, generator):
        from protocols.adversarial import adversarial_batch

        return adversarial_batch(model, images, labels, ratio=self.pgd.ratio, generator=generator,
                                 **self.pgd.attack_kwargs())

    def robust(self) -> "BatchTransform":
        from protocols.adversarial import pgd_attack

        pgd = self.pgd

        class _Attack:
            def __call__(self, model, images, labels, generator):
                return pgd_attack(model, images, labels, generator=generator, **pgd.attack_kwargs())

            def describe(self):
                return {"attack": "pgd"}

        return _Attack()

    def describe(self) -> dict:
        from dataclasses import asdict

        return {"adversarial": "pgd", **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.pgd).items()}}


# VGS-ATD's AdamW rate, meant for fine-tuning from existing weights. From random init a ViT
# needs less, and less the wider it is (Adam's rate ~ 1/width): SCRATCH_LR_192 * 192 / embed_dim.
# Measured on digits, 3 epochs, batch 16, augmentation on: vit_tiny (d=192, depth 12, img 32,
# patch 8) reached 0.14 test accuracy at 3e-3, 0.18 at 5e-4, 0.42 at 3e-4, 0.43 at 1e-4;
# d=48 depth 12 did best at 5e-4 of {3e-3, 1e-3, 5e-4}.
FINETUNE_LR = 3e-3
OPTIMIZERS = ("adamw", "sgd")
SGD_MOMENTUM = 0.9  # the FedWAvg paper's local SGD (Sec. 4)
SCRATCH_LR_192 = 1e-4


@dataclass
class TrainOptions:
    epochs: int = 3
    batch_size: int = 16
    lr: float | None = None  # None: FINETUNE_LR when starting from weights, else SCRATCH_LR
    weight_decay: float = 0.05
    warmup_epochs: float = 0.2  # linear warmup, then cosine decay to 0 (per step)
    init_from: str | None = None  # blob hash in the node's store, a checkpoint file, or a model id
    freeze_blocks: int = 0
    seed: int = 0
    augment: bool = True
    augment_threshold: int = 1000
    augment_prob: float = 0.5
    augment_mode: str = "enlarge"  # paper §4.2: extra samples for small classes; "inplace": replace
    pretrained: bool = False  # timm pretrained-by-name (needs a reachable hub)
    device: str | None = None  # atdnode.device rule: cpu / cuda / cuda:N, else [compute] device, else CUDA if present
    compile: bool = False  # torch.compile the model (not in the run key: same math, other kernels)
    progress: bool = False
    log: Callable[[str], None] | None = None
    batch_transform: BatchTransform | None = None
    extra_provenance: dict = field(default_factory=dict)
    epoch_eval: bool = True  # held-out loss/accuracy after each epoch (history.csv, curves.png)
    tensorboard: str | None = None  # log dir (atdnode.trainlog); display only, not in the run key
    mlflow: str | None = None  # tracking URI (atdnode.trainlog); display only
    # "adamw" (default: warmup + cosine per step) or "sgd": SGD with momentum 0.9 at a rate
    # that drops by `lr_decay` each epoch (lr * (1 - lr_decay)^(epoch_offset + epoch)), no
    # warmup -- the local optimiser of the FedWAvg paper (Sec. 4, "Training configuration":
    # 5 % per epoch in AT); `epoch_offset` counts the epochs of earlier rounds
    optimizer: str = "adamw"
    lr_decay: float = 0.0
    epoch_offset: int = 0

    def effective_lr(self, embed_dim: int) -> float:
        """`lr`, or the default: FINETUNE_LR from weights, width-scaled SCRATCH_LR_192 from scratch."""
        if self.lr is not None:
            return self.lr
        if self.init_from or self.pretrained:
            return FINETUNE_LR
        return min(FINETUNE_LR, SCRATCH_LR_192 * 192 / embed_dim)

    def key_fields(self, embed_dim: int) -> dict:
        """What decides the result (and so the run key); excludes display and device."""
        return {"epochs": self.epochs, "batch_size": self.batch_size, "lr": self.effective_lr(embed_dim), "wd": self.weight_decay,
                "warmup": self.warmup_epochs, "init_from": self.init_from, "freeze": self.freeze_blocks,
                "seed": self.seed, "augment": [self.augment, self.augment_threshold, self.augment_prob, self.augment_mode],
                "pretrained": self.pretrained,
                "transform": self.batch_transform.describe() if self.batch_transform else None,
                **({"optimizer": [self.optimizer, self.lr_decay, self.epoch_offset]} if self.optimizer != "adamw" else {})}


def run_key(data_spec: str, cfg: ModelConfig, opts: TrainOptions) -> str:
    raw = json.dumps({"data": data_spec, "model": cfg.to_dict(), **opts.key_fields(cfg.embed_dim)}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay for biases, norms and timm's `no_weight_decay()` tokens."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _seed_of(*parts: int) -> int:
    import numpy as np

    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def lr_at(step: int, total: int, warmup: int, base: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


class LaggedStats:
    """Running (mean loss, accuracy) for a progress display without a host synchronisation.

    On CUDA the device totals are copied without blocking into pinned memory and read only
    once that copy's event has completed, so the display lags a step or a few; on the CPU
    the values are read at once.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(3, dtype=torch.float64).pin_memory() if self.cuda else None
        self.event = None
        self.last = (float("nan"), float("nan"))

    def read(self, stats: torch.Tensor) -> tuple[float, float]:
        """`stats` = (loss sum, correct, count) -> the latest (loss, accuracy) available."""
        if not self.cuda:
            loss, correct, n = stats.tolist()
            return loss / max(n, 1.0), correct / max(n, 1.0)
        if self.event is not None and self.event.query():
            loss, correct, n = self.host.tolist()
            self.last, self.event = (loss / max(n, 1.0), correct / max(n, 1.0)), None
        if self.event is None:
            self.host.copy_(stats, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        return self.last


class Trainer:
    """The epoch loop on in-memory data (no DataLoader: the tensors are already there)."""

    def __init__(self, model: nn.Module, data: LabeledImages, opts: TrainOptions, ctx: ddp.DistContext) -> None:
        self.model, self.data, self.opts, self.ctx = model, data, opts, ctx
        self.device = ctx.device
        self.amp = use_amp(self.device)
        self.net: nn.Module = model
        if ctx.distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if opts.compile:
            self.net = torch.compile(self.net)
        self.lr = opts.effective_lr(int(model.embed_dim))
        fused = {"fused": True} if self.device.type == "cuda" else {}  # one kernel for all params on CUDA
        self.optimizer = torch.optim.AdamW(param_groups(model, opts.weight_decay), lr=self.lr, **fused)
        self.augment = (SmallClassAugment(data.class_counts(), threshold=opts.augment_threshold,
                                          prob=opts.augment_prob, seed=opts.seed, mode=opts.augment_mode)
                        if opts.augment else None)
        if opts.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer {opts.optimizer!r}: choose from {', '.join(OPTIMIZERS)}")
        if opts.optimizer == "sgd":  # the FedWAvg paper's local optimiser, in AdamW's place
            self.optimizer = torch.optim.SGD(param_groups(model, opts.weight_decay), lr=self.lr, momentum=SGD_MOMENTUM)
        # sample i < N is data[i]; sample N + k is an augmented copy of data[sources[N + k]]
        extra = self.augment.extra_sources(data.labels) if self.augment is not None else torch.zeros(0, dtype=torch.int64)
        self.sources = torch.cat([torch.arange(len(data)), extra])
        self.samples_per_epoch = len(self.sources)  # with augmented extras: the progress bar's total
        self.steps_per_epoch = math.ceil(len(self.sources) / opts.batch_size)
        self.total_steps = self.steps_per_epoch * opts.epochs
        self.warmup = min(self.total_steps, round(opts.warmup_epochs * self.steps_per_epoch))
        self.images = DeviceImages(data.images, data.labels, self.device)  # on the GPU when it fits

    def epoch_order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.opts.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.sources), generator=g)

    def train_epoch(self, epoch: int, on_batch: Callable[[int, float, float], None] | None = None) -> dict:
        """One pass over the data (0-based `epoch`); returns mean loss and accuracy over all ranks."""
        opts, ctx = self.opts, self.ctx
        torch.manual_seed(opts.seed * 7919 + epoch)  # dropout / drop-path, if the model has any
        self.net.train()
        order = self.epoch_order(epoch)
        stats = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, correct, count (this rank)
        shown = LaggedStats(self.device)
        for b in range(self.steps_per_epoch):
            step = epoch * self.steps_per_epoch + b
            for g in self.optimizer.param_groups:
                g["lr"] = (self.lr * (1.0 - opts.lr_decay) ** (opts.epoch_offset + epoch) if opts.optimizer == "sgd"
                           else lr_at(step, self.total_steps, self.warmup, self.lr))
            gidx = order[b * opts.batch_size:(b + 1) * opts.batch_size]  # the global batch
            lo, hi = ctx.slice(len(gidx))
            idx = gidx[lo:hi]
            src = self.sources[idx]  # (b,) on the CPU: indices never wait for the device
            x, y = self.images.gather(src), self.images.gather_labels(src)  # (b, C, H, W), (b,) on the device
            if self.augment is not None:
                x = self.augment(x, self.data.labels[src], idx, epoch)  # in place mode
                extra = torch.nonzero(idx >= len(self.data)).flatten()
                if len(extra):  # enlarge mode: the extra samples are made now, batched on the device
                    at = to_device(extra, self.device)
                    x[at] = self.augment.make_extra(x[at], idx[extra], epoch)
            if opts.batch_transform is not None:
                g = torch.Generator().manual_seed(_seed_of(opts.seed, epoch, b, ctx.rank))
                x = opts.batch_transform(self.model, x, y, g)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                logits = self.net(x)  # (b, K)
                loss_sum = F.cross_entropy(logits.float(), y, reduction="sum")
            # scaled so DDP's gradient average equals the mean over the global batch
            (loss_sum * (ctx.world / len(gidx))).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():  # stays on the device: no host sync per step
                stats[0] += loss_sum.detach().double()
                stats[1] += (logits.argmax(1) == y).sum()
                stats[2] += len(y)
            if on_batch is not None:
                on_batch(len(gidx), *shown.read(stats))
        ctx.sum_(stats)
        loss, acc = (stats[:2] / stats[2].clamp(min=1)).tolist()
        return {"epoch": epoch + 1, "loss": loss, "accuracy": acc}


@torch.no_grad()
def heldout_loss_accuracy(model: nn.Module, data: LabeledImages, *, batch_size: int = 256) -> dict:
    """Mean cross-entropy and accuracy of `model` on `data` (eval mode, restored afterwards);
    the sums stay on the model's device until the end."""
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, correct
    labels = to_device(data.labels, device)
    try:
        for s, x in device_batches(data.images, batch_size, device):
            y = labels[s:s + len(x)]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp(device)):
                logits = model(x)
            sums[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
            sums[1] += (logits.argmax(1) == y).sum()
    finally:
        model.train(was)
    n = max(1, len(data))
    loss, correct = sums.tolist()
    return {"val_loss": loss / n, "val_accuracy": correct / n}


def evaluate(model: nn.Module, data: LabeledImages, *, batch_size: int = 256, device: torch.device | str | None = None,
             transform: BatchTransform | None = None) -> dict:
    """Macro metrics + confusion matrix of `model` on `data` (optionally on transformed inputs,
    e.g. adversarial examples). The model's train/eval mode is restored afterwards."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if transform is None:
        pred = predict_classes(model, data.images, batch_size, device=device)
        return classification_metrics(data.labels.numpy(), pred.numpy(), labels=range(len(data.classes)))
    was = model.training
    model.eval()
    preds = []
    try:
        for s, x in device_batches(data.images, batch_size, device):
            y = to_device(data.labels[s:s + len(x)], device)
            g = torch.Generator().manual_seed(s)
            with torch.enable_grad():
                x = transform(model, x, y, g).detach()
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp(device)):
                preds.append(model(x).argmax(1))
    finally:
        model.train(was)
    pred = torch.cat(preds).cpu() if preds else torch.empty(0, dtype=torch.long)
    return classification_metrics(data.labels.numpy(), pred.numpy(), labels=range(len(data.classes)))


def _resolve_init(home: NodeHome, store, init_from: str | None) -> tuple[str | None, Path | None]:
    """`--init-from` -> (blob hash, None) or (None, checkpoint file). An atd weight-set file
    is imported into the store first, so provenance can name it by hash; a model id (or
    unique prefix) of the registry gives that model's extractor blob (`atd base build`)."""
    from atdnode.weights import read_meta

    if init_from is None:
        return None, None
    p = Path(init_from).expanduser()
    if p.is_file():
        if p.suffix == ".safetensors":
            try:
                from safetensors import safe_open

                with safe_open(str(p), framework="pt") as f:
                    is_atd = "atd" in (f.metadata() or {})
            except Exception:
                is_atd = False
            if is_atd:
                h = store.put_file(p)
                read_meta(store, h)
                return h, None
        return None, p
    h = init_from.lower()
    if len(h) >= 8 and all(c in "0123456789abcdef" for c in h):
        if len(h) < 64:  # unique prefix of a held blob
            hits = [b for b in store.list() if b.startswith(h)]
            if len(hits) > 1:
                from atdnode.ids import unique

                unique(h, hits, what="--init-from blob")  # raises, naming the matching blobs
            if len(hits) == 1:
                h = hits[0]
        if len(h) == 64 and store.has(h):
            return h, None
    from atdnode.split.base import base_extractor_blob  # a registered model, e.g. an MSD base (issue 16)

    h = base_extractor_blob(home, init_from)
    if h is not None and store.has(h):
        return h, None
    raise ConfigError(f"--init-from {init_from}: neither a file, a blob in {home.blobs_dir} nor a model id")


def _build(home: NodeHome, store, cfg: ModelConfig, data: LabeledImages, opts: TrainOptions) -> tuple[nn.Module, dict]:
    """The model a run starts from, and its provenance.

    Deviation from VGS-ATD §3.1 (which attaches a new, randomly initialised head to the
    shared extractor at each node): when `--init-from` names a full weight set whose label
    space equals this node's, the follower starts from that set's head too (a warm start
    for the same task); a different label space, or an extractor set, gets timm's fresh
    head as in the paper. Give the extractor part to get the paper's behaviour always.
    """
    from atdnode.model import import_part
    from atdnode.weights import read_meta

    blob, ckpt = _resolve_init(home, store, opts.init_from)
    torch.manual_seed(opts.seed)
    model = build_model(cfg, checkpoint=ckpt, pretrained=opts.pretrained)
    prov: dict = {"init_from": blob or (str(ckpt) if ckpt else None), "init_part": None}
    if blob is not None:
        meta = read_meta(store, blob)
        same_labels = meta.get("label_fp") == data.label_fp
        part = meta.get("part") if (meta.get("part") == "extractor" or same_labels) else "extractor"
        if part == "head":
            raise ConfigError(f"--init-from {blob[:12]} is a head-only weight set; give an extractor or full set")
        import_part(store, blob, model, cfg, label_fp=data.label_fp, labels=data.classes, part=part)
        prov["init_part"] = part
    elif ckpt is not None:
        prov["init_part"] = "checkpoint"
    prov["base"] = base_fingerprint(store, blob, model)
    freeze_blocks(model, opts.freeze_blocks)
    return model, prov


def base_fingerprint(store, init_blob: str | None, model: nn.Module) -> str:
    """Which shared start a model descends from: the base its init weight set records (so
    every follower of one base gets the same fingerprint), else a hash of the initial
    extractor weights (same seed + config, or the same checkpoint file, give the same one).
    Averaging models with different bases is meaningless (see README); `atd aggregate` warns."""
    from atdnode.weights import read_meta

    if init_blob is not None:
        base = read_meta(store, init_blob).get("base")
        return str(base) if isinstance(base, str) and base else f"blob:{init_blob[:32]}"
    h = hashlib.sha256()
    for k, v in sorted(extractor_state(model).items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().float().numpy().tobytes())
    return f"init:{h.hexdigest()[:32]}"


def train(home: NodeHome, data_spec: str, cfg: ModelConfig, opts: TrainOptions) -> ModelRecord | None:
    """Train (or resume, or return the finished result of) the run these arguments define.

    `cfg.num_classes` is set from the data's label space. Returns the registry record on
    the main process (None on other DDP ranks).
    """
    from atdnode.blobstore import BlobStore

    log = opts.log or (lambda _msg: None)
    ctx = ddp.init_from_env(opts.device, home=home)
    prev_det = torch.are_deterministic_algorithms_enabled()
    tlog = None
    if ctx.device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        home.make_dirs()
        store = BlobStore(home.blobs_dir)
        data = load_dataset(data_spec, cfg.img_size, cfg.in_chans, "train")
        require_classes(data)  # one class: a "perfect" model that knows nothing
        test = load_dataset(data_spec, cfg.img_size, cfg.in_chans, "test")
        val = load_dataset(data_spec, cfg.img_size, cfg.in_chans, "val") if "val" in data.report.splits else None
        for part in (data, val, test):  # the loader's report: counts, scaling used, skipped files
            if part is not None:
                log(part.report.summary())
        cfg = cfg.with_classes(len(data.classes))
        key = run_key(data_spec, cfg, opts)
        ck = RunCheckpoint(home.runs_dir / key)
        state = ck.read()
        if state.get("done"):
            log(f"run {key} already finished: model {state['model_id']}")
            return ModelRegistry(home).get(state["model_id"]) if ctx.is_main else None
        model, prov = _build(home, store, cfg, data, opts)
        model.to(ctx.device)
        trainer = Trainer(model, data, opts, ctx)
        start = ck.restore(model, trainer.optimizer) if state else 0
        history = list(state.get("history", []))
        if start:
            log(f"resuming run {key} at epoch {start + 1}/{opts.epochs}")
        else:
            log(f"run {key}: {len(data)} train / {len(test)} test images, {len(data.classes)} classes, "
                f"{cfg.name} d={cfg.embed_dim} depth={cfg.depth} on {ctx.device} x{ctx.world}")
        if ctx.is_main:
            from atdnode.trainlog import TrainLog

            tlog = TrainLog(ck.dir, key, tensorboard=opts.tensorboard, mlflow_uri=opts.mlflow,
                            params={"data": data_spec, **cfg.to_dict(), **opts.key_fields(cfg.embed_dim)})
        t0 = time.perf_counter()
        with progress_bar(opts.progress and ctx.is_main, "loss", "acc") as bar:
            for epoch in range(start, opts.epochs):
                task = bar.add_task(f"epoch {epoch + 1}/{opts.epochs}", total=trainer.samples_per_epoch, loss="", acc="")
                cb = lambda n, l, a: bar.update(task, advance=n, loss=f"loss {l:.4f}", acc=f"acc {a:.3f}")  # noqa: E731
                stats = trainer.train_epoch(epoch, cb if opts.progress and ctx.is_main else None)
                held = val if val is not None else test  # the source's val split (e.g. MedMNIST val) if it has one
                if ctx.is_main and opts.epoch_eval and len(held):
                    stats.update(heldout_loss_accuracy(model, held))
                history.append(stats)
                if ctx.is_main:
                    ck.save(epoch + 1, model, trainer.optimizer, history)
                    tlog.epoch(history)
                ctx.barrier()
                log(f"epoch {epoch + 1}/{opts.epochs} finished loss={stats['loss']:.4f} acc={stats['accuracy']:.4f}"
                    + (f" val_acc={stats['val_accuracy']:.4f}" if "val_accuracy" in stats else ""))
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
        from atdnode.data.public_spec import public_spec  # figure titles name no local path

        png = save_confusion_png(metrics["confusion"], test.classes, ck.dir / "confusion.png",
                                 title=f"{cfg.name} on {public_spec(data_spec)} (acc {metrics['accuracy']:.3f})")
        logged = tlog.finish(history, metrics, [png], title=f"{cfg.name} on {public_spec(data_spec)}")
        prov.update(data=data_spec, run_key=key, seed=opts.seed, options=opts.key_fields(cfg.embed_dim), **opts.extra_provenance)
        # for the model card (atdnode.model_card): what was trained on, without naming a file
        prov.update(class_counts=dict(zip(data.classes, data.class_counts())), data_fp=data.content_fp())
        common = dict(labels=data.classes, label_fp=data.label_fp, samples=len(data),
                      extra={"provenance": {"data": data_spec, "init_from": prov["init_from"], "run_key": key},
                             "base": prov["base"]})
        model.cpu()
        blobs = {part: export_part(store, model, cfg, part, **common) for part in ("full", "extractor", "head")}
        rec = ModelRecord(model=cfg.to_dict(), labels=data.classes, label_fp=data.label_fp, samples=len(data),
                          metrics=metrics, blobs=blobs, provenance=prov,
                          files={"confusion_png": str(png.relative_to(home.root)),
                                 **{k: str(p.relative_to(home.root)) for k, p in logged.items()}})
        model_id = register_model(home, rec)  # applies the [models] size limit
        ck.finish(model_id)
        log(f"model {model_id}: test accuracy {metrics['accuracy']:.4f} f1 {metrics['f1']:.4f}")
        return rec
    finally:
        if tlog is not None:
            tlog.close()
        torch.use_deterministic_algorithms(prev_det)
        ddp.shutdown(ctx)
