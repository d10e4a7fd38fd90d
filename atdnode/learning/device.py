"""The node's one device rule (ARCHITECTURE: "One device rule").

Every step that runs a model takes its device from `resolve_device`:

1. an explicit choice (a `device=` argument), else
2. the `ATD_DEVICE` environment variable — what `--device` on any `atd` command sets
   (`apply_device`), so every step of that command and every process it starts (daemon
   roles, netsim nodes) follows it, else
3. the node's `config.toml`:

       [compute]
       device = "cuda:1"      # or "cpu", "cuda"; absent: the default below

4. else CUDA when present (`cuda:<local_rank mod count>` under torchrun), else the CPU.

A CUDA choice on a machine without CUDA, an index past the last GPU, or anything that is
not `cpu` / `cuda` / `cuda:N` is a `DeviceError` (one line) raised *before* any data is
loaded. What crosses the wire or the ledger never depends on the device: weights leave
through `atdnode.models.weights` as CPU safetensors bytes, and arithmetic that others recompute
(aggregation averages) stays on the CPU.
"""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from atdnode.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from atdnode.node import NodeHome

ENV = "ATD_DEVICE"
_SPEC = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
CHOICES = "cpu, cuda or cuda:N"


class DeviceError(ConfigError):
    """A device choice this machine cannot honour, or one that is not a device name."""


def parse_device(spec: str) -> torch.device:
    """`cpu` / `cuda` / `cuda:N` -> torch.device, checked against this machine."""
    import torch  # lazily: the CLI imports this module, and torch costs ~300 MB per process

    text = str(spec).strip().lower()
    m = _SPEC.match(text)
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise DeviceError(f"device {spec!r}: expected {CHOICES}")
    if m.group(1) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {spec!r}: CUDA is not available on this machine (use --device cpu)")
    n = torch.cuda.device_count()
    idx = int(m.group(2)) if m.group(2) is not None else None
    if idx is not None and idx >= n:
        raise DeviceError(f"device {spec!r}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return torch.device("cuda", idx if idx is not None else torch.cuda.current_device())


def configured_device(home: "NodeHome | None") -> str | None:
    """The `[compute] device` of HOME/config.toml, or None (no home, no file, no key)."""
    if home is None or not home.config_file.exists():
        return None
    from atdnode.node import NodeHandle

    return NodeHandle.of(home).config.compute_device()


def default_device(local_rank: int = 0) -> torch.device:
    """CUDA when present (one GPU per local rank), else the CPU."""
    import torch  # lazily: the CLI imports this module, and torch costs ~300 MB per process

    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_device(pref: "str | torch.device | None" = None, *, home: "NodeHome | None" = None,
                   local_rank: int = 0) -> torch.device:
    """The device a model runs on: `pref`, else $ATD_DEVICE, else HOME's `[compute] device`,
    else the default (CUDA when present).

    Under torchrun with a bare `cuda` (from either source) each local rank takes its own
    GPU, `cuda:<local_rank>`; an explicit `cuda:N` is kept as given.
    """
    import torch  # lazily: the CLI imports this module, and torch costs ~300 MB per process

    if isinstance(pref, torch.device):
        pref = str(pref)
    spec = pref or os.environ.get(ENV) or configured_device(home)
    if not spec:
        return default_device(local_rank)
    dev = parse_device(spec)
    if dev.type == "cuda" and str(spec).strip().lower() == "cuda" and local_rank:
        return parse_device(f"cuda:{local_rank}")
    return dev


def apply_device(pref: str | None, home: "NodeHome | None" = None) -> torch.device:
    """A command's `--device`: checked here (a `DeviceError` before any data loads) and, when
    given, exported as $ATD_DEVICE for every step of the command and the processes it starts."""
    dev = resolve_device(pref, home=home)
    if pref:
        os.environ[ENV] = str(pref).strip().lower()
    return dev


def use_amp(device: torch.device) -> bool:
    """bf16 autocast where it pays: on CUDA. The CPU stays in float32 (bitwise resumable)."""
    return device.type == "cuda"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host synchronisation: pinned, non-blocking on CUDA
    (a pageable copy may wait for the stream); unchanged when already there."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
