"""Byzantine-robust aggregation rules: pure functions over the inputs' tensors, no I/O.

Flower ships the same family (FedMedian, FedTrimmedAvg, Krum); atd's rounds offer them
(`protocols.rounds.AGGREGATORS`) so one hostile member cannot drag the global model.

- coordinate-wise median (Yin et al., "Byzantine-Robust Distributed Learning: Towards
  Optimal Statistical Rates", ICML 2018, Sec. 3 "median-based GD"): each element of the
  global is the median of that element over the inputs; with an even count, the mean of
  the two middle values.
- coordinate-wise trimmed mean (same paper, "trimmed-mean-based GD"): drop the f largest
  and f smallest values of each element, average the rest. The paper trims a fraction
  beta; here f inputs from each end (beta = f / n), capped at (n - 1) // 2 so at least one
  value stays.
- Krum / Multi-Krum (Blanchard et al., "Machine Learning with Adversaries: Byzantine
  Tolerant Gradient Descent", NeurIPS 2017, Sec. 4): input i scores the sum of its squared
  distances to its n - f - 2 nearest other inputs; Krum keeps the lowest-scoring input,
  Multi-Krum (Sec. 5) averages the m lowest. The paper applies it to gradients; atd's
  rounds apply it to the models trained from one reference (the same thing shifted by the
  reference, so distances are unchanged). Deviation: the paper needs n > 2f + 2; with
  fewer inputs the neighbour count is clamped to at least 1 (n >= 2) instead of failing
  the round, and a single input is kept as is.

Determinism (every member recomputes a round bit for bit): values are combined in float64
by elementwise IEEE operations in a fixed order -- sorting is exact, the kept values are
summed left to right (`acc = acc + x`) and divided once -- and cast back to the input
dtype. Krum's squared distances are accumulated per tensor in float64 in the inputs'
(canonical) order by numpy's own loops (not a threaded BLAS, whose summation order and
speed depend on the machine); ties in score go to the earlier input.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from protocols.weightings import AggregationError

__all__ = ["coordinate_median", "trimmed_mean", "trim_count", "krum_scores", "krum_select", "krum_neighbours",
           "pairwise_sq_distances"]


def _stack(values: Sequence[torch.Tensor]) -> tuple[np.ndarray, torch.dtype, tuple[int, ...]]:
    if len(values) == 0:
        raise AggregationError("a robust rule needs at least one input")
    first = values[0]
    for i, v in enumerate(values):
        if v.shape != first.shape or v.dtype != first.dtype:
            raise AggregationError(f"input {i} has shape {tuple(v.shape)} / {v.dtype}, input 0 has "
                                   f"{tuple(first.shape)} / {first.dtype}")
    arr = np.stack([_f64(v) for v in values])
    if not np.all(np.isfinite(arr)):
        raise AggregationError(f"input {int(np.argwhere(~np.isfinite(arr))[0][0])} has non-finite values")
    return arr, first.dtype, tuple(first.shape)


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def _f64(v: torch.Tensor) -> np.ndarray:
    """Flat float64 copy; numpy casts where it can (torch's cast is threaded, slow under load)."""
    v = v.detach().cpu()
    if v.dtype in _NUMPY:
        return v.numpy().reshape(-1).astype(np.float64)
    return v.to(torch.float64).numpy().reshape(-1)


def _mean_rows(rows: np.ndarray) -> np.ndarray:
    """Left-to-right sum of `rows` (first axis), then one division: a fixed arithmetic order."""
    acc = rows[0].copy()
    for r in rows[1:]:
        acc = acc + r
    return acc / float(rows.shape[0])


def _back(arr: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not dtype.is_floating_point:  # integer buffers: keep the median's value, rounded
        return torch.from_numpy(np.rint(arr)).to(dtype).reshape(shape)
    if dtype in _NUMPY:
        return torch.from_numpy(arr.astype(_NUMPY[dtype])).reshape(shape)
    return torch.from_numpy(arr).to(dtype).reshape(shape)


def coordinate_median(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Elementwise median of same-shaped tensors (even count: mean of the two middle values)."""
    arr, dtype, shape = _stack(values)
    s = np.sort(arr, axis=0)
    n = s.shape[0]
    mid = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2.0
    return _back(mid, dtype, shape)


def trim_count(n: int, f: int) -> int:
    """How many values trimmed_mean drops from each end: f, capped so one value stays."""
    if f < 0:
        raise AggregationError(f"trim count must be >= 0, got {f}")
    return min(f, (n - 1) // 2)


def trimmed_mean(values: Sequence[torch.Tensor], f: int) -> torch.Tensor:
    """Elementwise mean after dropping the `f` largest and `f` smallest values (`trim_count`)."""
    arr, dtype, shape = _stack(values)
    k = trim_count(arr.shape[0], f)
    s = np.sort(arr, axis=0)
    return _back(_mean_rows(s[k:s.shape[0] - k]), dtype, shape)


def pairwise_sq_distances(tensor_sets: Sequence[Sequence[torch.Tensor]]) -> np.ndarray:
    """n x n squared Euclidean distances between inputs, each given as its tensors in one
    order (the same keys for every input); accumulated per tensor in float64."""
    n = len(tensor_sets)
    d = np.zeros((n, n), dtype=np.float64)
    if n == 0:
        return d
    for j in range(len(tensor_sets[0])):
        arr, _, _ = _stack([ts[j] for ts in tensor_sets])
        for a in range(n):
            for b in range(a + 1, n):
                diff = arr[a] - arr[b]
                d[a, b] = d[b, a] = d[a, b] + float(np.einsum("i,i->", diff, diff))  # numpy's own loop, not BLAS
    return d


def krum_neighbours(n: int, f: int) -> int:
    """Krum's n - f - 2 nearest neighbours, clamped to [1, n - 1] (module doc)."""
    if f < 0:
        raise AggregationError(f"Krum's f must be >= 0, got {f}")
    return max(1, min(n - 1, n - f - 2))


def krum_scores(dist: np.ndarray, f: int) -> np.ndarray:
    """Blanchard et al. Sec. 4: score(i) = sum of squared distances to its n - f - 2 nearest."""
    n = dist.shape[0]
    if n == 1:
        return np.zeros(1)
    k = krum_neighbours(n, f)
    return np.array([float(np.sum(np.sort(np.delete(dist[i], i))[:k])) for i in range(n)])


def krum_select(dist: np.ndarray, f: int, m: int = 1) -> list[int]:
    """Indices of the `m` lowest Krum scores (ties: the earlier input), ascending index order.
    m = 1: Krum; m = n - f: Multi-Krum as Sec. 5 suggests."""
    n = dist.shape[0]
    if not 1 <= m <= n:
        raise AggregationError(f"Krum keeps between 1 and {n} inputs, got {m}")
    scores = krum_scores(dist, f)
    order = sorted(range(n), key=lambda i: (scores[i], i))
    return sorted(order[:m])
