"""Small file-system helpers shared by the blob store and its resumable downloads.

Contract: `write_all` writes every byte or raises OSError; `fsync` makes a file's bytes and
`fsync_dir` a rename in `d` durable; `remove_quiet` ignores a missing file; `write_error` turns
an OSError into a one-line BlobError that says "disk full" when it was.

Durability is the default and the only mode of a node. `volatile_disk()` turns `fsync` and
`fsync_dir` into no-ops in this process while it runs: for simulations whose node homes are
thrown away when they end (netsim's in-memory back-end, where a crash ends the simulation
too, so no file ever has to survive one); there each of the thousands of writes a scenario
makes waited for the disk (fsync was 17% of a netsim test's time at load 3).
"""
from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from atdnode.errors import BlobError

IO_BUF = 8 << 20  # large buffers: hashlib releases the GIL, syscalls are amortised
_durable = True  # False only inside `volatile_disk()`


def write_error(e: OSError, what: str) -> BlobError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return BlobError(f"disk full while writing {what}: {e.strerror or e}")
    return BlobError(f"cannot write {what}: {e}")


def write_all(fd: int, data: memoryview, offset: int | None = None) -> None:
    """Write all of `data` (os.write/pwrite may write less than asked)."""
    done, n = 0, len(data)
    while done < n:
        piece = data[done:done + IO_BUF]
        w = os.write(fd, piece) if offset is None else os.pwrite(fd, piece, offset + done)
        if w <= 0:
            raise OSError(errno.EIO, "write returned 0")
        done += w


def durable() -> bool:
    """Whether `fsync` / `fsync_dir` reach the disk (always, outside `volatile_disk()`)."""
    return _durable


def fsync(fd: int, *, data_only: bool = False) -> None:
    """`os.fsync(fd)` (`os.fdatasync` with `data_only`); a no-op inside `volatile_disk()`."""
    if _durable:
        (os.fdatasync if data_only else os.fsync)(fd)


@contextmanager
def volatile_disk() -> Iterator[None]:
    """Skip every `fsync` / `fsync_dir` in this process while the block runs (restored after,
    nestable). Simulation only (see the module docstring): nothing a node runs enters it."""
    global _durable
    before, _durable = _durable, False
    try:
        yield
    finally:
        _durable = before


def fsync_dir(d: Path) -> None:
    if not _durable:
        return
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quiet(p: Path | str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
