"""Node homes for the VGS-ATD node tests, built in-process (no daemons).

A consortium is real homes (`init_home`, admissions by the founder, signed `hello`
entries announcing X25519 keys); `sync` does what the daemons do over the network —
merge every raw entry into every ledger and copy the blobs a daemon would fetch (weights
and aggregate blobs, features only for their recipients). Trained homes are built once per
session into a template folder and copied for each test (`copy_homes`), so tests that
change their homes stay independent.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from atdnode.blobs import BlobStore
from atdnode.node import NodeHome, NodeIdentity, found_consortium
from atdnode.learning import ModelConfig, TrainOptions, resolve_config, train
from atdnode.models import ModelRegistry, publish_weights
from ledger import Ledger

torch.set_num_threads(1)

CFG = dict(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2)
ENSEMBLE_ARGS = ["--pca-components", "32", "--mlp-hidden", "64", "--mlp-max-iter", "120", "--rf-trees", "30"]


def small_ensemble():
    """`ENSEMBLE_ARGS` as the library's `EnsembleOptions` (for tests that call the library, not
    the CLI): the defaults (PCA 500, a 256-wide MLP, 100 trees) cost tens of CPU-seconds on
    raw pixels (the raw-pixel candidate of `keep = best`), and these homes' tests check records,
    not ensemble accuracy."""
    from atdnode.aggregation.ensemble import EnsembleOptions

    return EnsembleOptions(pca_components=32, mlp_hidden=(64,), mlp_max_iter=120, rf_trees=30)


DISJOINT = {"a": "digits?classes=0,1,2", "b": "digits?classes=3,4,5", "c": "digits?classes=6,7,8,9"}


def cfg() -> ModelConfig:
    return resolve_config("vit_tiny_patch16_224", **CFG)


def consortium(root: Path, names: list[str]) -> list[NodeHome]:
    """Homes `root/NAME`; the first founds the consortium and admits the others; all say hello."""
    homes = [NodeHome.at(root / n) for n in names]
    found_consortium(homes, "demo", name_admissions=True)
    sync(homes)
    for h, n in zip(homes, names):
        say_hello(h, n)
    sync(homes)
    return homes


def say_hello(home: NodeHome, name: str) -> None:
    """The `hello` entry a daemon appends (no addresses here: nothing listens)."""
    ident = NodeIdentity.load(home)
    with Ledger.open(home.ledger_db) as led:
        led.append(ident.signer, "hello", {"addrs": [], "x25519": ident.x25519_public, "role": "node", "name": name})


def sync(homes: list[NodeHome]) -> None:
    """Replicate every entry everywhere; copy the blobs each node's daemon would fetch."""
    rows: list[bytes] = []
    for h in homes:
        with Ledger.open(h.ledger_db) as led:
            rows += led.raw_rows()
    for _ in range(2):  # a second pass places entries whose admission arrived in the first
        for h in homes:
            with Ledger.open(h.ledger_db) as led:
                led.merge(rows)
    stores = [BlobStore(h.blobs_dir) for h in homes]
    for h, store in zip(homes, stores):
        me = NodeIdentity.load(h).peer_id
        with Ledger.open(h.ledger_db) as led:
            wanted = [e for e in led.query(kind="weights") + led.query(kind="aggregate")]
            wanted += [e for e in led.query(kind="features") if me in (e.body.get("recipients") or [])]
        for e in wanted:
            copy_blob(stores, store, e.body.get("blob"))


def copy_blob(stores: list[BlobStore], dst: BlobStore, blob) -> None:
    if not isinstance(blob, str) or dst.has(blob):
        return
    for s in stores:
        if s.has(blob):
            dst.put_bytes(s.get_bytes(blob))
            return


def train_node(home: NodeHome, spec: str, *, init_from: str | None = None, freeze: int = 0, epochs: int = 2,
               lr: float = 3e-3, seed: int = 0, batch_size: int = 16):
    return train(home, spec, cfg(), TrainOptions(epochs=epochs, batch_size=batch_size, lr=lr, warmup_epochs=0.2,
                                                 init_from=init_from, freeze_blocks=freeze, seed=seed, augment=False,
                                                 device="cpu", plots=False))  # CPU numbers; no PNGs: display only


def copy_homes(template: Path, dst: Path) -> list[NodeHome]:
    shutil.copytree(template, dst)
    return [NodeHome.at(p) for p in sorted(dst.iterdir()) if (p / "node.key").exists()]


def peer_ids(homes: list[NodeHome]) -> list[str]:
    return [NodeIdentity.load(h).peer_id for h in homes]


def latest(home: NodeHome):
    return ModelRegistry(home).get("latest")


# ---------------------------------------------------------------- templates

def disjoint_trio(root: Path) -> Path:
    """a: digits 0-2 from scratch; b: 3-5 and c: 6-9 from a's extractor (one block frozen).
    Each publishes its extractor; everything synced."""
    if (root / "done").exists():
        return root
    homes = consortium(root, ["a", "b", "c"])
    rec_a = train_node(homes[0], DISJOINT["a"], epochs=2)
    pub_a = publish_weights(homes[0], part="extractor")
    sync(homes)
    for h, n in zip(homes[1:], "bc"):
        train_node(h, DISJOINT[n], init_from=pub_a.blob, freeze=0, epochs=2, lr=1e-3, seed=1)
        publish_weights(h, part="extractor")
    sync(homes)
    assert rec_a.labels == ["0", "1", "2"]
    (root / "done").write_text("ok")
    return root


def skewed_npz(path: Path, major: list[int], *, seed: int) -> str:
    """digits' own train split with classes in `major` kept whole and the others cut to 15%;
    the full digits test split. Returns an `npz:` data spec."""
    from sklearn.datasets import load_digits

    from atdnode.data import split_indices

    d = load_digits()
    images = np.clip(np.round(d.images * (255 / 16)), 0, 255).astype(np.uint8)
    labels = d.target.astype(np.int64)
    split = split_indices(labels, 0)
    rng = np.random.default_rng(seed)
    keep = []
    for c in range(10):
        idx = split["train"][labels[split["train"]] == c]
        keep.append(idx if c in major else rng.choice(idx, size=max(2, int(0.15 * len(idx))), replace=False))
    tr = np.sort(np.concatenate(keep))
    np.savez(path, train_images=images[tr], train_labels=labels[tr], test_images=images[split["test"]],
             test_labels=labels[split["test"]], classes=np.array([str(i) for i in range(10)]))
    return f"npz:{path}"


def skewed_trio(root: Path) -> Path:
    """Three nodes over all ten digits with skewed proportions (majority classes 0-3, 3-6,
    6-9). Node-to-node transfer: a trains a base, publishes it; every node (a too) fine-tunes
    the base on its own data and publishes its full set."""
    if (root / "done").exists():
        return root
    homes = consortium(root, ["a", "b", "c"])
    specs = [skewed_npz(root / f"{n}.npz", m, seed=i)
             for i, (n, m) in enumerate(zip("abc", ([0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9])))]
    train_node(homes[0], specs[0], epochs=3)
    base = publish_weights(homes[0], part="full")
    sync(homes)
    for h, spec in zip(homes, specs):
        train_node(h, spec, init_from=base.blob, epochs=2, lr=1e-3, seed=1)
        publish_weights(h, part="full")
    sync(homes)
    (root / "done").write_text("ok")
    return root
