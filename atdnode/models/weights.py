"""Weight sets as safetensors blobs in the blob store.

A weight set is one safetensors file: the tensors, plus a JSON object under the
header metadata key ``"atd"``. Loading never unpickles: the bytes are parsed by the
safetensors library (a JSON header + raw buffers), after the blob hash is verified.

`load_weights` checks, in order: the blob hashes to its name, it parses as safetensors,
the metadata is a JSON object, and (when `expect` is given) key names, shapes and dtypes;
every floating tensor must be finite. Any failure raises WeightsError naming what is
wrong; a corrupt or absent blob raises WeightsBlobError, which is both a WeightsError and
a BlobError (so a fetcher can re-fetch it, and a loader can simply reject it).

A fitted ensemble (`protocols.ensemble.EnsembleClassifier`, the other part a model record may
hold) is stored and read back here too (`save_ensemble`, `load_ensemble`), also as
safetensors: no pickle.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from atdnode.blobs import BlobStore, check_hash
from atdnode.errors import BlobError, WeightsError

if TYPE_CHECKING:  # torch is imported where tensors are made: `atd publish-weights` and the
    import torch  # other header-only readers (`read_meta`) start without it

    from protocols.ensemble import EnsembleClassifier

META_KEY = "atd"
PARTS = ("extractor", "head", "full")  # the weight sets a model is stored and published as
_LIST_MAX = 12  # names listed per problem kind in one error message

Expect = Mapping[str, tuple[Iterable[int], "torch.dtype | str"]]


class WeightsBlobError(WeightsError, BlobError):
    """The blob behind a weight set is absent, corrupt or truncated."""


def save_weights(store: BlobStore, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> str:
    """Serialise `tensors` (detached, moved to CPU, made contiguous) with `meta` as JSON
    under metadata key "atd"; store it and return the blob hash. Deterministic: the same
    tensors and meta give the same hash. WeightsError on non-tensors or non-JSON meta."""
    import torch
    from safetensors.torch import save as st_save

    if not isinstance(tensors, Mapping):
        raise WeightsError(f"weights must be a mapping of name -> tensor, got {type(tensors).__name__}")
    if not isinstance(meta, Mapping):
        raise WeightsError(f"weights metadata must be a mapping, got {type(meta).__name__}")
    try:
        meta_json = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise WeightsError(f"weights metadata is not JSON-serialisable: {e}") from None
    flat: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise WeightsError(f"weight names must be non-empty strings, got {name!r:.60}")
        if not isinstance(t, torch.Tensor):
            raise WeightsError(f"weight {name!r} is not a tensor ({type(t).__name__})")
        if t.layout != torch.strided:
            raise WeightsError(f"weight {name!r} is a {t.layout} tensor; only dense tensors can be saved")
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            # safetensors refuses tensors sharing storage (tied weights, views): give each its own
            if t.untyped_storage().data_ptr() in storages:
                t = t.clone()
            storages.add(t.untyped_storage().data_ptr())
        flat[name] = t
    try:
        data = st_save(flat, metadata={META_KEY: meta_json})
    except (ValueError, RuntimeError, SafetensorError) as e:
        raise WeightsError(f"cannot serialise weights: {e}") from None
    return store.put_bytes(data)


def load_weights(store: BlobStore, h: str, *, expect: Expect | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load and check the weight set in blob `h`; returns (tensors, meta).

    `expect` maps each required name to (shape, dtype); dtype is a torch.dtype or its
    name ("float32"). Raises WeightsError listing missing / extra keys, wrong shapes and
    dtypes and non-finite tensors (each named); WeightsBlobError if the blob is bad."""
    from safetensors.torch import load as st_load

    try:
        h = check_hash(h)
        data = store.get_bytes(h)
    except BlobError as e:
        raise WeightsBlobError(f"weights {str(h)[:16]}: {e}") from None
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError, RuntimeError, TypeError, OverflowError) as e:
        raise WeightsError(f"blob {h} is not a safetensors weight set: {e}") from None
    meta = _meta_from_header(data, h)
    del data
    problems = _layout_problems(tensors, expect) if expect is not None else []
    problems += _finiteness_problems(tensors)
    if problems:
        raise WeightsError(f"weights {h[:16]} rejected: " + "; ".join(problems))
    return tensors, meta


def read_meta(store: BlobStore, h: str) -> dict[str, Any]:
    """The "atd" metadata of a held weight set, reading only the safetensors header.
    Cheap: the blob hash is NOT re-verified here (load_weights does that)."""
    try:
        path = store.path(h)
    except BlobError as e:
        raise WeightsBlobError(str(e)) from None
    try:
        with safe_open(str(path), framework="numpy") as f:  # header only: no torch import
            md = f.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise WeightsError(f"blob {h} is not a safetensors weight set: {e}") from None
    return _parse_meta(md.get(META_KEY), h)


