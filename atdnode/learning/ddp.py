"""Several processes (or GPUs) training one node's model through torchrun + DDP.

Launch either way:

    torchrun --standalone --nproc_per_node 2 --no-python atd train --home H --data digits ...
    atd train --home H --data digits ... --nproc-per-node 2     # re-executes itself as above

`atdnode.learning.training.train` calls `init_from_env()`: under torchrun (WORLD_SIZE > 1) it joins
the process group — gloo on CPU, NCCL on CUDA — and otherwise returns a one-process
context, so the same code path serves both.

How the math lines up with one process: every rank builds the same global batch (same
seeded permutation), takes a contiguous slice of it, and scales its summed loss by
world / global_batch; DDP's gradient *average* then equals the one-process gradient of
the mean loss over the global batch (up to float summation order).
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # True when we initialised the process group (and must destroy it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) in place across ranks; a no-op for one process."""
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def slice(self, n: int) -> tuple[int, int]:
        """This rank's contiguous [lo, hi) part of a global batch of n rows."""
        per, extra = divmod(n, self.world)
        lo = self.rank * per + min(self.rank, extra)
        return lo, lo + per + (1 if self.rank < extra else 0)


def pick_device(pref: str | None = None, local_rank: int = 0) -> torch.device:
    """`atdnode.learning.device.resolve_device` without a home (kept for callers of the old name)."""
    from atdnode.learning.device import resolve_device

    return resolve_device(pref, local_rank=local_rank)


def check_nproc(nproc: int, device: str | None = None) -> None:
    """`--nproc-per-node N` needs N GPUs when the ranks run on CUDA (NCCL refuses two ranks
    on one GPU); on the CPU (`device="cpu"`, or no CUDA) any N runs with gloo."""
    from atdnode.learning.device import DeviceError, parse_device

    dev = parse_device(device) if device else (torch.device("cuda") if torch.cuda.is_available() else None)
    if dev is None or dev.type != "cuda" or nproc <= 1:
        return
    have = torch.cuda.device_count()
    if dev.index is not None:
        raise DeviceError(f"--nproc-per-node {nproc} with --device {device}: every rank would use one GPU "
                          "(give --device cuda for one GPU per rank, or --device cpu for gloo)")
    if have < nproc:
        raise DeviceError(f"--nproc-per-node {nproc} needs {nproc} GPUs, this machine has {have} "
                          "(use --nproc-per-node {0} or --device cpu to run the ranks on the CPU with gloo)".format(have))


def init_from_env(device: "str | torch.device | None" = None, home=None) -> DistContext:
    """Join torchrun's process group when WORLD_SIZE > 1, else a single-process context.
    The device follows `atdnode.learning.device.resolve_device(device, home=home)`."""
    from atdnode.learning.device import resolve_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, home=home, local_rank=local)
    if world <= 1:
        return DistContext(device=dev)
    owns = False
    if not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        owns = True
    return DistContext(rank=rank, world=world, local_rank=local, device=dev, owns_group=owns)


def shutdown(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def torchrun_argv(nproc: int, argv: list[str]) -> list[str]:
    """Command line that re-runs `argv` (an `atd ...` invocation) under torchrun."""
    exe = shutil.which("torchrun")
    head = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    return head + ["--standalone", f"--nproc_per_node={nproc}", "--no-python", *argv]
