"""Errors, round/deadline bookkeeping and restartable state for split-learning servers.

State on disk is a directory: ``tensors.safetensors`` (weights, optimizer moments,
stored features) and ``state.json`` (scalars, plus the SHA-256 of the tensor file so a
torn save is detected). Both are written to a temporary name, fsynced and renamed;
the JSON goes last, so a reader sees either the old or the new complete state.
Never pickle.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


class SplitError(ValueError):
    """Base of split-learning protocol errors."""


class SplitProtocolError(SplitError):
    """A client's message is malformed or out of order; close only that client's stream."""


class ClientDropped(SplitProtocolError):
    """The client was dropped (deadline passed or it vanished) and must re-join."""


class SplitStateError(SplitError):
    """Stored server state is missing, torn or inconsistent."""


def check_features(name: str, t: torch.Tensor, shape_tail: tuple[int, ...], max_batch: int) -> None:
    """A received (B, *shape_tail) float32 tensor with 1 <= B <= max_batch, all finite."""
    if t.dtype != torch.float32:
        raise SplitProtocolError(f"{name}: dtype {t.dtype}, expected float32")
    if t.dim() != 1 + len(shape_tail) or tuple(t.shape[1:]) != shape_tail:
        raise SplitProtocolError(f"{name}: shape {tuple(t.shape)}, expected (B, {', '.join(map(str, shape_tail))})")
    if not 1 <= t.shape[0] <= max_batch:
        raise SplitProtocolError(f"{name}: batch of {t.shape[0]}, expected 1..{max_batch}")
    if not bool(torch.isfinite(t).all()):
        raise SplitProtocolError(f"{name}: contains NaN or inf")


class RoundTracker:
    """Who still owes the server something this round, and by when.

    Pure bookkeeping on a caller-supplied clock (``now`` arguments), so it is
    deterministic in tests and works with any event loop."""

    def __init__(self) -> None:
        self.round = 0
        self.deadline = float("inf")
        self._pending: set[str] = set()

    def begin(self, round_idx: int, clients: Iterable[str], deadline: float) -> None:
        self.round, self.deadline, self._pending = round_idx, deadline, set(clients)

    def done(self, client_id: str) -> None:
        self._pending.discard(client_id)

    def pending(self) -> set[str]:
        return set(self._pending)

    def overdue(self, now: float) -> list[str]:
        return sorted(self._pending) if now > self.deadline else []

    def to_dict(self) -> dict[str, Any]:
        return {"round": self.round, "deadline": self.deadline if self.deadline != float("inf") else None,
                "pending": sorted(self._pending)}

    def load_dict(self, d: Mapping[str, Any]) -> None:
        self.round = int(d["round"])
        self.deadline = float("inf") if d["deadline"] is None else float(d["deadline"])
        self._pending = set(d["pending"])


def optimizer_to_state(opt: torch.optim.Optimizer, prefix: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer's state into tensors (``prefix.<param idx>.<key>``) and JSON scalars."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{prefix}.{idx}.{k}"] = v.detach().clone().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"groups": groups, "scalars": scalars}


def optimizer_from_state(opt: torch.optim.Optimizer, prefix: str, tensors: Mapping[str, torch.Tensor],
                         meta: Mapping[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    p = prefix + "."
    for name, t in tensors.items():
        if name.startswith(p):
            idx, key = name[len(p):].split(".", 1)
            state.setdefault(int(idx), {})[key] = t
    for name, v in meta.get("scalars", {}).items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = v
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["groups"]]
    try:
        opt.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError) as e:
        raise SplitStateError(f"optimizer state {prefix!r} does not fit: {e}") from None


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_state(directory: str | Path, tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, Any]) -> None:
    """Write ``tensors`` (safetensors) and JSON ``scalars`` atomically into ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "tensors.safetensors.tmp"
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp))
    with open(tmp, "rb+") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
        os.fsync(f.fileno())
    os.replace(tmp, d / "tensors.safetensors")
    _atomic_write(d / "state.json", json.dumps({"tensors_sha256": digest, "scalars": scalars},
                                               sort_keys=True).encode())


def load_state(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read what :func:`save_state` wrote. Raises SplitStateError if missing, torn or altered."""
    d = Path(directory)
    try:
        meta = json.loads((d / "state.json").read_text())
        raw = (d / "tensors.safetensors").read_bytes()
    except FileNotFoundError as e:
        raise SplitStateError(f"no saved server state in {d}: {e.filename} missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SplitStateError(f"{d / 'state.json'} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or "scalars" not in meta or "tensors_sha256" not in meta:
        raise SplitStateError(f"{d / 'state.json'} lacks scalars / tensors_sha256")
    if hashlib.sha256(raw).hexdigest() != meta["tensors_sha256"]:
        raise SplitStateError(f"{d / 'tensors.safetensors'} does not match state.json (torn or altered save)")
    try:
        tensors = load_file(str(d / "tensors.safetensors"))
    except (SafetensorError, OSError) as e:
        raise SplitStateError(f"{d / 'tensors.safetensors'} is not a safetensors file: {e}") from None
    return tensors, meta["scalars"]
