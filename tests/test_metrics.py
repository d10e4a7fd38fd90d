"""One scorer: `atd train`'s evaluation, `atd classify` and netsim report the same numbers for
the same predictions: macro over the classes present, explicit labels."""
import numpy as np
import pytest
import torch
from torch import nn

from atdnode.data import LabeledImages
from atdnode.learning import classification_metrics
from atdnode.learning.training import evaluate
from netsim.learn import score


class _Echo(nn.Module):
    """Predicts the class written in pixel (0, 0, 0) of each image: fixed predictions."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return nn.functional.one_hot(x[:, 0, 0, 0].long(), self.num_classes).float() + 0 * self.dummy


# 4 classes in the label space; class 3 never appears in the truth, but is predicted once
Y_TRUE = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 1])
Y_PRED = np.array([0, 0, 1, 1, 1, 2, 2, 0, 3, 1])


def _per_class_f1(cls: int) -> float:
    tp = np.sum((Y_PRED == cls) & (Y_TRUE == cls))
    prec = tp / max(1, np.sum(Y_PRED == cls))
    rec = tp / max(1, np.sum(Y_TRUE == cls))
    return 0.0 if tp == 0 else 2 * prec * rec / (prec + rec)


def test_macro_over_present_classes_known_answer():
    m = classification_metrics(Y_TRUE, Y_PRED, labels=range(4))
    expected = np.mean([_per_class_f1(c) for c in (0, 1, 2)])  # not class 3: absent from the truth
    assert m["f1"] == pytest.approx(expected)
    assert m["f1"] > np.mean([_per_class_f1(c) for c in range(4)])  # averaging over all 4 labels is lower
    assert m["accuracy"] == pytest.approx(0.7) and m["recall"] == m["sensitivity"]
    assert m["confusion"][2] == [1, 0, 2, 1] and len(m["confusion"]) == 4 and m["n"] == 10


def test_train_classify_and_netsim_agree_on_the_same_predictions():
    images = torch.zeros(len(Y_PRED), 1, 2, 2)
    images[:, 0, 0, 0] = torch.as_tensor(Y_PRED, dtype=torch.float32)
    data = LabeledImages(images, torch.as_tensor(Y_TRUE), ["a", "b", "c", "d"])
    trained = evaluate(_Echo(4), data, device="cpu")  # what `atd train` records
    net = score(Y_TRUE, Y_PRED)  # what netsim reports
    direct = classification_metrics(Y_TRUE, Y_PRED, labels=range(4))  # what `atd classify` computes
    for k in ("accuracy", "precision", "sensitivity", "f1"):
        assert trained[k] == pytest.approx(direct[k]) == pytest.approx(net[k], abs=1e-6), k
    assert trained["confusion"] == direct["confusion"]


def test_labels_must_cover_every_class():
    with pytest.raises(ValueError, match="outside the label space"):
        classification_metrics(Y_TRUE, Y_PRED, labels=range(3))
    with pytest.raises(ValueError, match="predictions"):
        classification_metrics(Y_TRUE, Y_PRED[:-1], labels=range(4))
    assert classification_metrics([], [], labels=range(2))["f1"] == 0.0
