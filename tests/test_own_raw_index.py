"""The keep decision's raw-pixel ensemble is fitted once for the same inputs: `fit_own_raw`
keeps its last fits in the process and `own_raw_blob` indexes them in the node home
(`atdnode.aggregation.own_raw_index`); a looked-up ensemble is the fit bit for bit, and a
change in anything the fit reads (images, labels, input size, options, seed) fits again."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from atdnode.aggregation import ensemble_refs
from atdnode.aggregation.ensemble_refs import fit_own_raw, own_raw_key
from atdnode.aggregation.own_raw_index import index_file, own_raw_blob
from atdnode.blobs import BlobStore
from atdnode.data import LabeledImages
from atdnode.learning import ModelConfig
from atdnode.models import load_ensemble, save_ensemble
from atdnode.node import NodeHome

pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
OPTS = dict(pca_components=4, mlp_hidden=[8], mlp_max_iter=30, rf_trees=5, seed=0, prior="balanced")
CFG = ModelConfig(img_size=8, patch_size=4)


def _train(size: int = 8) -> LabeledImages:
    g = torch.Generator().manual_seed(0)
    y = torch.arange(36) % 3
    x = torch.rand(36, 1, size, size, generator=g) + y[:, None, None, None].float()
    return LabeledImages(images=x, labels=y, classes=["a", "b", "c"])


@pytest.fixture
def fits(monkeypatch) -> list[int]:
    """The fits actually computed (the process's kept fits emptied first)."""
    monkeypatch.setattr(ensemble_refs, "_own_raw", type(ensemble_refs._own_raw)())
    done: list[int] = []
    real = ensemble_refs._fit_own_raw

    def counted(*a, **k):
        done.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ensemble_refs, "_fit_own_raw", counted)
    return done


def _home(tmp_path: Path) -> tuple[NodeHome, BlobStore]:
    home = NodeHome.at(tmp_path / "home")
    home.make_dirs()
    return home, BlobStore(home.blobs_dir)


def _variants(train: LabeledImages) -> dict[str, tuple[LabeledImages, dict]]:
    pixel = train.images.clone()
    pixel[3, 0, 2, 2] += 1e-3
    label = train.labels.clone()
    label[0] = 1
    return {"one pixel": (dataclasses.replace(train, images=pixel), OPTS),
            "one label": (dataclasses.replace(train, labels=label), OPTS),
            "input size": (_train(size=12), OPTS),
            "class names": (dataclasses.replace(train, classes=["a", "b", "z"]), OPTS),
            "seed": (train, {**OPTS, "seed": 1}),
            "an option": (train, {**OPTS, "rf_trees": 6}),
            "the prior": (train, {**OPTS, "prior": "none"})}


def test_the_same_inputs_fit_once_per_process_and_the_kept_fit_is_the_fit(fits) -> None:
    train = _train()
    first = fit_own_raw(train, CFG, **OPTS)
    again = fit_own_raw(dataclasses.replace(train, images=train.images.clone()), CFG, **OPTS)
    assert len(fits) == 1 and again.ensemble is not first.ensemble and again.classes == first.classes
    a, b = first.ensemble.to_arrays()[0], again.ensemble.to_arrays()[0]
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    x = train.images.flatten(1).numpy()
    assert np.array_equal(first.ensemble.predict_proba(x), again.ensemble.predict_proba(x))
    for change, (t, opts) in _variants(train).items():
        assert own_raw_key(t, **opts) != own_raw_key(train, **OPTS), change
    fit_own_raw(train, CFG, **{**OPTS, "seed": 1})
    assert len(fits) == 2


def test_the_home_index_returns_the_stored_fit_and_any_change_fits_again(fits, tmp_path: Path) -> None:
    home, store = _home(tmp_path)
    train = _train()
    first = own_raw_blob(home, store, train, CFG, **OPTS)
    assert first.fitted and len(fits) == 1 and index_file(home, own_raw_key(train, **OPTS)).is_file()
    ensemble_refs._own_raw.clear()  # another process: only the home's index knows it
    again = own_raw_blob(home, store, train, CFG, **OPTS)
    assert not again.fitted and len(fits) == 1 and (again.blob, again.classes) == (first.blob, first.classes)
    # what refitting from scratch gives, bit for bit
    assert save_ensemble(store, ensemble_refs._fit_own_raw(train, CFG, **OPTS).ensemble) == first.blob
    for change, (t, opts) in _variants(train).items():
        got = own_raw_blob(home, store, t, CFG, **opts)
        assert got.fitted, change
    assert len(fits) == 2 + len(_variants(train))
    assert load_ensemble(store, first.blob).classes_.tolist() == [0, 1, 2]


@pytest.mark.parametrize("damage", ["blob deleted", "blob corrupt", "index unreadable"])
def test_a_stale_or_damaged_index_entry_is_fitted_again(fits, tmp_path: Path, damage: str) -> None:
    home, store = _home(tmp_path)
    train = _train()
    first = own_raw_blob(home, store, train, CFG, **OPTS)
    ensemble_refs._own_raw.clear()
    index = index_file(home, own_raw_key(train, **OPTS))
    if damage == "blob deleted":
        store.delete(first.blob)
    elif damage == "blob corrupt":
        path = store.path(first.blob)
        path.chmod(0o600)
        path.write_bytes(path.read_bytes()[:-1] + b"\0")
    else:
        index.write_text("{not json")
    again = own_raw_blob(home, store, train, CFG, **OPTS)
    assert again.fitted and len(fits) == 2 and again.blob == first.blob and again.classes == first.classes
    store.verify(again.blob)
    assert not own_raw_blob(home, store, train, CFG, **OPTS).fitted  # indexed again
