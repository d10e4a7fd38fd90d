"""Aggregation rules: weightings and a streaming weighted average of tensor dicts.

Weightings are registered in :mod:`protocols.weightings` (name, rule, help, where each
applies); :func:`compute_weights` dispatches on that registry.

The average (:func:`weighted_average`) takes *loaders* -- zero-argument
callables returning a mapping ``name -> torch.Tensor`` -- so only one input is
materialised at a time. With :func:`safetensors_loader` inputs nothing is
materialised: :class:`SafetensorsStream` maps small windows of each file and
the result is computed chunk by chunk from all inputs at once, so peak memory
is the result plus a few MiB.

Arithmetic contract (so a peer can recompute an aggregate bit for bit and
compare hashes): for every element, in input order,
``acc = w_0 * x_0`` then ``acc = acc + (w_i * x_i)``, each ``*`` and ``+`` a
separately rounded IEEE-754 operation (no fused multiply-add) in the
accumulation dtype; the result is cast back to the input dtype. The
accumulation dtype is ``promote(input dtype, accumulate_dtype)``: float32 by
default (error after N inputs is a few ulp), or ``accumulate_dtype=torch.float64``
for extra precision at about half the speed (and, for loaders other than
safetensors streams, twice the accumulator memory).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from protocols.weightings import AggregationError
from protocols.fedwavg import fedwavg_weights, last_layer_key, last_layer_keys
from protocols.safetensors_stream import (WINDOW_BYTES, SafetensorsLoader, SafetensorsStream,  # noqa: F401
                                          safetensors_loader)
from protocols.vit_config import CLASSIFIER
from protocols.weightings import (REGISTRY, model_count_weights, sample_weights, sqrt_class_weights,
                                  uniform_weights, weightings)

__all__ = [
    "AggregationError", "WEIGHTINGS", "HEAD_PREFIXES", "Loader",
    "uniform_weights", "sample_weights", "sqrt_class_weights", "model_count_weights",
    "fedwavg_weights", "COUNTED", "counted_quantity", "compute_weights", "check_weights", "last_layer_key", "last_layer_keys",
    "load_tensor", "part_filter", "SafetensorsStream", "safetensors_loader",
    "weighted_average",
]

Loader = Callable[[], Mapping[str, torch.Tensor]]
# every weighting compute_weights knows (registered in protocols.weightings)
WEIGHTINGS = weightings("average") + tuple(n for n in weightings("group") if n not in weightings("average"))
HEAD_PREFIXES = (f"{CLASSIFIER}.",)  # timm ViT classifier; everything else is the extractor
CHUNK_BYTES = 512 * 1024  # arithmetic chunk: its product stays in L2 until it is added
_WEIGHT_SUM_TOL = 1e-6
_NP_FLOAT = {torch.float32: np.float32, torch.float64: np.float64}


# ---------------------------------------------------------------- weightings

# Each count-based weighting names the quantity it counts per input ("samples", "classes",
# "models") and its rule; callers read the count off their inputs by that name
# (`atdnode.aggregation.aggregate.input_weights`, `protocols.hierarchical.group_weights`).
COUNTED: dict[str, tuple[str, Callable[[Sequence[float]], np.ndarray]]] = {
    n: (w.counts, w.rule) for n, w in REGISTRY.items() if w.counts is not None and w.rule is not None}


def counted_quantity(weighting: str) -> str | None:
    """What a weighting counts per input ("samples", "classes", "models"), None for uniform
    and fedwavg; AggregationError for a name outside :data:`WEIGHTINGS`."""
    if weighting not in WEIGHTINGS:
        raise AggregationError(f"unknown weighting {weighting!r}; expected one of {', '.join(WEIGHTINGS)}")
    return COUNTED[weighting][0] if weighting in COUNTED else None


def compute_weights(weighting: str, *, n: int | None = None, counts: Sequence[float] | None = None,
                    reference: torch.Tensor | np.ndarray | None = None,
                    layers: Sequence[torch.Tensor | np.ndarray] | None = None,
                    q: float = 1.0) -> np.ndarray:
    """Dispatch by name (one of :data:`WEIGHTINGS`, the table :data:`COUNTED`).

    ``uniform`` uses ``n``; ``samples``/``sqrt-classes``/``model-count`` use
    ``counts`` (samples, classes, or base models per input); ``fedwavg`` uses
    ``reference``, ``layers`` and ``q``.
    """
    if weighting == "uniform":
        return uniform_weights(n if n is not None else len(counts or layers or []))
    if weighting in COUNTED:
        if counts is None:
            raise AggregationError(f"weighting {weighting!r} needs counts")
        return COUNTED[weighting][1](counts)
    if weighting == "fedwavg":
        if reference is None or layers is None:
            raise AggregationError("weighting 'fedwavg' needs reference and layers")
        return fedwavg_weights(reference, layers, q=q)
    raise AggregationError(f"unknown weighting {weighting!r}; expected one of {', '.join(WEIGHTINGS)}")


def check_weights(weights: Sequence[float], n: int | None = None) -> np.ndarray:
    """Return ``weights`` as float64 if they are a probability vector (finite,
    >= 0, sum 1 within 1e-6, length ``n``); raise :class:`AggregationError` if not.
    They are used as given (no renormalisation), so recorded weights replay exactly."""
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise AggregationError(f"weights must be numbers: {e}") from None
    if w.ndim != 1 or w.size == 0:
        raise AggregationError("weights must be a non-empty 1-D sequence")
    if n is not None and w.size != n:
        raise AggregationError(f"{w.size} weights for {n} inputs")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise AggregationError(f"weights must be finite and >= 0, got {w.tolist()}")
    if abs(w.sum() - 1.0) > _WEIGHT_SUM_TOL:
        raise AggregationError(f"weights must sum to 1, got sum {w.sum()!r}")
    return w


def load_tensor(loader: Loader, key: str) -> torch.Tensor:
    """One tensor of one input (e.g. its FedWAvg layer), closing lazy sources."""
    src = loader()
    try:
        if key not in src:
            raise AggregationError("missing", key=key)
        return src[key].detach().clone()
    finally:
        _close(src)


def part_filter(*, include_head: bool,
                head_prefixes: Sequence[str] = HEAD_PREFIXES) -> Callable[[str], bool]:
    """Key predicate: extractor keys only, or extractor + head (only when the
    inputs' label spaces match)."""
    prefixes = tuple(head_prefixes)
    if include_head:
        return lambda key: True
    return lambda key: not key.startswith(prefixes)


# ---------------------------------------------------------------- averaging

def weighted_average(loaders: Sequence[Loader], weights: Sequence[float], *,
                     names: Sequence[str] | None = None,
                     key_filter: Callable[[str], bool] | None = None,
                     accumulate_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Average CPU tensor dicts without holding more than one input.

    ``loaders[i]()`` returns input i as a mapping ``name -> CPU tensor``. Only
    keys accepted by ``key_filter`` take part. Input 0 fixes the structure;
    every other input must have the same keys, shapes and dtypes, and every
    value must be finite -- otherwise :class:`AggregationError` names the
    input (index and ``names[i]``) and the key. ``weights`` must already be a
    probability vector (see :func:`check_weights`). Floating tensors are
    averaged per the module's arithmetic contract; non-floating tensors (e.g.
    counters) must be equal in all inputs and are passed through. Returns a
    new dict in input 0's key order and dtypes. Errors raised by a loader
    propagate with a note naming the input.

    Two schedules, same result bit for bit:

    * every loader a :class:`SafetensorsLoader`: all files are opened (headers
      only; all structure is checked before any arithmetic) and each chunk of
      the result is computed from all inputs while it sits in cache, so the
      accumulator goes through memory once instead of once per input. Memory:
      the result plus a few MiB of mapped windows;
    * otherwise: one input after the other (loaded, added, released), so
      memory is one input plus the accumulator.

    Finiteness is checked once, on the result (a NaN or infinity in any input
    reaches it, even with weight 0); only if that fails are the loaders
    called again to find the input that holds it.
    """
    loaders = list(loaders)
    w = check_weights(weights, len(loaders))
    if accumulate_dtype not in (torch.float32, torch.float64):
        raise AggregationError(f"accumulate_dtype must be torch.float32 or torch.float64, got {accumulate_dtype}")
    if names is not None and len(names) != len(w):
        raise AggregationError(f"{len(names)} names for {len(w)} inputs")
    names = list(names) if names is not None else [None] * len(w)
    accept = key_filter or (lambda key: True)
    if all(isinstance(loader, SafetensorsLoader) for loader in loaders):
        out, not_finite = _average_side_by_side(loaders, w, names, accept, accumulate_dtype)
    else:
        out, not_finite = _average_one_by_one(loaders, w, names, accept, accumulate_dtype)
    if not_finite:
        _locate_non_finite(loaders, names, not_finite)
    return out


def _load(loader: Loader, i: int, name: str | None) -> Mapping[str, torch.Tensor]:
    try:
        src = loader()
    except Exception as e:
        e.add_note(f"while loading aggregation input {i}" + (f" ({name})" if name else ""))
        raise
    if not isinstance(src, Mapping):
        _close(src)
        raise AggregationError(f"loader returned {type(src).__name__}, not a mapping", index=i, name=name)
    return src


def _close(src: object) -> None:
    close = getattr(src, "close", None)
    if callable(close):
        close()


def _locate_non_finite(loaders: Sequence[Loader], names: list[str | None], keys: list[str]) -> None:
    for i, loader in enumerate(loaders):
        src = _load(loader, i, names[i])
        try:
            for key in keys:
                if not bool(torch.isfinite(src[key]).all()):
                    raise AggregationError("contains NaN or infinity", index=i, name=names[i], key=key)
        finally:
            _close(src)
    raise AggregationError("weighted sum overflows although every input is finite", key=keys[0])


def _filtered_keys(src: Mapping[str, torch.Tensor], i: int, name: str | None,
                   accept: Callable[[str], bool], spec: dict) -> list[str]:
    """Input i's keys (in input 0's order for i > 0); missing/extra keys are errors."""
    keys = [k for k in src.keys() if accept(k)]
    if i == 0:
        if not keys:
            raise AggregationError("no tensors to average (after the key filter)", index=i, name=name)
        return keys
    present = set(keys)
    missing = [k for k in spec if k not in present]
    if missing:
        raise AggregationError("missing (present in input 0)", index=i, name=name, key=missing[0])
    extra = [k for k in keys if k not in spec]
    if extra:
        raise AggregationError("not present in input 0", index=i, name=name, key=extra[0])
    return list(spec)


def _admit(spec: dict, i: int, name: str | None, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if i == 0:
        spec[key] = (shape, dtype)
    elif (shape, dtype) != spec[key]:
        raise AggregationError(f"{shape} {dtype} differs from input 0's {spec[key][0]} {spec[key][1]}",
                               index=i, name=name, key=key)


def _same_as_first(value: torch.Tensor, first: torch.Tensor, i: int, name: str | None, key: str) -> None:
    if not torch.equal(value, first):
        raise AggregationError("non-floating tensor differs from input 0", index=i, name=name, key=key)


def _new_acc(shape: tuple[int, ...], dtype: torch.dtype, accumulate_dtype: torch.dtype) -> np.ndarray:
    # numpy allocations get transparent huge pages: far fewer page faults
    return np.empty(shape, dtype=_NP_FLOAT[torch.promote_types(dtype, accumulate_dtype)])


def _result(acc: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(acc)
    return t if t.dtype == dtype else t.to(dtype)


def _average_side_by_side(loaders: Sequence[SafetensorsLoader], w: np.ndarray, names: list[str | None],
                          accept: Callable[[str], bool], accumulate_dtype: torch.dtype
                          ) -> tuple[dict[str, torch.Tensor], list[str]]:
    streams: list[SafetensorsStream] = []
    try:
        spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for i, loader in enumerate(loaders):  # open every input and check all structure first
            streams.append(_load(loader, i, names[i]))
            for key in _filtered_keys(streams[i], i, names[i], accept, spec):
                _admit(spec, i, names[i], key, *streams[i].spec(key))
        window = max(4 * CHUNK_BYTES, WINDOW_BYTES // len(streams))  # all windows together ~ WINDOW_BYTES
        for s in streams:
            s.window_bytes = window
        out, not_finite = {}, []
        work = {t: np.empty(CHUNK_BYTES // 2, dtype=t) for t in (np.float32, np.float64)}  # >= any chunk
        for key in sorted(spec, key=streams[0].offset):  # file order: windows are reused
            shape, dtype = spec[key]
            if not dtype.is_floating_point:
                first = streams[0][key]
                for i in range(1, len(streams)):
                    _same_as_first(streams[i][key], first, i, names[i], key)
                out[key] = first
                continue
            acc = _new_acc(shape, dtype, accumulate_dtype)
            flat, step, finite = acc.reshape(-1), max(1, CHUNK_BYTES // dtype.itemsize), True
            with np.errstate(all="ignore"):  # NaN/inf are detected on the result
                for pos in range(0, flat.size, step):
                    n = min(step, flat.size - pos)
                    for i, s in enumerate(streams):
                        _add_chunk(s.view(key, pos, n), flat, work[flat.dtype.type], pos, float(w[i]), i == 0)
                    finite = finite and _finite(flat[pos:pos + n])
            if not finite:
                not_finite.append(key)
            out[key] = _result(acc, dtype)  # a float64 accumulator is cast as soon as its key is done
    finally:
        for s in streams:
            _close(s)
    return {key: out[key] for key in spec}, not_finite


def _average_one_by_one(loaders: Sequence[Loader], w: np.ndarray, names: list[str | None],
                        accept: Callable[[str], bool], accumulate_dtype: torch.dtype
                        ) -> tuple[dict[str, torch.Tensor], list[str]]:
    spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    acc: dict[str, np.ndarray | torch.Tensor] = {}
    work = {t: np.empty(CHUNK_BYTES // 2, dtype=t) for t in (np.float32, np.float64)}
    not_finite: list[str] = []
    last = len(loaders) - 1
    for i, loader in enumerate(loaders):
        src = _load(loader, i, names[i])
        try:
            with np.errstate(all="ignore"):  # NaN/inf are detected on the result
                for key in _filtered_keys(src, i, names[i], accept, spec):
                    tensor = src[key]
                    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                        raise AggregationError("value is not a CPU torch.Tensor", index=i, name=names[i], key=key)
                    _admit(spec, i, names[i], key, tuple(tensor.shape), tensor.dtype)
                    if not tensor.dtype.is_floating_point:
                        if i == 0:
                            acc[key] = tensor.clone()
                        else:
                            _same_as_first(tensor, acc[key], i, names[i], key)
                        continue
                    if i == 0:
                        acc[key] = _new_acc(tuple(tensor.shape), tensor.dtype, accumulate_dtype)
                    flat, x = acc[key].reshape(-1), tensor.detach().reshape(-1)
                    step = max(1, CHUNK_BYTES // tensor.dtype.itemsize)
                    for pos in range(0, x.numel(), step):
                        _add_chunk(x[pos:pos + step], flat, work[flat.dtype.type], pos, float(w[i]), i == 0)
                    if i == last and not _finite(flat):
                        not_finite.append(key)
        finally:
            _close(src)
    out = {}
    for key, (_, dtype) in spec.items():
        a = acc.pop(key)  # free each float64 accumulator as soon as it is cast
        out[key] = a if isinstance(a, torch.Tensor) else _result(a, dtype)
    return out, not_finite


def _finite(a: np.ndarray) -> bool:
    # one cheap reduction; only a non-finite sum (NaN, inf, or overflow) needs the exact test
    return math.isfinite(a.sum()) or bool(np.isfinite(a).all())


def _add_chunk(chunk: torch.Tensor, acc: np.ndarray, work: np.ndarray, pos: int, wi: float,
               first: bool) -> None:
    """``acc[pos:pos+n] = wi * chunk`` (first input) or ``+= wi * chunk``.

    numpy on cache-sized chunks: single-threaded (small torch ops would each
    pay a thread hand-off, slow on a busy machine), and product and sum are
    separately rounded, so no fused multiply-add can make results differ
    between CPUs.
    """
    n = chunk.numel()
    dst = acc[pos:pos + n]
    prod = dst if first else work[:n]
    if chunk.dtype == torch.bfloat16:  # numpy has no bfloat16: widen exactly in torch
        torch.from_numpy(prod).copy_(chunk)
        np.multiply(prod, wi, out=prod)
    else:
        x = chunk.numpy()
        if x.dtype != prod.dtype:  # exact upcast first (faster than a casting ufunc loop)
            np.copyto(prod, x)
            x = prod
        np.multiply(x, wi, out=prod)  # w rounded to the accumulation dtype
    if not first:
        np.add(dst, prod, out=dst)
