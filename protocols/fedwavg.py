"""FedWAvg (Eq. 3 of "Federated Adversarial Training with Transformers", Sec. 3; Algorithm 1
lines 23-29): weights from the similarity of last layers.

``c_i = cos(L_ref, L_i)``, ``w_i = softmax_i(q * c_i)`` where ``L_i`` is input i's last layer -- its weight
*and* bias, flattened and concatenated -- and ``L_ref`` the same layer of the reference
model: the aggregating node's previous global model, or its own model when it has none
(the caller picks it and names it in the ``aggregate`` entry). Each input is compared with
the reference only, never with another input, so reordering the inputs reorders the
weights and leaves the average unchanged.

The paper gives no value for the scale q. ``ROUNDS_Q`` (the default of `atd rounds` and
netsim's fat-fedwavg) was chosen by measurement (tests/test_fat.py, bench/fat_bench.py;
digits 28 px, ViT d=64 depth 2, K = 5, the paper's Non-IID(2), SGD momentum 0.9, PGD
adversarial training): the cosines of the clients' heads against the previous global lie
within about 0.8-0.96 of each other, so q = 1 leaves every weight within 0.02 of 1/K
(FedAvg in all but name) while q = 10 moves them 0.04-0.14 away from 1/K = 0.2 (min 0.07,
max 0.27) and q >= 30 hands nearly all weight to one client (round-0 weights
0.003-0.51 at q = 30). On IID shards the same q = 10 stays within 0.01 of 1/K, as the
paper's Sec. 3 reports.

For timm ViTs the last layer is ``head.{weight,bias}`` when all heads share one label
space (and the reference's head has it too), else the last encoder block's
``blocks.{L-1}.mlp.fc2.{weight,bias}`` (:func:`last_layer_keys`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from protocols.weightings import AggregationError
from protocols.vit_config import CLASSIFIER

__all__ = ["ROUNDS_Q", "fedwavg_cosines", "fedwavg_weights", "softmax_weights", "last_layer_key", "last_layer_keys",
           "layer_vector"]

ROUNDS_Q = 10.0  # FedWAvg's q for training rounds, chosen by measurement (module doc)

Layer = torch.Tensor | np.ndarray | Sequence[float]


def fedwavg_weights(reference: Layer | Sequence[Layer], layers: Sequence[Layer | Sequence[Layer]], *,
                    q: float = 1.0) -> np.ndarray:
    """``softmax_i(q * cos(reference, layers[i]))`` (Eq. 3).

    A reference or layer may be one tensor or a list of tensors (weight and bias), which
    are flattened and concatenated; they are compared in float64, and every layer must
    have the reference's size and a non-zero, finite norm. ``q`` sharpens the weighting as
    it grows; ``q = 0`` gives uniform weights.
    """
    return softmax_weights(fedwavg_cosines(reference, layers), q=q)


def fedwavg_cosines(reference: Layer | Sequence[Layer], layers: Sequence[Layer | Sequence[Layer]]) -> np.ndarray:
    """``c_i = g . l_i / (|g| |l_i|)`` of Eq. 3 (Algorithm 1 line 26), in float64."""
    if len(layers) == 0:
        raise AggregationError("fedwavg needs at least one layer")
    ref = layer_vector(reference, "reference", None)
    cos = np.empty(len(layers), dtype=np.float64)
    for i, layer in enumerate(layers):
        v = layer_vector(layer, f"layer {i}", ref.shape)
        cos[i] = float(ref @ v) / (np.linalg.norm(ref) * np.linalg.norm(v))
    return cos


def softmax_weights(cosines: np.ndarray, *, q: float) -> np.ndarray:
    """``w_i = exp(q c_i) / sum_j exp(q c_j)`` (Eq. 3, Algorithm 1 line 27)."""
    if not math.isfinite(q):
        raise AggregationError(f"fedwavg scale q must be finite, got {q!r}")
    z = q * np.asarray(cosines, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def layer_vector(t: Layer | Sequence[Layer], what: str, shape: tuple | None) -> np.ndarray:
    """One flat float64 vector of a tensor, or of a list of tensors concatenated."""
    parts = t if isinstance(t, (list, tuple)) and t and not np.isscalar(t[0]) else [t]
    arrs = [p.detach().cpu().double().numpy().reshape(-1) if isinstance(p, torch.Tensor)
            else np.asarray(p, np.float64).reshape(-1) for p in parts]
    arr = np.concatenate(arrs)
    if shape is not None and arr.shape != shape:
        raise AggregationError(f"fedwavg {what} has {arr.size} elements, reference has {shape[0]}")
    if not np.all(np.isfinite(arr)) or not np.linalg.norm(arr) > 0:
        raise AggregationError(f"fedwavg {what} must be finite with non-zero norm")
    return arr


def last_layer_keys(keys: Iterable[str], *, heads_comparable: bool) -> list[str]:
    """The tensors FedWAvg compares for a timm ViT: ``head.weight`` (+ ``head.bias``) when
    the heads share a label space, else the last block's ``mlp.fc2.weight`` (+ bias)."""
    keys = set(keys)
    if heads_comparable and f"{CLASSIFIER}.weight" in keys:
        base = CLASSIFIER
    else:
        blocks = [int(k.split(".")[1]) for k in keys
                  if k.startswith("blocks.") and k.endswith(".mlp.fc2.weight") and k.split(".")[1].isdigit()]
        if not blocks:
            raise AggregationError(f"no '{CLASSIFIER}.weight' or 'blocks.N.mlp.fc2.weight' to compare")
        base = f"blocks.{max(blocks)}.mlp.fc2"
    return [f"{base}.weight"] + ([f"{base}.bias"] if f"{base}.bias" in keys else [])


def last_layer_key(keys: Iterable[str], *, heads_comparable: bool) -> str:
    """The weight tensor of :func:`last_layer_keys` (its first key)."""
    return last_layer_keys(keys, heads_comparable=heads_comparable)[0]
