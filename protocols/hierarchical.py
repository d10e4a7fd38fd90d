"""Hierarchical (ATD-in-ATD) aggregation: groups aggregate first, then group models combine.

A :class:`GroupModel` is a finished group aggregate: a name, a loader for its
stored tensors, its number of classes and of base models. Nothing here keeps a
registry -- the caller stores group tensors where it likes (blob store,
safetensors file) and hands the loaders back. Combining weights the groups
with ``sqrt-classes`` (VGS-ATD Eq. 11) or ``model-count`` (Eq. 12).

A group that joins later is built on its own (:func:`build_group`) and then
combined with the existing :class:`GroupModel` objects (:func:`add_group`):
the existing groups are read through their loaders, never rebuilt, so their
members are not re-aggregated, nothing is retrained and their stored tensors
are untouched; only the new combination is computed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import save_file

from protocols.aggregation import (AggregationError, Loader, check_weights, compute_weights, counted_quantity,
                                   safetensors_loader, weighted_average)
from protocols.weightings import weightings

__all__ = ["GroupModel", "Combination", "GROUP_WEIGHTINGS", "group_weights", "build_group",
           "combine_groups", "add_group", "persist_safetensors"]

GROUP_WEIGHTINGS = weightings("group")
Persist = Callable[[dict[str, torch.Tensor]], Loader]


@dataclass(frozen=True)
class GroupModel:
    """One group's aggregate. ``tensors_loader()`` returns its tensors (a dict or
    a lazy mapping such as ``SafetensorsStream``); it must return the same
    tensors every time it is called."""

    name: str
    tensors_loader: Loader = field(repr=False)
    n_classes: int
    n_models: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise AggregationError(f"group name must be a non-empty string, got {self.name!r}")
        for what in ("n_classes", "n_models"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AggregationError(f"group {self.name!r}: {what} must be an integer >= 1, got {v!r}")
        if not callable(self.tensors_loader):
            raise AggregationError(f"group {self.name!r}: tensors_loader must be callable")

    def record(self) -> dict:
        """JSON-able description (for an ``aggregate`` ledger entry)."""
        return {"name": self.name, "n_classes": self.n_classes, "n_models": self.n_models}


@dataclass(frozen=True)
class Combination:
    """The combined model and how it was made."""

    tensors: dict[str, torch.Tensor] = field(repr=False)
    groups: list[str]
    weighting: str
    weights: np.ndarray

    def record(self) -> dict:
        return {"groups": list(self.groups), "weighting": self.weighting,
                "weights": [float(w) for w in self.weights]}


def group_weights(groups: Sequence[GroupModel], weighting: str = "sqrt-classes") -> np.ndarray:
    """``sqrt-classes``: sqrt(C_i)/sum sqrt(C_j); ``model-count``: n_i/sum n_j."""
    if not groups:
        raise AggregationError("no groups to weight")
    if weighting not in GROUP_WEIGHTINGS:
        raise AggregationError(f"group weighting must be one of {', '.join(GROUP_WEIGHTINGS)}, got {weighting!r}")
    count = {"classes": lambda g: g.n_classes, "models": lambda g: g.n_models}[counted_quantity(weighting)]
    return compute_weights(weighting, counts=[count(g) for g in groups])


def build_group(name: str, members: Sequence[Loader], weights: Sequence[float], *, n_classes: int,
                persist: Persist, n_models: int | None = None, member_names: Sequence[str] | None = None,
                key_filter: Callable[[str], bool] | None = None,
                accumulate_dtype: torch.dtype = torch.float32) -> GroupModel:
    """Aggregate a group's members (horizontal averaging with ``weights``), store
    the result with ``persist`` (tensors -> loader) and describe it.
    ``n_models`` defaults to the number of members (pass the sum of the
    members' counts when members are themselves groups)."""
    w = check_weights(weights, len(members))
    tensors = weighted_average(members, w, names=member_names, key_filter=key_filter,
                               accumulate_dtype=accumulate_dtype)
    return GroupModel(name, persist(tensors), int(n_classes), int(n_models if n_models is not None else len(members)))


def combine_groups(groups: Sequence[GroupModel], *, weighting: str = "sqrt-classes",
                   key_filter: Callable[[str], bool] | None = None,
                   accumulate_dtype: torch.dtype = torch.float32) -> Combination:
    """Weighted average of the group models (each loaded once, one at a time).
    Errors name the offending group."""
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise AggregationError(f"group names must be distinct, got {names}")
    w = group_weights(groups, weighting)
    tensors = weighted_average([g.tensors_loader for g in groups], w, names=names, key_filter=key_filter,
                               accumulate_dtype=accumulate_dtype)
    return Combination(tensors, names, weighting, w)


def add_group(groups: Sequence[GroupModel], new: GroupModel, **combine: object) -> tuple[list[GroupModel], Combination]:
    """A late group joins: returns the extended group list and its combination.
    Existing groups are reused as they are (see the module doc)."""
    if any(g.name == new.name for g in groups):
        raise AggregationError(f"a group named {new.name!r} already exists")
    extended = [*groups, new]
    return extended, combine_groups(extended, **combine)


def persist_safetensors(path: str | os.PathLike) -> Persist:
    """A ``persist`` for :func:`build_group` that writes ``path`` and streams it back."""
    def persist(tensors: dict[str, torch.Tensor]) -> Loader:
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.fspath(path))
        return safetensors_loader(path)
    return persist
