"""netsim.fit_share: simulated nodes that hold the same features share one ensemble fit."""
from __future__ import annotations

import numpy as np
import pytest

from netsim.fit_share import replayed_s, shared_ensemble_fits
from protocols.ensemble import EnsembleClassifier, EnsembleError

PARAMS = dict(pca_components=6, mlp_hidden=(16,), mlp_max_iter=30, rf_trees=5, seed=3)


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(3), 20)
    return (rng.normal(size=(60, 10)) + y[:, None]).astype(np.float32), y


def _arrays(ens: EnsembleClassifier) -> dict[str, np.ndarray]:
    return ens.to_arrays()[0]


def _same(a: EnsembleClassifier, b: EnsembleClassifier) -> bool:
    x, y = _arrays(a), _arrays(b)
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def test_a_shared_fit_is_the_fit_bit_for_bit_and_is_charged_its_time() -> None:
    X, y = _data()
    fresh = EnsembleClassifier(**PARAMS).fit(X, y)
    with shared_ensemble_fits():
        first = EnsembleClassifier(**PARAMS).fit(X, y)
        r0 = replayed_s()
        second = EnsembleClassifier(**PARAMS).fit(X.copy(), y.copy())
        assert replayed_s() > r0  # looked up: charged the first fit's seconds
        assert _same(fresh, first) and _same(fresh, second)
        assert np.array_equal(second.predict_proba(X), fresh.predict_proba(X))
        for ens in (first, second):  # each holds its own copy: changing one changes no later fit
            ens._arrays["mlp.w0"][0, 0] += 1.0
        assert _same(fresh, EnsembleClassifier(**PARAMS).fit(X, y))
    assert EnsembleClassifier.fit.__module__ == "protocols.ensemble"  # restored


@pytest.mark.parametrize("change", ["one value of X", "one label", "a hyper-parameter", "node prior counts"])
def test_anything_the_fit_reads_differing_means_a_fit_of_its_own(change: str) -> None:
    X, y = _data()
    params, counts = {**PARAMS, "prior": "node"}, {0: 5, 1: 5}
    X2, y2, params2, counts2 = X.copy(), y.copy(), dict(params), dict(counts)
    if change == "one value of X":
        X2[7, 3] += 1e-3
    elif change == "one label":
        y2[0] = 1
    elif change == "a hyper-parameter":
        params2["rf_trees"] = 6
    else:
        counts2[2] = 1
    with shared_ensemble_fits():
        EnsembleClassifier(**params).fit(X, y, target_counts=counts)
        r0 = replayed_s()
        got = EnsembleClassifier(**params2).fit(X2, y2, target_counts=counts2)
        assert replayed_s() == r0
    assert _same(got, EnsembleClassifier(**params2).fit(X2, y2, target_counts=counts2))


def test_counts_a_prior_does_not_read_do_not_split_fits_and_failures_are_not_kept() -> None:
    X, y = _data()
    with shared_ensemble_fits():
        EnsembleClassifier(**PARAMS, prior="balanced").fit(X, y, target_counts={0: 1})
        r0 = replayed_s()
        EnsembleClassifier(**PARAMS, prior="balanced").fit(X, y, target_counts={1: 9})
        assert replayed_s() > r0
        for _ in range(2):  # one class: an error every time, never a stored result
            with pytest.raises(EnsembleError, match="at least 2 classes"):
                EnsembleClassifier(**PARAMS).fit(X, np.zeros(len(y), np.int64))
