"""The baselines every ensemble claim carries (ARCHITECTURE, "Baselines travel with claims").

VGS-ATD's classifier is PCA -> MLP + RF + SVM (soft vote) on the features of a learned
extractor (`atdnode.aggregation.ensemble`). Whether the learning earned anything shows only next
to the same ensemble, same options, same data, on

    ensemble-raw        the raw inputs (pixels, flattened: (N, C*H*W));
    ensemble-untrained  the pre-logits features of an *untrained* extractor of the same
                        config (timm's random init under a fixed seed).

`fit_reference` fits one of them through the library's own ensemble function
(`protocols.vgs.fit_vertical_ensemble`, the one `atd aggregate` calls) on one or more
labelled image sets (e.g. the pooled data of a phase's nodes); netsim, `atd split compare`
and the claim tests all call it, so there is one implementation of each baseline.
`fit_own_raw` is what a hospital has alone: the ensemble on the raw pixels of its own training
images only, with the class-prior correction for its own class counts; netsim's
`ensemble-raw-own` reference and the keep decision's raw-pixel candidate
(`atdnode.aggregation.candidates`) both call it. The fit is seeded and reads nothing but its
inputs, and a node judges every aggregation against the same one, so it is computed once per
`own_raw_key` (its inputs' digest) in a process; `atdnode.aggregation.own_raw_index` keeps it
across processes in the node home.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from atdnode.data import LabeledImages
from atdnode.learning import ModelConfig, build_model
from protocols.ensemble import EnsembleClassifier
from protocols.vgs import fit_vertical_ensemble

REFERENCES = ("ensemble-raw", "ensemble-untrained")
UNTRAINED_SEED = 0  # the untrained extractor's init seed (fixed: the baseline is the config, not a lucky draw)


def untrained_extractor(cfg: ModelConfig, seed: int = UNTRAINED_SEED) -> torch.nn.Module:
    """A model of `cfg` at timm's random init under `seed` (eval mode)."""
    torch.manual_seed(seed)
    return build_model(cfg).eval()


def reference_features(kind: str, images: torch.Tensor, cfg: ModelConfig | None = None, *,
                       model: torch.nn.Module | None = None) -> np.ndarray:
    """(N, D) float32 inputs of the reference ensemble `kind` for `images` (N, C, H, W)."""
    if kind == "ensemble-raw":
        from atdnode.learning import pixel_features

        return pixel_features(images)
    if kind != "ensemble-untrained":
        raise ValueError(f"unknown reference {kind!r} (one of {', '.join(REFERENCES)})")
    from atdnode.learning import extract_features

    m = model if model is not None else untrained_extractor(cfg)
    dummy = LabeledImages(images=images, labels=torch.zeros(len(images), dtype=torch.int64), classes=["_"])
    X, _ = extract_features(m, dummy)
    return X


@dataclass
class ReferenceEnsemble:
    kind: str
    ensemble: EnsembleClassifier
    classes: list[str]  # names; `ensemble.classes_` index them
    model: torch.nn.Module | None  # the untrained extractor (ensemble-untrained)

    def predict(self, images: torch.Tensor) -> np.ndarray:
        """Indices into `classes` for `images`."""
        X = reference_features(self.kind, images, model=self.model)
        return self.ensemble.predict(X).astype(np.int64)


def fit_reference(kind: str, parts: Sequence[LabeledImages], cfg: ModelConfig, *, own: int = 0,
                  model: torch.nn.Module | None = None, **ensemble) -> ReferenceEnsemble:
    """Fit reference `kind` on the image sets `parts` (their label spaces merged by name;
    `parts[own]` is the fitting node's own data, for the "node" prior); `ensemble`:
    the `EnsembleClassifier` keyword arguments (`EnsembleOptions.kwargs()`). `model`: for
    ensemble-untrained, another fixed extractor in place of the random one (netsim's
    ensemble-public: a pretrained base, not fine-tuned)."""
    if kind == "ensemble-untrained" and model is None:
        model = untrained_extractor(cfg)
    feats = [(reference_features(kind, p.images, model=model), p.labels.numpy(), list(p.classes)) for p in parts]
    ens, classes = fit_vertical_ensemble(feats, own=own, **ensemble)
    return ReferenceEnsemble(kind, ens, list(classes), model)


