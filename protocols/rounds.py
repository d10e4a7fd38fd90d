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

Aggregators (`AGGREGATORS`, what `atd rounds --aggregator` offers): the weighted means
FedAvg / FedWAvg, and the Byzantine-robust rules of `protocols.robust` (coordinate-wise
median and trimmed mean, Krum and Multi-Krum). Each is deterministic over the canonically
ordered inputs, so every member recomputes and verifies it. A robust rule takes f, the
number of hostile members it is sized for (trimmed from each end; Krum's f).

Which aggregate of a round counts: every member recomputes it before adopting
it; among those that verify, a final one (inputs from a majority of members) before the
others, the larger input set, then the hash of the inputs (`candidate_order`). A member
cannot win by grinding keys, nor make a round final alone.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protocols.aggregation import HEAD_PREFIXES, AggregationError, uniform_weights
from protocols.fedwavg import fedwavg_weights
from protocols.robust import coordinate_median, krum_select, trimmed_mean
from protocols.weightings import ROUND_AGGREGATORS, weightings

ROUND_WEIGHTINGS = weightings("round")  # the weighted means (round_weights)
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


# ---------------------------------------------------------------- aggregators

@dataclass(frozen=True)
class RoundInputs:
    """What an aggregator may look at, loaded on demand: the count, FedWAvg's last layers
    against the reference's, and Krum's n x n squared distances between whole models."""

    n: int
    q: float = 1.0
    f: int = 1
    reference: Callable[[], np.ndarray] | None = None
    layers: Callable[[], Sequence[np.ndarray]] | None = None
    distances: Callable[[], np.ndarray] | None = None


@dataclass(frozen=True)
class RoundAggregator:
    """A round's aggregation rule. `weights` gives one weight per input (for the weighted
    mean, or, with `combine`, each input's nominal share, recorded and checked like any);
    `combine` (element values of every input, f) -> the global's values, when the rule is
    coordinate-wise instead of a weighted mean. `robust`: sized for f hostile inputs."""

    name: str
    description: str
    weights: Callable[[RoundInputs], np.ndarray]
    combine: Callable[[Sequence[torch.Tensor], int], torch.Tensor] | None = None
    robust: bool = False


def _fedwavg(x: RoundInputs) -> np.ndarray:
    return round_weights("fedwavg", reference=x.reference() if x.reference else None,
                         layers=x.layers() if x.layers else (), q=x.q)


def _krum(m: Callable[[int, int], int]) -> Callable[[RoundInputs], np.ndarray]:
    def weights(x: RoundInputs) -> np.ndarray:
        if x.distances is None:
            raise AggregationError("Krum needs the inputs' distances")
        keep = krum_select(x.distances(), x.f, m(x.n, x.f))
        w = np.zeros(x.n)
        w[keep] = 1.0 / len(keep)
        return w
    return weights


_RULES: dict[str, dict] = {
    "fedavg": dict(weights=lambda x: uniform_weights(x.n)),
    "fedwavg": dict(weights=_fedwavg),
    "median": dict(weights=lambda x: uniform_weights(x.n), combine=lambda v, _f: coordinate_median(v), robust=True),
    "trimmed-mean": dict(weights=lambda x: uniform_weights(x.n), combine=trimmed_mean, robust=True),
    "krum": dict(weights=_krum(lambda n, f: 1), robust=True),
    "multi-krum": dict(weights=_krum(lambda n, f: max(1, n - f)), robust=True),
}
# names and help from protocols.weightings.ROUND_AGGREGATORS (what the CLI lists without torch)
AGGREGATORS: dict[str, RoundAggregator] = {name: RoundAggregator(name, description, **_RULES[name])
                                          for name, description in ROUND_AGGREGATORS.items()}


def aggregator(name: str) -> RoundAggregator:
    """The registered aggregator `name`; AggregationError naming the choices otherwise."""
    try:
        return AGGREGATORS[name]
    except KeyError:
        raise AggregationError(f"unknown round aggregator {name!r}; expected one of {', '.join(AGGREGATORS)}") from None
