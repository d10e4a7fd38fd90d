"""Horizontal VGS-ATD on strongly skewed nodes: three nodes over a
two-class task with class ratios 40/60, 4/96 and 8/92 — node-to-node transfer, one-time
averaging, then the paper's ensemble on the fused extractor with the features the nodes
sealed to each other — must not collapse to the majority class: its macro-F1 beats the
majority-class predictor's and the worst single node's, on a balanced test set."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from atdnode.learning import run_classify as classify
from atdnode.aggregation import EnsembleOptions, share_features
from atdnode.aggregation.horizontal import aggregate_horizontal
from atdnode.models import publish_weights
from tests.vgs_homes import consortium, peer_ids, sync, train_node

pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
RATIOS = {"a": (0.40, 0.60), "b": (0.04, 0.96), "c": (0.08, 0.92)}  # (normal, pneumonia)
PER_NODE = 240


def two_class_npz(root: Path) -> dict[str, str]:
    """digits 0-4 = "normal", 5-9 = "pneumonia"; each node's train split in its ratio,
    disjoint across nodes; one balanced test split shared by all (150 + 150)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.clip(np.round(d.images * (255 / 16)), 0, 255).astype(np.uint8)
    y = (d.target >= 5).astype(np.int64)
    rng = np.random.default_rng(0)
    pools = [list(rng.permutation(np.flatnonzero(y == c))) for c in (0, 1)]
    test = np.concatenate([[pools[c].pop() for _ in range(150)] for c in (0, 1)])
    specs = {}
    for n, ratio in RATIOS.items():
        idx = np.concatenate([[pools[c].pop() for _ in range(round(PER_NODE * ratio[c]))] for c in (0, 1)])
        path = root / f"{n}.npz"
        np.savez(path, train_images=images[idx], train_labels=y[idx], test_images=images[test],
                 test_labels=y[test], classes=np.array(["normal", "pneumonia"]))
        specs[n] = f"npz:{path}"
    return specs


@pytest.mark.slow  # trains three ViTs and their ensembles
def test_horizontal_on_skewed_class_ratios_beats_majority_and_worst_node(tmp_path: Path) -> None:
    specs = two_class_npz(tmp_path)
    homes = consortium(tmp_path / "homes", list(RATIOS))
    train_node(homes[0], specs["a"], epochs=3)  # node-to-node transfer: a's model is the start
    base = publish_weights(homes[0], part="full")
    sync(homes)
    single, inputs = {}, []
    for h, n in zip(homes, RATIOS):
        rec = train_node(h, specs[n], init_from=base.blob, epochs=2, lr=1e-3, seed=1)
        single[n] = classify(h, specs[n], model=rec.id).metrics["f1"]
        inputs.append(publish_weights(h, part="full").entry.id.hex())
    sync(homes)
    opts = EnsembleOptions(pca_components=32, mlp_hidden=(64,), mlp_max_iter=150, rf_trees=40)
    for h, n in zip(homes, RATIOS):  # fuse once, share features under the fused extractor
        aggregate_horizontal(h, inputs=inputs, data_spec=specs[n], options=opts)
        others = [p for p in peer_ids(homes) if p != peer_ids([h])[0]]
        share_features(h, to=others, data_spec=specs[n])
    sync(homes)
    res = aggregate_horizontal(homes[1], inputs=inputs, data_spec=specs["b"], options=opts)  # the 4/96 node
    assert res.weights == [1 / 3] * 3 and len(res.details["features"]) == 2
    glob = classify(homes[1], specs["b"], model=res.model_id).metrics  # the global model (keep may not use it)
    majority_f1 = (0.0 + 2 * 0.5 / 1.5) / 2  # all "pneumonia" on a balanced test set: F1 0 and 2/3
    print(f"single nodes' macro-F1 {single}, horizontal + ensemble {glob['f1']:.3f} (acc {glob['accuracy']:.3f})")
    assert glob["f1"] > majority_f1 + 0.1
    assert glob["f1"] > min(single.values()) + 0.05
    assert min(np.asarray(glob["confusion"]).sum(axis=0)) > 0.2 * glob["n"] / 2  # both classes predicted
