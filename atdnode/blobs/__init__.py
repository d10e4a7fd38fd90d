"""Blobs: the content-addressed store, reader lists, and moving blobs between members."""
from __future__ import annotations

from atdnode.face import lazy_face

# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"AutoFetcher": "autofetch", "BULK_BYTES": "bulk", "FetchError": "fetch", "fsync": "fs",
         "volatile_disk": "fs", "check_hash": "manifest", "partial_bytes": "partial", "BlobReaders": "readers",
         "BlobStore": "store", "PROTOCOL": "wire", "pack": "wire", "BlobService": "xfer"}
__all__ = [*_FACE]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
