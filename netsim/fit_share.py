"""Ensemble fits the simulated nodes of one process share (netsim's in-memory back-end only).

In a VGS-ATD features round every node of the step fits its ensemble on its own features
plus the feature sets its peers sealed to it under the same fused extractor, concatenated
in one canonical order (by sender peer id, `atdnode.aggregation.ensemble.gather_parts`), with
every random choice following the scenario seed: nodes holding the same features fit the
same classifier, bit for bit. On real hardware each node spends that compute on its own
machine; in one simulation process the same fit ran once per node (three_phase: 19
second-pass fits, 4 distinct; the fits were 55% of the scenario's time).

`shared_ensemble_fits()` makes `EnsembleClassifier.fit` look a fit up by the exact bytes
it depends on (the hyper-parameters, X, y, and the node's class counts when the prior
correction reads them) and, on a hit, give the new classifier a copy of the first fit's
arrays — what refitting would compute. A fit that raises is never stored. The seconds the
first fit took are added to `replayed_s()` on each hit, so netsim still charges every node
the compute its own fit would take (`vgs_ops.NodeOps.aggregate`).
"""
from __future__ import annotations

import copy
import hashlib
import json
import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import numpy as np

_replayed = [0.0]


def replayed_s() -> float:
    """Seconds of fitting looked up instead of recomputed so far in this process."""
    return _replayed[0]


def fit_key(params: Mapping[str, Any], X: np.ndarray, y: np.ndarray, target_counts: Mapping[int, int] | None
            ) -> bytes:
    """A digest of everything `EnsembleClassifier.fit` reads. The node's own class counts
    enter only under `prior="node"` (the only prior that reads them)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(json.dumps(dict(params), sort_keys=True, default=str).encode())
    for a in (np.asarray(X), np.asarray(y)):
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    if params.get("prior") == "node":
        h.update(json.dumps(sorted((int(k), int(v)) for k, v in (target_counts or {}).items())).encode())
    return h.digest()


@contextmanager
def shared_ensemble_fits(keep: int = 32) -> Iterator[None]:
    """Within the block, identical ensemble fits are computed once (bounded LRU; restored after)."""
    from protocols.ensemble import EnsembleClassifier

    original = EnsembleClassifier.fit
    fits: OrderedDict[bytes, tuple[dict, dict, dict, float]] = OrderedDict()

    def fit(self: EnsembleClassifier, X: np.ndarray, y: np.ndarray, *,
            target_counts: Mapping[int, int] | None = None) -> EnsembleClassifier:
        key = fit_key(self.params, X, y, target_counts)
        hit = fits.get(key)
        if hit is None:
            t0 = time.perf_counter()
            original(self, X, y, target_counts=target_counts)
            fits[key] = ({k: v.copy() for k, v in self._arrays.items()}, copy.deepcopy(self._meta),
                         dict(self.estimators_), time.perf_counter() - t0)
            if len(fits) > keep:
                fits.popitem(last=False)
            return self
        fits.move_to_end(key)
        arrays, meta, estimators, seconds = hit
        self._arrays = {k: v.copy() for k, v in arrays.items()}
        self._meta = copy.deepcopy(meta)
        self.estimators_ = dict(estimators)
        _replayed[0] += seconds
        return self

    EnsembleClassifier.fit = fit  # type: ignore[method-assign]
    try:
        yield
    finally:
        EnsembleClassifier.fit = original  # type: ignore[method-assign]
