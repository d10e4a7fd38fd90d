"""Choosing samples (seeded 80/20 split, classes= / shard= / limit=) and turning them into
model-ready tensors: float32 (N, C, img, img), normalised with mean 0.5 / std 0.5."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from atdnode.data.intensity import Scaling, override
from atdnode.data.layout import Catalog, Skip
from atdnode.errors import DataError

MEAN, STD = 0.5, 0.5
CHUNK = 512


def _rng(seed: int, *salt: int) -> np.random.Generator:
    return np.random.default_rng([seed, *salt])


def split_indices(labels: np.ndarray, seed: int, test_frac: float = 0.2,
                  groups: np.ndarray | None = None, *, salt: int = 0x5EED) -> dict[str, np.ndarray]:
    """Seeded per-class split: about `test_frac` of each class goes to test.

    With `groups` (one id per sample, e.g. the volume a slice came from) whole groups are
    dealt, so no group straddles the split. `salt` separates independent splits of one seed
    (the 80/20 train/test split and the val split carved from train, `carve_val`).
    """
    rng = _rng(seed, salt)
    train, test = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        if groups is None:
            idx = idx[rng.permutation(len(idx))]
            n_test = int(round(len(idx) * test_frac)) if len(idx) > 1 else 0
            test.append(idx[:n_test])
            train.append(idx[n_test:])
            continue
        g = np.unique(groups[idx])
        g = g[rng.permutation(len(g))]
        n_test = int(round(len(g) * test_frac)) if len(g) > 1 else 0
        in_test = np.isin(groups[idx], g[:n_test])
        test.append(idx[in_test])
        train.append(idx[~in_test])
    return {"train": np.sort(np.concatenate(train)), "test": np.sort(np.concatenate(test))}


CARVED_VAL = 0.2  # fraction of each class of the training split carved as val when the source has none
_VAL_SALT = 0x7A1


def carve_val(labels: np.ndarray, seed: int, groups: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """{"train", "val"} positions of a training split with no val split of its own: per class
    (whole groups with `groups`), a seeded `CARVED_VAL` share goes to val — the split every
    selection (keep = best, recipe choices) judges on, so none is made on test data."""
    sp = split_indices(labels, seed, CARVED_VAL, groups, salt=_VAL_SALT)
    return {"train": sp["train"], "val": sp["test"]}


def carved_note(seed: int) -> str:
    """How a carved val split was made (recorded in the data report, the run and the model's record)."""
    return f"carved from train: {CARVED_VAL:.0%} of each class, stratified, data seed {seed}"


def _select(labels: np.ndarray, names: list[str], spec, seed: int, where: str,
            groups: np.ndarray | None = None) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Apply classes= / shard= / limit=: returns (indices, class names kept, new labels).

    With `groups` (a volume id per sample) shards deal whole groups, so one patient's
    slices stay on one node."""
    idx = np.arange(len(labels))
    keep = names
    if spec.classes is not None:
        unknown = [c for c in spec.classes if c not in names]
        if unknown:
            from atdnode.data.spec import did_you_mean

            raise DataError(f"{where}: unknown classes {unknown}{did_you_mean(unknown[0], names, n=1)} (has {names})")
        keep = [c for c in names if c in set(spec.classes)]  # source order, not spec order
        old = np.asarray([names.index(c) for c in keep])
        idx = idx[np.isin(labels, old)]
    remap = np.full(len(names), -1, dtype=np.int64)
    for i, c in enumerate(keep):
        remap[names.index(c)] = i
    if spec.shard is not None and groups is not None:
        i, n = spec.shard
        g = np.unique(groups[idx])
        g = g[_rng(seed, 0x5A4D).permutation(len(g))]
        idx = idx[np.isin(groups[idx], g[i - 1::n])]
    elif spec.shard is not None:
        i, n = spec.shard
        perm = idx[_rng(seed, 0x5A4D).permutation(len(idx))]
        idx = np.sort(perm[i - 1::n])
    if spec.limit is not None and spec.limit < len(idx):
        idx = np.sort(idx[_rng(seed, 0x11A1).permutation(len(idx))[: spec.limit]])
    return idx, keep, remap[labels[idx]]


@dataclass
class ReadStats:
    """What reading saw: scalings used, native shapes / dtypes, raw value range, skips."""

    how: Counter = field(default_factory=Counter)
    shapes: Counter = field(default_factory=Counter)
    dtypes: Counter = field(default_factory=Counter)
    lo: float = float("inf")
    hi: float = float("-inf")
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def saw(self, x: np.ndarray, s: Scaling, n: int = 1, batched: bool = False) -> None:
        self.how[s.how] += n
        shape = x.shape[1:] if batched else x.shape
        self.shapes["x".join(map(str, shape))] += n
        self.dtypes[s.stored or x.dtype.name] += n
        if x.size:
            self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))


def _model_input(x: torch.Tensor, s: Scaling, img_size: int, in_chans: int, where: str) -> torch.Tensor:
    """(B, H, W[, C]) raw values -> (B, in_chans, img, img) normalised float32."""
    dims = tuple(range(1, x.ndim))
    x = s.apply(x, dims).float()
    x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)  # (B, c, H, W)
    if x.shape[1] != in_chans:
        if x.shape[1] == 1:
            x = x.expand(-1, in_chans, -1, -1)
        elif in_chans == 1:
            x = x.mean(dim=1, keepdim=True)
        else:
            raise DataError(f"{where}: cannot map {x.shape[1]} channels to {in_chans}")
    if x.shape[-2:] != (img_size, img_size):
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", antialias=True, align_corners=False)
    return (x.clamp(0, 1) - MEAN) / STD


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    wide = a.dtype in (np.float64, np.int32, np.int64, np.uint32)
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64 if wide else np.float32))


def to_tensor(cat: Catalog, idx: np.ndarray, window, auto: tuple[float, float] | None, img_size: int, in_chans: int,
              where: str, stats: ReadStats, tick=None) -> tuple[torch.Tensor, np.ndarray]:
    """Read samples `idx` into (n, C, img, img); returns (images, mask of idx that were read).
    `tick(n)`, if given, is called as samples are done (a progress bar)."""
    tick = tick or (lambda n: None)
    out = torch.empty((len(idx), in_chans, img_size, img_size), dtype=torch.float32)
    ok = np.zeros(len(idx), dtype=bool)
    row = 0
    if cat.uniform:  # one array, one scaling: vectorised in chunks
        for s in range(0, len(idx), CHUNK):
            part = idx[s:s + CHUNK]
            arrs = [cat.read(int(i)) for i in part]
            batch = np.stack([a for a, _ in arrs])
            sc = override(arrs[0][1], window, auto)
            stats.saw(batch, sc, len(part), batched=True)
            out[row:row + len(part)] = _model_input(_as_tensor(batch), sc, img_size, in_chans, where)
            ok[s:s + len(part)] = True
            row += len(part)
            tick(len(part))
        return out, ok
    for j, i in enumerate(idx):
        tick(1)
        try:
            a, sc = cat.read(int(i))
        except Skip as exc:
            stats.skipped.append((cat.where[int(i)], str(exc)))
            continue
        sc = override(sc, window, auto)
        stats.saw(a, sc)
        out[row] = _model_input(_as_tensor(a)[None], sc, img_size, in_chans, cat.where[int(i)] or where)[0]
        ok[j] = True
        row += 1
    return (out if row == len(idx) else out[:row].clone()), ok