def _meta_from_header(data: bytes, h: str) -> dict[str, Any]:
    # safetensors has already validated the header (u64 length + JSON) when loading
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    md = header.get("__metadata__") or {}
    return _parse_meta(md.get(META_KEY), h)


def _parse_meta(raw: str | None, h: str) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as e:
        raise WeightsError(f"weights {h[:16]}: metadata '{META_KEY}' is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise WeightsError(f"weights {h[:16]}: metadata '{META_KEY}' is not a JSON object")
    return meta


def _dtype(d: torch.dtype | str) -> torch.dtype:
    import torch

    if isinstance(d, torch.dtype):
        return d
    t = getattr(torch, str(d).removeprefix("torch."), None)
    if not isinstance(t, torch.dtype):
        raise TypeError(f"not a torch dtype: {d!r}")
    return t


def _names(xs: list[str]) -> str:
    shown = ", ".join(repr(x) for x in xs[:_LIST_MAX])
    return shown + (f" and {len(xs) - _LIST_MAX} more" if len(xs) > _LIST_MAX else "")


def _layout_problems(tensors: dict[str, torch.Tensor], expect: Expect) -> list[str]:
    out = []
    missing = sorted(set(expect) - set(tensors))
    extra = sorted(set(tensors) - set(expect))
    if missing:
        out.append(f"missing keys: {_names(missing)}")
    if extra:
        out.append(f"extra keys: {_names(extra)}")
    bad_shape, bad_dtype = [], []
    for name in sorted(set(expect) & set(tensors)):
        shape, dtype = expect[name]
        t = tensors[name]
        if tuple(t.shape) != tuple(int(s) for s in shape):
            bad_shape.append(f"{name!r} is {tuple(t.shape)}, expected {tuple(int(s) for s in shape)}")
        if t.dtype != _dtype(dtype):
            bad_dtype.append(f"{name!r} is {t.dtype}, expected {_dtype(dtype)}")
    for kind, items in (("wrong shape", bad_shape), ("wrong dtype", bad_dtype)):
        if items:
            more = f" and {len(items) - _LIST_MAX} more" if len(items) > _LIST_MAX else ""
            out.append(f"{kind}: " + ", ".join(items[:_LIST_MAX]) + more)
    return out


def _all_finite(t: torch.Tensor) -> bool:
    """One allocation-free pass: min/max propagate NaN, and show +-inf (10x faster than isfinite().all())."""
    import torch

    if t.numel() == 0:
        return True
    if t.is_complex():
        t = torch.view_as_real(t)
    try:
        lo, hi = torch.aminmax(t)
    except RuntimeError:  # dtypes without a CPU min/max kernel (e.g. float8)
        return bool(torch.isfinite(t.float()).all())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _finiteness_problems(tensors: dict[str, torch.Tensor]) -> list[str]:
    import torch

    bad = []
    for name in sorted(tensors):
        t = tensors[name]
        if not (t.is_floating_point() or t.is_complex()) or _all_finite(t):
            continue
        n_nan = int(torch.isnan(t).sum())
        n_inf = int(torch.isinf(t).sum())
        bad.append(f"{name!r} has {n_nan} NaN and {n_inf} inf values")
    if not bad:
        return []
    more = f" and {len(bad) - _LIST_MAX} more" if len(bad) > _LIST_MAX else ""
    return ["non-finite tensors: " + ", ".join(bad[:_LIST_MAX]) + more]


def save_ensemble(store: BlobStore, ens: EnsembleClassifier) -> str:
    """Store the fitted ensemble as a safetensors blob (no pickle); returns its hash."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="atd-ensemble-") as tmp:
        path = Path(tmp) / "ensemble.safetensors"
        ens.save(path)
        return store.put_file(path)


def load_ensemble(store: BlobStore, blob: str) -> EnsembleClassifier:
    """A stored ensemble, hash-checked and shape-validated (EnsembleClassifier.load);
    WeightsBlobError for an absent or corrupt blob, WeightsError for one that is not an ensemble."""
    from protocols.ensemble import EnsembleClassifier, EnsembleError

    try:
        store.verify(blob)
        return EnsembleClassifier.load(store.path(blob))
    except BlobError as exc:
        raise WeightsBlobError(f"ensemble {blob[:16]}: {exc}") from None
    except EnsembleError as exc:
        raise WeightsError(f"ensemble {blob[:16]}: {exc}") from None
