"""Small file-system helpers shared by the blob store and its resumable downloads.

Contract: `write_all` writes every byte or raises OSError; `fsync_dir` makes a rename in
`d` durable; `remove_quiet` ignores a missing file; `write_error` turns an OSError into a
one-line BlobError that says "disk full" when it was.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

from atdnode.errors import BlobError

IO_BUF = 8 << 20  # large buffers: hashlib releases the GIL, syscalls are amortised


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


def fsync_dir(d: Path) -> None:
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
