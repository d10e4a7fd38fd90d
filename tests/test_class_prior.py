"""The ensemble's class-prior correction on a skewed node.

Two classes of the embedded digits (0-4 vs 5-9). The ensemble is fitted on pooled data that
is 84 % positive (what vertical mode with every node's features fits when two of three
nodes are 4/96 and 8/92); node A's own data is 40/60. Without a correction the pooled
ensemble under-predicts A's negatives; re-weighting to A's proportions (`prior="node"`)
must move its predictions toward A's class mix and not lose accuracy on A's held-out data.
"""
from __future__ import annotations

import numpy as np
import pytest

from atdnode.data import load_dataset
from protocols.ensemble import EnsembleClassifier, EnsembleError

pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")


def _skewed():
    d = load_dataset("digits", 8, 1, "train", seed=0)
    X = d.images.reshape(len(d), -1).numpy().astype(np.float64)
    y = (d.labels.numpy() >= 5).astype(np.int64)
    rng = np.random.default_rng(0)
    neg, pos = rng.permutation(np.flatnonzero(y == 0)), rng.permutation(np.flatnonzero(y == 1))
    # node A: 80 neg / 120 pos for training, 40 / 60 held out; the others: 30 neg / 470 pos
    a_tr, a_val = np.r_[neg[:80], pos[:120]], np.r_[neg[80:120], pos[120:180]]
    others = np.r_[neg[120:150], pos[180:650]]
    pooled = np.r_[a_tr, others]
    return X, y, pooled, a_tr, a_val


def test_node_prior_moves_a_skewed_nodes_predictions_toward_its_own_mix():
    X, y, pooled, a_tr, a_val = _skewed()
    assert y[pooled].mean() > 0.8 and abs(y[a_tr].mean() - 0.6) < 0.01
    kw = dict(pca_components=16, mlp_max_iter=200, rf_trees=50, seed=0)
    plain = EnsembleClassifier(**kw).fit(X[pooled], y[pooled])
    own = {0: int((y[a_tr] == 0).sum()), 1: int((y[a_tr] == 1).sum())}
    node = EnsembleClassifier(**kw, prior="node").fit(X[pooled], y[pooled], target_counts=own)
    true_neg = float((y[a_val] == 0).mean())  # 0.4
    neg_plain = float((plain.predict(X[a_val]) == 0).mean())
    neg_node = float((node.predict(X[a_val]) == 0).mean())
    acc = {k: float((m.predict(X[a_val]) == y[a_val]).mean()) for k, m in (("none", plain), ("node", node))}
    print(f"negatives predicted: none {neg_plain:.3f}, node {neg_node:.3f} (true {true_neg:.3f}); accuracy {acc}")
    assert neg_plain < true_neg  # the pooled prior pulls A's negatives into the majority class
    assert abs(neg_node - true_neg) < abs(neg_plain - true_neg)  # corrected toward A's own mix
    assert acc["node"] >= acc["none"]
    # the same members re-weighted after the fact give the same probabilities as a node fit
    counts = np.bincount(y[pooled])
    again = plain.with_prior("node", counts, own)
    np.testing.assert_allclose(again.predict_proba(X[a_val]), node.predict_proba(X[a_val]), rtol=1e-12)
    # and the correction travels with the exported arrays
    arrays, meta = node.to_arrays()
    assert np.array_equal(EnsembleClassifier.from_arrays(arrays, meta).predict(X[a_val]), node.predict(X[a_val]))


def test_prior_errors_are_typed():
    with pytest.raises(EnsembleError, match="prior must be one of"):
        EnsembleClassifier(prior="uniformish")
    with pytest.raises(EnsembleError, match="target_counts"):
        EnsembleClassifier(prior="node").fit(np.eye(4), np.array([0, 1, 0, 1]))