OWN_RAW_FORMAT = 1  # part of `own_raw_key`: raise it when `fit_own_raw` computes something else
OWN_RAW_KEPT = 8  # fits `fit_own_raw` keeps in memory (least recently used dropped first)
_own_raw: OrderedDict[str, tuple[dict[str, np.ndarray], dict[str, Any], list[str]]] = OrderedDict()
_own_raw_lock = threading.Lock()


def own_raw_key(train: LabeledImages, **ensemble) -> str:
    """Hex digest of everything `fit_own_raw(train, cfg, **ensemble)` reads: the images (dtype,
    shape — the input size and channels — and bytes), the labels, the class names, the ensemble
    options (the seed and the prior among them), and what computes the fit (`OWN_RAW_FORMAT`,
    numpy's and scikit-learn's versions). Equal keys mean the same fit, bit for bit; any
    difference in one of them gives another key."""
    import sklearn

    images = np.ascontiguousarray(train.images.detach().cpu().numpy())
    labels = np.ascontiguousarray(train.labels.detach().cpu().numpy())
    head = {"format": OWN_RAW_FORMAT, "numpy": np.__version__, "sklearn": sklearn.__version__,
            "classes": list(train.classes), "ensemble": ensemble,
            "images": [images.dtype.str, list(images.shape)], "labels": [labels.dtype.str, list(labels.shape)]}
    h = hashlib.blake2b(digest_size=24)
    h.update(json.dumps(head, sort_keys=True, default=list).encode())
    h.update(memoryview(images).cast("B"))
    h.update(memoryview(labels).cast("B"))
    return h.hexdigest()


def fit_own_raw(train: LabeledImages, cfg: ModelConfig, *, prior: str, **ensemble) -> ReferenceEnsemble:
    """The ensemble on the raw pixels of `train` (one node's own training images) alone, under
    the class-prior correction `prior` for its own class counts (the fitted members with
    `EnsembleClassifier.with_prior`, as a node's own `prior="node"` fit gives); `ensemble`: the
    other `EnsembleClassifier` keyword arguments.

    The last `OWN_RAW_KEPT` fits of this process are kept by `own_raw_key`: the same inputs
    again return a new `ReferenceEnsemble` rebuilt from the kept arrays (what refitting gives;
    callers may change what they get). A fit that raises keeps nothing."""
    key = own_raw_key(train, prior=prior, **ensemble)
    with _own_raw_lock:
        hit = _own_raw.get(key)
        if hit is not None:
            _own_raw.move_to_end(key)
    if hit is not None:
        arrays, meta, classes = hit
        return ReferenceEnsemble("ensemble-raw", EnsembleClassifier.from_arrays(arrays, meta), list(classes), None)
    ref = _fit_own_raw(train, cfg, prior=prior, **ensemble)
    arrays, meta = ref.ensemble.to_arrays()  # copies: the caller's ensemble stays its own
    with _own_raw_lock:
        _own_raw[key] = (arrays, meta, list(ref.classes))
        while len(_own_raw) > OWN_RAW_KEPT:
            _own_raw.popitem(last=False)
    return ref


def _fit_own_raw(train: LabeledImages, cfg: ModelConfig, *, prior: str, **ensemble) -> ReferenceEnsemble:
    ref = fit_reference("ensemble-raw", [train], cfg, **{**ensemble, "prior": "none"})
    counts = dict(zip(train.classes, np.bincount(train.labels.numpy(), minlength=len(train.classes)).tolist()))
    fitted = np.array([counts[ref.classes[int(i)]] for i in ref.ensemble.classes_])  # the classes it saw
    ens = ref.ensemble.with_prior(prior, fitted, {int(i): int(k) for i, k in zip(ref.ensemble.classes_, fitted)})
    return ReferenceEnsemble(ref.kind, ens, ref.classes, None)
