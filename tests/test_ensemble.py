"""EnsembleClassifier: soft vote on digits, numpy predictors == sklearn, pickle-free round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from protocols.ensemble import FORMAT, EnsembleClassifier, EnsembleError


@pytest.fixture(scope="module")
def digits():
    X, y = load_digits(return_X_y=True)  # raw 8x8 pixels stand in for CLS features
    return train_test_split(X, y, test_size=0.25, stratify=y, random_state=0)


@pytest.fixture(scope="module")
def fitted(digits):
    Xtr, _, ytr, _ = digits
    return EnsembleClassifier(pca_components=500, seed=0).fit(Xtr, ytr)


def test_pca_capped_and_classes(fitted, digits):
    _, meta = fitted.to_arrays()
    assert meta["pca_components"] == 64  # min(500 requested, 1347 samples, 64 features)
    assert fitted.classes_.tolist() == list(range(10))


def test_soft_vote_matches_or_beats_best_member(fitted, digits):
    _, Xte, _, yte = digits
    members = {n: float((fitted.classes_[p.argmax(1)] == yte).mean()) for n, p in fitted.member_proba(Xte).items()}
    ens = float((fitted.predict(Xte) == yte).mean())
    assert set(members) == {"mlp", "rf", "svm"}
    assert ens >= max(members.values()) - 0.01, (ens, members)
    assert ens > 0.93  # ten digit classes: chance 0.1 (and not below the best member, above)
    proba = fitted.predict_proba(Xte)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose(proba, np.mean(list(fitted.member_proba(Xte).values()), axis=0), atol=1e-15)


def test_numpy_predictors_equal_sklearn(fitted, digits):
    _, Xte, _, _ = digits
    Z = fitted.transform(Xte)
    for name, p in fitted.member_proba(Xte).items():
        np.testing.assert_allclose(p, fitted.estimators_[name].predict_proba(Z), rtol=0, atol=1e-9, err_msg=name)


def test_round_trip_identical(fitted, digits, tmp_path):
    _, Xte, _, _ = digits
    arrays, meta = fitted.to_arrays()
    assert all(isinstance(v, np.ndarray) and v.dtype != object for v in arrays.values())
    json.dumps(meta)  # JSON-able
    again = EnsembleClassifier.from_arrays(arrays, meta)
    assert np.array_equal(again.predict_proba(Xte), fitted.predict_proba(Xte))
    fitted.save(tmp_path / "ens.safetensors")
    loaded = EnsembleClassifier.load(tmp_path / "ens.safetensors")
    assert np.array_equal(loaded.predict_proba(Xte), fitted.predict_proba(Xte))
    assert np.array_equal(loaded.predict(Xte), fitted.predict(Xte))


def test_disjoint_label_spaces_combined(digits):
    Xtr, Xte, ytr, yte = digits
    parts = [np.isin(ytr, s) for s in ([0, 1, 2], [3, 4, 5], [6, 7, 8, 9])]
    X = np.concatenate([Xtr[m] for m in parts])
    y = np.concatenate([ytr[m] for m in parts])
    ens = EnsembleClassifier(pca_components=32, seed=1, rf_trees=50).fit(X, y)
    assert ens.classes_.tolist() == list(range(10))
    assert (ens.predict(Xte) == yte).mean() > 0.9


def test_tiny_classes_and_binary(digits):
    Xtr, Xte, ytr, _ = digits
    X = np.concatenate([Xtr[ytr == 0][:6], Xtr[ytr == 1][:2], Xtr[ytr == 2][:1]])
    y = np.array([0] * 6 + [1] * 2 + [2])
    ens = EnsembleClassifier(seed=0, rf_trees=10, mlp_hidden=(16,)).fit(X, y)  # one sample: no CV folds
    p = ens.predict_proba(Xte[:20])
    assert p.shape == (20, 3) and np.allclose(p.sum(1), 1)
    again = EnsembleClassifier.from_arrays(*ens.to_arrays())
    assert np.array_equal(again.predict_proba(Xte[:20]), p)
    yb = np.array([7] * 6 + [9] * 3)
    binary = EnsembleClassifier(seed=0, rf_trees=10, mlp_hidden=(16,)).fit(X, yb)
    Z = binary.transform(Xte[:20])
    for name, pm in binary.member_proba(Xte[:20]).items():
        np.testing.assert_allclose(pm, binary.estimators_[name].predict_proba(Z), atol=1e-9, err_msg=name)
    assert set(binary.predict(Xte[:20])) <= {7, 9}
    assert np.array_equal(EnsembleClassifier.from_arrays(*binary.to_arrays()).predict_proba(Xte[:20]),
                          binary.predict_proba(Xte[:20]))


def test_member_subset_and_standardize_off(digits):
    Xtr, Xte, ytr, yte = digits
    ens = EnsembleClassifier(seed=0, members=("svm",), standardize=False, pca_components=20).fit(Xtr, ytr)
    arrays, meta = ens.to_arrays()
    assert "scaler.mean" not in arrays and not any(k.startswith(("mlp.", "rf.")) for k in arrays)
    assert (ens.predict(Xte) == yte).mean() > 0.85


@pytest.mark.parametrize("X, y, match", [
    (np.zeros((4, 3)), np.zeros(4, int), "2 classes"),
    (np.zeros((4, 3)), np.array([0, 1, 0]), "integer labels"),
    (np.zeros((4, 3)), np.array([0.0, 1, 0, 1]), "integer labels"),
    (np.array([[0.0, np.nan], [1, 1]]), np.array([0, 1]), "NaN"),
    (np.zeros(4), np.array([0, 1, 0, 1]), "2-D"),
])
def test_bad_training_data(X, y, match):
    with pytest.raises(EnsembleError, match=match):
        EnsembleClassifier().fit(X, y)


def test_bad_params_and_unfitted(fitted):
    with pytest.raises(EnsembleError):
        EnsembleClassifier(pca_components=0)
    with pytest.raises(EnsembleError):
        EnsembleClassifier(members=("knn",))
    with pytest.raises(EnsembleError, match="not fitted"):
        EnsembleClassifier().predict(np.zeros((1, 3)))
    with pytest.raises(EnsembleError, match="features"):
        fitted.predict(np.zeros((2, 5)))


def _tampered(fitted, edit):
    arrays, meta = fitted.to_arrays()
    edit(arrays, meta)
    return arrays, meta


@pytest.mark.parametrize("edit, match", [
    (lambda a, m: a.pop("svm.coef"), "missing array 'svm.coef'"),
    (lambda a, m: a.__setitem__("pca.components", a["pca.components"][:, :10]), "pca shapes"),
    (lambda a, m: a.__setitem__("mlp.w1", a["mlp.w1"][:, :5]), "mlp"),
    (lambda a, m: a["rf.left"].__setitem__(0, 0), "tree links"),  # a self-loop would never end
    (lambda a, m: a["rf.right"].__setitem__(0, 10 ** 6), "tree links"),
    (lambda a, m: a["rf.feature"].__setitem__(0, 999), "tree links"),
    (lambda a, m: a.__setitem__("rf.offsets", a["rf.offsets"][:-1]), "random forest array sizes"),
    (lambda a, m: a["svm.intercept"].__setitem__(0, np.nan), "svm.intercept"),
    (lambda a, m: a.__setitem__("classes", a["classes"][::-1].copy()), "sorted"),
    (lambda a, m: a.__setitem__("classes", a["classes"].astype(np.float64)), "classes"),
    (lambda a, m: m.__setitem__("format", "pickle"), "export"),
    (lambda a, m: m["params"].__setitem__("bogus", 1), "params"),
])
def test_from_arrays_rejects_tampering(fitted, edit, match):
    with pytest.raises(EnsembleError, match=match):
        EnsembleClassifier.from_arrays(*_tampered(fitted, edit))


def test_load_rejects_foreign_file(tmp_path):
    save_file({"x": np.zeros(3)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(EnsembleError, match="not an ensemble"):
        EnsembleClassifier.load(tmp_path / "x.safetensors")
    (tmp_path / "junk").write_bytes(b"\x00" * 4)
    with pytest.raises(EnsembleError):
        EnsembleClassifier.load(tmp_path / "junk")
    assert FORMAT == "atd-ensemble-v1"


# ---------------------------------------------------------------- vertical mode (protocols.vgs)

def test_vertical_disjoint_nodes_share_encrypted_features(digits):
    """Three nodes with disjoint digit classes; node 0 builds one 10-class classifier."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from protocols.feature_crypto import open_sealed, public_bytes, seal
    from protocols.vgs import fit_vertical_ensemble

    Xtr, Xte, ytr, yte = digits
    spaces = [["0", "1", "2"], ["3", "4", "5"], ["6", "7", "8", "9"]]
    keys = [X25519PrivateKey.generate() for _ in spaces]
    local = []
    for names in spaces:  # each node's own features, labels index its own class list
        mask = np.isin(ytr, [int(c) for c in names])
        local.append((Xtr[mask].astype(np.float32), np.array([names.index(str(v)) for v in ytr[mask]]), names))
    # nodes 1 and 2 seal their features to node 0 (and to each other)
    blobs = [seal(X, y, names, {f"n{j}": public_bytes(keys[j]) for j in range(3) if j != i}, keys[i],
                  sender_id=f"n{i}") for i, (X, y, names) in enumerate(local)]
    received = [open_sealed(blobs[i], keys[0], "n0") for i in (1, 2)]
    ens, classes = fit_vertical_ensemble([local[0], *received], pca_components=32, seed=0, rf_trees=50)
    assert classes == [str(d) for d in range(10)]
    predicted = np.array([int(classes[c]) for c in ens.predict(Xte)])
    assert (predicted == yte).mean() > 0.9


def test_merge_labeled_features():
    from protocols.vgs import merge_labeled_features

    a = (np.ones((2, 3), np.float32), np.array([1, 0]), ["cat", "dog"])
    b = (np.zeros((1, 3), np.float32), np.array([0]), ["ant"])
    m = merge_labeled_features([a, b])
    assert m.classes == ["ant", "cat", "dog"] and m.y.tolist() == [2, 1, 0] and m.X.shape == (3, 3)
    assert merge_labeled_features([b, a]).classes == m.classes  # arrival order does not matter
    with pytest.raises(EnsembleError, match="features"):
        merge_labeled_features([a, (np.zeros((1, 4), np.float32), np.array([0]), ["ant"])])
    with pytest.raises(EnsembleError, match="index"):
        merge_labeled_features([(np.zeros((1, 3)), np.array([2]), ["a", "b"])])
    with pytest.raises(EnsembleError, match="not in the target"):
        merge_labeled_features([a], classes=["cat"])
    with pytest.raises(EnsembleError, match="no feature"):
        merge_labeled_features([])
