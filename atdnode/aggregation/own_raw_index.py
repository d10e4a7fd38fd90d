"""The node's own raw-pixel ensemble, fitted once per node home for the same inputs.

After every aggregation the keep decision judges the node's raw-pixel ensemble
(`atdnode.aggregation.candidates.raw_pixel_candidate`): `fit_own_raw` on the training split of
its data spec under the aggregation's ensemble options. That fit is seeded and reads only its
inputs, so as long as the data, the options and the input size stay the same every decision
would fit the same ensemble again — in a daemon's process, and in each `atd aggregate`.
`own_raw_blob` fits it once per `own_raw_key` (the digest of the loaded training images,
labels, class names, the options with their seed, and the versions that fit) and keeps an
index in the node home:

    HOME/cache/own-raw/<key>.json   {"key", "ensemble": blob hash, "classes": [...], "samples": n}

The ensemble itself is a blob of the home's store (`save_ensemble`). A lookup is used only when
its key matches and the blob is still held and hash-checks (a collected or damaged blob, or an
unreadable index file, is dropped and the ensemble fitted again); within a process
`fit_own_raw` keeps its own last fits. Changing any part of the key — another training split,
option, seed or input size — misses and fits.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from atdnode.aggregation.ensemble_refs import fit_own_raw, own_raw_key
from atdnode.blobs import BlobStore
from atdnode.data import LabeledImages
from atdnode.errors import BlobError
from atdnode.learning import ModelConfig
from atdnode.models import save_ensemble
from atdnode.node import NodeHome


@dataclass(frozen=True)
class OwnRaw:
    """A stored raw-pixel ensemble: its blob, the class names its outputs index, whether it was
    fitted now (False: found in the home's index)."""

    blob: str
    classes: list[str]
    fitted: bool


def index_file(home: NodeHome, key: str) -> Path:
    return home.cache_dir / "own-raw" / f"{key}.json"


def own_raw_blob(home: NodeHome | None, store: BlobStore, train: LabeledImages, cfg: ModelConfig,
                 **ensemble) -> OwnRaw:
    """`fit_own_raw(train, cfg, **ensemble)` saved in `store`, looked up first in `home`'s index
    (none: no index, fit and save)."""
    key = own_raw_key(train, **ensemble)
    path = index_file(home, key) if home is not None else None
    if path is not None:
        found = _lookup(path, key, store)
        if found is not None:
            return found
    ref = fit_own_raw(train, cfg, **ensemble)
    got = OwnRaw(blob=save_ensemble(store, ref.ensemble), classes=list(ref.classes), fitted=True)
    if path is not None:
        _record(path, {"key": key, "ensemble": got.blob, "classes": got.classes, "samples": int(len(train.labels))})
    return got


def _lookup(path: Path, key: str, store: BlobStore) -> OwnRaw | None:
    try:
        rec = json.loads(path.read_text())
        blob, classes = rec["ensemble"], rec["classes"]
        if rec["key"] != key or not isinstance(blob, str) or not all(isinstance(c, str) for c in classes):
            raise ValueError("not this key's record")
        store.verify(blob)  # held and intact
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, BlobError):
        path.unlink(missing_ok=True)  # stale or damaged: fitted again
        return None
    return OwnRaw(blob=blob, classes=list(classes), fitted=False)


def _record(path: Path, rec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rec, sort_keys=True))
    tmp.replace(path)
