"""`base = "public"`: the paper's shared pretrained backbone W_p (VGS-ATD §3.2), built by one
designated client on a PUBLIC labelled data set before the VGS-ATD phases.

VGS-ATD §3.2: "one designated client (with sufficient computational resources) trains a
model on a large-scale, publicly available medical dataset (e.g., chest X-rays). The
resulting backbone extractor weights W_p are then distributed to all nodes as a shared
foundation"; every node initialises its ViT from W_p and fine-tunes it on its private data
(§4: phase 2 "reused the pretrained weights derived from the Phase 1 source dataset"; §4.4:
the baselines start from the same pretrained weights).

The analog here (`digits-jitter`, `atdnode.data.jitter`): `public=F` reserves a fixed
fraction F of the source digits as the public pool; the scenario's nodes partition and are
tested on the other digits only (`private_spec`), the designated client trains a supervised
ViT of the scenario's `[model]` on the pool's training split (`pool_spec`: the pool's
digits rendered `variants` times) with the library's trainer (`netsim.learn.train_model`,
what `atd train` runs), and its extractor is W_p. No source digit is on both sides, so no
rendering of a private or test digit is in the pool.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from atdnode.data import LabeledImages, load_dataset
from atdnode.data import DataSpec
from atdnode.data import without_val
from atdnode.learning import ModelConfig, TrainOptions, extractor_state
from netsim.learn import model_config, predict, score, train_model
from netsim.nodedata import ScenarioData
from netsim.scenario import Scenario, ScenarioError

PUBLIC_SEED_SALT = 4242  # W_p's training seed is the scenario seed + this (not any node's)


def _with(spec: str, **opts: object) -> str:
    """`spec` with `opts` added to (or replacing) its query options."""
    head, _, query = spec.partition("?")
    kept = [kv for kv in query.split("&") if kv and kv.split("=", 1)[0] not in opts]
    return head + "?" + "&".join(kept + [f"{k}={v}" for k, v in opts.items()])


def private_spec(spec: str, fraction: float) -> str:
    """The nodes' data spec once `fraction` of the source digits is reserved as the public
    pool (`digits-jitter?variants=3` -> `digits-jitter?variants=3&public=0.3`)."""
    ds = DataSpec.parse(spec)
    if ds.source != "digits-jitter":
        raise ScenarioError(f"base = \"public\" reserves its pool from digits-jitter, not {ds.source} ({spec})")
    return _with(spec, public=fraction)


def pool_spec(spec: str, fraction: float, variants: int) -> str:
    """The public pool's data spec: the reserved digits, each rendered `variants` times."""
    private_spec(spec, fraction)  # same checks
    return _with(spec, variants=variants, public=fraction, part="public")


@dataclass
class PublicBase:
    """W_p (extractor tensors), the full pretrained model, and what building it cost / scored."""

    extractor: dict[str, torch.Tensor]
    model: torch.nn.Module
    classes: list[str]
    train_images: int
    test_accuracy: float  # the pretrained model on the pool's own test split
    seconds: float
    content_fp: str  # of the pool's training split: what W_p saw

    def summary(self) -> dict:
        return {"pool_train_images": self.train_images, "pool_test_accuracy": round(self.test_accuracy, 4),
                "train_s": round(self.seconds, 1), "pool_content_fp": self.content_fp}


def load_pool(spec: str, fraction: float, variants: int, model: ModelConfig, seed: int
              ) -> tuple[LabeledImages, LabeledImages]:
    """The public pool's train and test splits at the model's size (data seed `seed`)."""
    ps = without_val(pool_spec(spec, fraction, variants))  # W_p trains on the whole pool; it chooses nothing
    return (load_dataset(ps, model.img_size, model.in_chans, "train", seed=seed),
            load_dataset(ps, model.img_size, model.in_chans, "test", seed=seed))


def train_public_base(model: ModelConfig, train: TrainOptions, pool: tuple[LabeledImages, LabeledImages], *,
                      seed: int, epochs: int, lr: float) -> PublicBase:
    """The designated client's supervised pretraining on the pool's training split (the
    scenario's [model] and [train] recipe at `epochs` / `lr`), scored on the pool's test split."""
    tr, te = pool
    t0 = time.perf_counter()
    t = train_model(model_config(model, len(tr.classes)), tr, replace(train, lr=lr, epochs=epochs), seed=seed)
    acc = score(te.labels.numpy(), predict(t.model, te.images))["accuracy"]
    return PublicBase(extractor=extractor_state(t.model), model=t.model, classes=list(tr.classes),
                      train_images=len(tr), test_accuracy=float(acc), seconds=time.perf_counter() - t0,
                      content_fp=tr.content_fp())


DESIGNATED = "wp"  # the designated client's node name (short: control sockets live under its home)


@dataclass
class PublicBaseRun:
    """What netsim's base step produced: W_p's file every node imports (`atd train
    --init-from FILE`), its tensors, the base's model config and what building it cost."""

    files: dict[str, Path]
    extractor: dict[str, torch.Tensor]
    model: ModelConfig
    info: dict

    def summary(self) -> dict:
        return self.info


