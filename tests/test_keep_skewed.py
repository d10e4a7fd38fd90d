"""Collaboration never silently makes a hospital worse.

Two classes (digits 0-4 vs 5-9), three nodes with skewed class shares 40/60, 4/96, 8/92,
each with its own validation split and the same balanced test split (a chest
X-ray shape). a trains a base; b and c fine-tune it; all publish extractors; every node
aggregates vertically, shares its features, and aggregates again with every node's
features. Each node must then have scored its own model, the consortium's and its own
raw-pixel ensemble on its own validation split and kept by the one-standard-error rule (the
consortium's unless another beats it by more than one SE of the paired difference, else the
best of the others), saying why; `atd classify`'s default is what it kept.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from atdnode.learning import run_classify as classify
from atdnode.aggregation import EnsembleOptions, share_features
from atdnode.aggregation.keep import MIN_VAL_PER_CLASS
from atdnode.models import ModelRegistry, publish_weights
from atdnode.aggregation.vertical import aggregate_vertical
from tests.factories import cli
from tests.vgs_homes import consortium, peer_ids, sync, train_node

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")]
SHARES = {"a": (0.40, 200), "b": (0.04, 250), "c": (0.08, 250)}  # negative share, samples


def skewed_specs(root: Path) -> dict[str, str]:
    """npz data specs: per node its train (80 %) and val (20 %) split, one balanced test split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.clip(np.round(d.images * (255 / 16)), 0, 255).astype(np.uint8)
    y = (d.target >= 5).astype(np.int64)
    rng = np.random.default_rng(0)
    pools = {c: list(rng.permutation(np.flatnonzero(y == c))) for c in (0, 1)}
    test = np.array([pools[c].pop() for c in (0, 1) for _ in range(100)])
    out = {}
    for name, (neg, n) in SHARES.items():
        k = round(neg * n)
        idx = {0: [pools[0].pop() for _ in range(k)], 1: [pools[1].pop() for _ in range(n - k)]}
        val = np.array([i for v in idx.values() for i in v[:max(1, len(v) // 5)]])
        tr = np.array([i for v in idx.values() for i in v[max(1, len(v) // 5):]])
        path = root / f"{name}.npz"
        np.savez(path, train_images=images[tr], train_labels=y[tr], val_images=images[val], val_labels=y[val],
                 test_images=images[test], test_labels=y[test], classes=np.array(["neg", "pos"]))
        out[name] = f"npz:{path}"
    return out


def test_vertical_with_every_nodes_features_never_silently_makes_a_node_worse(tmp_path: Path) -> None:
    specs = skewed_specs(tmp_path)
    homes = consortium(tmp_path / "homes", list(SHARES))
    train_node(homes[0], specs["a"], epochs=3)
    base = publish_weights(homes[0], part="extractor")
    sync(homes)
    for h, n in zip(homes[1:], "bc"):
        train_node(h, specs[n], init_from=base.blob, epochs=2, lr=1e-3, seed=1)
        publish_weights(h, part="extractor")
    sync(homes)
    opts = EnsembleOptions(pca_components=32, mlp_hidden=(64,), mlp_max_iter=120, rf_trees=30)
    firsts = [aggregate_vertical(h, options=opts) for h in homes]
    pids = peer_ids(homes)
    for h, r, me in zip(homes, firsts, pids):
        share_features(h, to=[p for p in pids if p != me], model=r.model_id)
    sync(homes)
    for h, n in zip(homes, SHARES):
        r = aggregate_vertical(h, options=opts)
        d = r.details
        assert len(d["features"]) == 2, d  # every node's features
        c = d["candidates"]
        assert c["scored_on"] == "val" and c["data"] == specs[n], c
        own, cons, raw = (c[k]["balanced_accuracy"] for k in ("own", "consortium", "raw-pixels"))  # keep.SELECT_BY
        print(f"{n}: balanced accuracy own {own:.3f} (SE {c['own']['se']:.3f}), consortium {cons:.3f}, raw pixels "
              f"{raw:.3f} (SE {c['raw-pixels']['se']:.3f}) on its val split -> kept {d['kept']}")
        beat = [k for k, v in (("own", own), ("raw-pixels", raw)) if v - cons > c[k]["se"]]  # by more than 1 SE
        short = min(c["val_class_counts"].values()) < MIN_VAL_PER_CLASS  # too few images of a class to rank them
        assert set(c["val_class_counts"]) == {"neg", "pos"}, c
        if short:
            assert d["kept"] == "consortium" and "too few to rank the candidates" in d["kept_why"], d
            assert "; kept consortium (the split holds " in cli("models", "--home", str(h.root)), n  # and `atd models` says so
        elif d["kept"] == "consortium":
            assert not beat, d
        elif d["kept"] == "own":  # it keeps its own and says why
            assert beat and own >= raw and "keeps its own" in d["kept_why"], d
        else:  # what it has alone scored best: it uses that, and says why
            assert d["kept"] == "raw-pixels" and beat and raw > own and "raw-pixel ensemble" in d["kept_why"], d
        used = classify(h, specs[n], split="val").model_id  # the default: what it kept
        assert used == (r.model_id if d["kept"] == "consortium" else c[d["kept"]]["model"])
        assert ModelRegistry(h).get(r.model_id).provenance["kept"] == d["kept"]
