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

Which aggregate of a round counts: every member recomputes it before adopting
it; among those that verify, a final one (inputs from a majority of members) before the
others, the larger input set, then the hash of the inputs (`candidate_order`). A member
cannot win by grinding keys, nor make a round final alone.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from protocols.aggregation import HEAD_PREFIXES, AggregationError, uniform_weights
from protocols.fedwavg import fedwavg_weights
from protocols.weightings import weightings

ROUND_WEIGHTINGS = weightings("round")
LAST_LAYER = tuple(f"{HEAD_PREFIXES[0]}{name}" for name in ("weight", "bias"))  # the classifier: head.weight, head.bias


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
    """Who records round t's aggregate: the smallest peer id among its publishers. (Only who
    does the work: which aggregate counts is `candidate_order`, which no key choice moves.)"""
    if not publishers:
        raise AggregationError("no publishers in this round")
    return min(publishers)


def inputs_digest(ids: Sequence[str]) -> str:
    """SHA-256 over a round's canonical input ids (the tie-break between equal-size aggregates)."""
    return hashlib.sha256("\n".join(canonical(ids)).encode()).hexdigest()


def is_final(participants: int, members: int) -> bool:
    """A round aggregate is final when its inputs come from a majority of the members: no
    single member (of three or more) can make one alone, and a member that was late adopts
    a final aggregate instead of training the round again."""
    return 2 * participants > members


def candidate_order(candidates: Sequence[tuple[Sequence[str], str]], members: int) -> list[int]:
    """Indices of a round's aggregates, given as (input entry ids, entry id), in the order
    they are tried: final ones first, then the larger input set, then the smaller
    `inputs_digest`, then the smaller entry id (same inputs: same global, bit for bit). None
    of it depends on who signed (the old rule, smallest signer peer id, could be ground).
    The adopter takes the first one that verifies (`atdnode.rounds.runner`)."""
    def key(i: int) -> tuple:
        ids, eid = candidates[i]
        return (not is_final(len(set(ids)), members), -len(set(ids)), inputs_digest(ids), eid)
    return sorted(range(len(candidates)), key=key)
