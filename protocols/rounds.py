"""Round rules of serverless federated (adversarial) training: pure functions, no I/O.

Federated Adversarial Training with Transformers (FedWAvg), Sec. 3 / Eq. 3: in round t
every client starts from the global model w^{t-1}, trains locally (PGD on part of each
batch), and the new global model is sum_i a_i w_i^t with
a_i = softmax_i(q * cos(L(w^{t-1}), L(w_i^t))), L = the last layer. atd takes the last
layer as the classifier's weight AND bias concatenated (the paper compares "the last
layer"; its bias is part of it). FedAvg (McMahan et al.) is the same with a_i = 1/K
(atd's rounds weight clients equally; sample weighting is not offered here).

Serverless determinism: the inputs of a round are sorted canonically (by entry id) before
any arithmetic, so every member computing over the same set gets the same weights and,
with protocols.aggregation's fixed arithmetic order, the bit-identical global model.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from protocols.aggregation import AggregationError, uniform_weights
from protocols.fedwavg import fedwavg_weights

ROUND_WEIGHTINGS = ("fedavg", "fedwavg")
LAST_LAYER = ("head.weight", "head.bias")


def last_layer_vector(tensors: Mapping[str, torch.Tensor], keys: Sequence[str] = LAST_LAYER) -> np.ndarray:
    """The FedWAvg comparison vector: `keys` flattened and concatenated in float64."""
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise AggregationError("missing (FedWAvg compares the last layer)", key=missing[0])
    return np.concatenate([tensors[k].detach().cpu().double().reshape(-1).numpy() for k in keys])


def round_weights(weighting: str, *, reference: np.ndarray | None = None,
                  layers: Sequence[np.ndarray] = (), q: float = 1.0) -> np.ndarray:
    """a_i for one round: FedAvg 1/K, or FedWAvg Eq. 3 against the previous global model."""
    if weighting == "fedavg":
        return uniform_weights(len(layers))
    if weighting == "fedwavg":
        if reference is None:
            raise AggregationError("fedwavg rounds need the previous global model as reference")
        return fedwavg_weights(reference, list(layers), q=q)
    raise AggregationError(f"unknown round weighting {weighting!r}; expected one of {', '.join(ROUND_WEIGHTINGS)}")


def canonical(ids: Sequence[str]) -> list[str]:
    """The order every member uses for a round's inputs: sorted hex entry ids (each once)."""
    return sorted(set(ids))


def choose_coordinator(publishers: Sequence[str]) -> str:
    """Who records round t's aggregate: the smallest peer id among its publishers."""
    if not publishers:
        raise AggregationError("no publishers in this round")
    return min(publishers)


def canonical_aggregate(candidates: Sequence[tuple[str, str]]) -> int:
    """Index of the round's canonical aggregate among (signer peer id, entry id) pairs: the
    smallest signer, then the smallest entry id. Two members that both recorded a round
    (a coordinator thought dead) converge on the same one at the next round's start."""
    if not candidates:
        raise AggregationError("no aggregate candidates")
    return min(range(len(candidates)), key=lambda i: candidates[i])