def run_public_base(scn: Scenario, data: ScenarioData, work: Path, *, progress=lambda _m: None) -> PublicBaseRun:
    """W_p for the run: the scenario's shipped file (`[public] file`, checked against its
    `sha256`) or, without one, the designated client's training in the run (`build_public_base`).
    Deviation, as for the MSD base: the file reaches the VGS-ATD nodes as a local file, not
    over the run's simulated network."""
    if DESIGNATED in data.nodes:
        raise ScenarioError(f"{scn.source}: base = \"public\" needs the node name {DESIGNATED!r} for its designated client")
    if scn.public.file:
        f = shipped_public_base(scn)
        info = {"designated": DESIGNATED, "pool": scn.public.spec, "epochs": scn.public.epochs, "lr": scn.public.lr,
                "file": f.name, "sha256": scn.public.sha256, "bytes": f.stat().st_size}
        progress(f"public base: W_p from {f.name} (sha256 checked; built by {DESIGNATED} from the recipe: "
                 f"{scn.public.epochs} epochs at {scn.public.lr:g} on {scn.public.spec})")
    else:
        f, info = build_public_base(scn, work, progress=progress)
    info.update(finetune_lr=scn.public.finetune_lr, finetune_epochs=scn.public.finetune_epochs)
    return PublicBaseRun(files={n: f for n in data.nodes}, extractor=load_extractor(f), model=scn.model, info=info)


def build_public_base(scn: Scenario, work: Path, *, progress=lambda _m: None) -> tuple[Path, dict]:
    """The designated client (node `DESIGNATED`, a home of its own consortium) trains W_p on
    the pool's training split with `atd train`'s library function (`atdnode.learning.training.train`:
    the scenario's [model] and [train] recipe at [public] epochs / lr), publishes its extractor
    (`atd publish-weights --part extractor`: a signed weights entry); returns the weight-set
    file (`work/base/wp.safetensors`) and what building it cost and scored."""
    from atdnode.blobs import BlobStore
    from atdnode.models import publish_weights
    from atdnode.learning import train
    from netsim.homes import make_consortium

    p = scn.public
    home = make_consortium(work / "h", [DESIGNATED], seed=scn.seed, consortium="netsim-public").homes[DESIGNATED]
    opts = replace(scn.train, epochs=p.epochs, lr=p.lr, seed=scn.seed + PUBLIC_SEED_SALT, init_from=None,
                   freeze_blocks=0)
    progress(f"public base: {DESIGNATED} trains W_p on the public pool {p.spec} ({p.epochs} epochs at {p.lr:g})")
    t0 = time.perf_counter()
    rec = train(home, without_val(p.spec), model_config(scn.model, 2), opts)  # W_p chooses nothing: all the pool
    wall = time.perf_counter() - t0
    pub = publish_weights(home, model="latest", part="extractor")
    out = work / "base"
    out.mkdir(parents=True, exist_ok=True)
    f = Path(shutil.copyfile(BlobStore(home.blobs_dir).path(pub.blob), out / "wp.safetensors"))
    info = {"designated": DESIGNATED, "pool": p.spec, "pool_train_images": rec.samples,
            "pool_test_accuracy": round(float(rec.metrics["accuracy"]), 4), "epochs": p.epochs, "lr": p.lr,
            "train_s": round(wall, 3), "entry": pub.entry.id.hex(), "blob": pub.blob, "bytes": pub.size,
            "sha256": file_sha256(f), "data_fp": rec.provenance.get("data_fp")}
    progress(f"public base: W_p scores {info['pool_test_accuracy']:.3f} on the pool's test split ({wall:.0f} s)")
    return f, info


def file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


REBUILD = "python bench/public_base_build.py SCENARIO --write"


def shipped_public_base(scn: Scenario) -> Path:
    """The scenario's shipped W_p file, refused (WeightsError, one line) when it is missing or
    its SHA-256 is not `[public] sha256`."""
    from atdnode.errors import WeightsError

    f = Path(scn.public.file)
    if not f.is_file():
        raise WeightsError(f"{scn.source}: the public base file {f} is missing; rebuild it from the scenario's "
                           f"[public] recipe with `{REBUILD}`")
    got = file_sha256(f)
    if got != scn.public.sha256:
        raise WeightsError(f"{scn.source}: the public base file {f} has sha256 {got}, not the scenario's "
                           f"{scn.public.sha256}; restore it or rebuild it with `{REBUILD}`")
    return f


def load_extractor(path: Path, what: str = "public base") -> dict[str, torch.Tensor]:
    """A shared base's extractor tensors from its weight-set file (W_p here; the MSD base,
    `netsim.msdbase.base_tensors`): keys, shapes and finiteness are checked where they enter
    a model (`atdnode.learning.model.load_part`). WeightsError names the file when it is unreadable."""
    from safetensors.torch import load_file

    from atdnode.errors import WeightsError

    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises several types
        raise WeightsError(f"{what} file {path}: {e}") from None


def finetune_scenario(scn: Scenario) -> Scenario:
    """`scn` whose [train] rate and epochs are [public] finetune_lr / finetune_epochs: every
    method that trains a model starts from W_p and trains at this recipe (fairness, §4.4:
    the baselines start from the same pretrained weights)."""
    p = scn.public
    return scn.replace(train=replace(scn.train, lr=p.finetune_lr or scn.train.lr,
                                     epochs=p.finetune_epochs or scn.train.epochs))


def base_model(cfg: ModelConfig, extractor: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A model of `cfg` carrying W_p's extractor (its head is unused: features only)."""
    from atdnode.learning import build_model, load_part

    m = build_model(cfg)
    load_part(m, extractor, "extractor")
    return m.eval()
