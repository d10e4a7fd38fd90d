"""Split a data set among the nodes of a cohort: IID, label-skewed, quantity-skewed, disjoint.

Everything is a pure function of (labels, scheme, seed), so two runs — and every method
compared on one scenario — see exactly the same partitions. A partition is a list of
index arrays into the source's *train* split, one per node; a node's *test* data is the
test samples of the classes it holds (optionally capped, seeded).

Schemes (over the samples of the cohort's classes):

    iid            shuffle, deal out equal shares
    label_skew     per class, node shares ~ Dirichlet(alpha) (small alpha = strong skew);
                   every node keeps at least `min_per_node` samples
    quantity_skew  IID labels, node sizes ~ Dirichlet(alpha) or the given `fractions`
    disjoint       each node gets whole classes: the given `class_sets`, or the classes
                   dealt round-robin in seeded order
    class_shares   each node holds the cohort's classes in its given proportions
                   (`class_shares`, one list per node, over the classes in source order):
                   hospitals with skewed class ratios, e.g. 40/60, 10/90, 90/10
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from netsim.scenario import ScenarioError

MIN_PER_NODE = 8


@dataclass(frozen=True)
class NodeSplit:
    """One node's share: indices into the source's train / test splits (sorted)."""

    node: str
    train: np.ndarray  # int64
    test: np.ndarray  # int64
    classes: tuple[str, ...]  # the classes present in its train share, in source order

    def class_counts(self, labels: np.ndarray, names: list[str]) -> dict[str, int]:
        counts = np.bincount(labels[self.train], minlength=len(names))
        return {names[i]: int(counts[i]) for i in range(len(names)) if counts[i]}


def _rng(seed: int, salt: str) -> np.random.Generator:
    return np.random.default_rng([seed, int.from_bytes(salt.encode()[:8].ljust(8, b"\0"), "little")])


def class_subset(labels: np.ndarray, names: list[str], classes: tuple[str, ...] | None) -> np.ndarray:
    """Indices of samples whose class is in `classes` (all when None)."""
    if classes is None:
        return np.arange(len(labels))
    unknown = [c for c in classes if c not in names]
    if unknown:
        raise ScenarioError(f"unknown classes {unknown} (the data set has {names})")
    keep = [names.index(c) for c in classes]
    return np.flatnonzero(np.isin(labels, keep))


def iid(idx: np.ndarray, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    perm = idx[rng.permutation(len(idx))]
    return [np.sort(perm[i::n]) for i in range(n)]


def quantity_skew(idx: np.ndarray, n: int, rng: np.random.Generator, *, alpha: float = 0.5,
                  fractions: tuple[float, ...] | None = None, min_per_node: int = MIN_PER_NODE) -> list[np.ndarray]:
    if fractions is not None:
        p = np.asarray(fractions, dtype=np.float64)
    else:
        p = rng.dirichlet(np.full(n, alpha))
    p = p / p.sum()
    sizes = _sizes(len(idx), p, min_per_node)
    perm = idx[rng.permutation(len(idx))]
    cuts = np.cumsum(sizes)[:-1]
    return [np.sort(part) for part in np.split(perm, cuts)]


def _sizes(total: int, p: np.ndarray, floor: int) -> np.ndarray:
    """Integer sizes ~ total * p that sum to total, each at least `floor` when possible."""
    n = len(p)
    floor = min(floor, total // n)
    rest = total - floor * n
    raw = p * rest
    sizes = np.floor(raw).astype(np.int64)
    order = np.argsort(-(raw - sizes), kind="stable")
    sizes[order[: rest - sizes.sum()]] += 1
    return sizes + floor


def label_skew(idx: np.ndarray, labels: np.ndarray, n: int, rng: np.random.Generator, *, alpha: float = 0.5,
               min_per_node: int = MIN_PER_NODE) -> list[np.ndarray]:
    """Per class, Dirichlet(alpha) shares; resampled (seeded) until every node has enough."""
    classes = np.unique(labels[idx])
    floor = min(min_per_node, len(idx) // n)
    for _ in range(100):
        parts: list[list[np.ndarray]] = [[] for _ in range(n)]
        for c in classes:
            ci = idx[labels[idx] == c]
            ci = ci[rng.permutation(len(ci))]
            cuts = (np.cumsum(rng.dirichlet(np.full(n, alpha))) * len(ci)).astype(np.int64)[:-1]
            for k, part in enumerate(np.split(ci, cuts)):
                parts[k].append(part)
        out = [np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts]
        if min(len(o) for o in out) >= floor:
            return out
    raise ScenarioError(f"label_skew with alpha={alpha} cannot give {n} nodes {floor} samples each; raise alpha")


def class_shares(idx: np.ndarray, labels: np.ndarray, n: int, rng: np.random.Generator, *,
                 shares: tuple[tuple[float, ...], ...]) -> list[np.ndarray]:
    """Node k holds the present classes in the proportions `shares[k]` (normalised); every node
    gets the same number of samples, the most the class counts allow (for each class c,
    sum_k share[k][c] x size <= its samples); each class's samples are dealt seeded."""
    present = np.unique(labels[idx])
    if len(shares) != n or any(len(s) != len(present) for s in shares):
        raise ScenarioError(f"class_shares needs {n} lists of {len(present)} shares (one per class present)")
    p = np.asarray(shares, dtype=np.float64)
    p = p / p.sum(axis=1, keepdims=True)
    counts = np.asarray([(labels[idx] == c).sum() for c in present], dtype=np.float64)
    need = p.sum(axis=0)
    size = int(np.floor(min(counts[j] / need[j] for j in range(len(present)) if need[j] > 0)))
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for j, c in enumerate(present):
        ci = idx[labels[idx] == c]
        ci = ci[rng.permutation(len(ci))]
        take = np.floor(p[:, j] * size).astype(np.int64)
        for k, part in enumerate(np.split(ci[:take.sum()], np.cumsum(take)[:-1])):
            parts[k].append(part)
    return [np.sort(np.concatenate(q)) for q in parts]


def disjoint(idx: np.ndarray, labels: np.ndarray, names: list[str], n: int, rng: np.random.Generator, *,
             class_sets: tuple[tuple[str, ...], ...] | None = None) -> list[np.ndarray]:
    present = [names[c] for c in np.unique(labels[idx])]
    if class_sets is None:
        if len(present) < n:
            raise ScenarioError(f"disjoint partition of {len(present)} classes among {n} nodes: need >= 1 class each")
        order = [present[i] for i in rng.permutation(len(present))]
        class_sets = tuple(tuple(order[k::n]) for k in range(n))
    out = []
    for cs in class_sets:
        missing = [c for c in cs if c not in present]
        if missing:
            raise ScenarioError(f"disjoint class set names classes with no samples here: {missing}")
        keep = [names.index(c) for c in cs]
        out.append(np.sort(idx[np.isin(labels[idx], keep)]))
    return out


def non_iid(idx: np.ndarray, labels: np.ndarray, n: int, rng: np.random.Generator, *,
            classes_per_node: int) -> list[np.ndarray]:
    """The FedWAvg paper's Non-IID(c) (Sec. 4, after Qu et al. 2021): each of the `n` nodes
    holds samples of exactly `c` classes. The present classes are shuffled once; node k takes
    classes ``order[(k*c + j) % C]`` for j < c, and each class's samples are split evenly among
    the nodes that hold it (K = 5, C = 10: Non-IID(2) is disjoint, Non-IID(4) gives every class
    to two nodes)."""
    present = np.unique(labels[idx])
    if not 1 <= classes_per_node <= len(present):
        raise ScenarioError(f"non_iid({classes_per_node}) needs 1..{len(present)} classes per node")
    order = present[rng.permutation(len(present))]
    held = [[order[(k * classes_per_node + j) % len(present)] for j in range(classes_per_node)] for k in range(n)]
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for c in present:
        owners = [k for k in range(n) if c in held[k]]
        if not owners:
            continue
        pool = idx[labels[idx] == c]
        for k, share in zip(owners, np.array_split(pool[rng.permutation(len(pool))], len(owners))):
            parts[k].append(share)
    return [np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts]


def partition_cohort(*, nodes: tuple[str, ...], train_labels: np.ndarray, test_labels: np.ndarray,
                     names: list[str], scheme: str, seed: int, salt: str = "", classes: tuple[str, ...] | None = None,
                     alpha: float = 0.5, fractions: tuple[float, ...] | None = None,
                     class_sets: tuple[tuple[str, ...], ...] | None = None,
                     shares: tuple[tuple[float, ...], ...] | None = None, train_samples: int | None = None,
                     test_samples: int | None = None, pool: np.ndarray | None = None) -> list[NodeSplit]:
    """Partition one cohort's data among `nodes` (deterministic in `seed` + `salt`).

    `pool` restricts the candidates to these train indices (cohorts sharing a data set).
    """
    rng = _rng(seed, "part:" + salt)
    idx = class_subset(train_labels, names, classes)
    if pool is not None:
        idx = np.intersect1d(idx, pool)
    if len(idx) == 0:
        raise ScenarioError(f"cohort {salt!r}: no training samples for classes {classes}")
    if train_samples is not None and train_samples < len(idx):
        idx = np.sort(idx[_rng(seed, "cap:" + salt).permutation(len(idx))[:train_samples]])
    n = len(nodes)
    if scheme == "iid":
        parts = iid(idx, n, rng)
    elif scheme == "label_skew":
        parts = label_skew(idx, train_labels, n, rng, alpha=alpha)
    elif scheme == "quantity_skew":
        parts = quantity_skew(idx, n, rng, alpha=alpha, fractions=fractions)
    elif scheme in ("non_iid2", "non_iid4"):
        parts = non_iid(idx, train_labels, n, rng, classes_per_node=int(scheme[-1]))
    elif scheme == "class_shares":
        parts = class_shares(idx, train_labels, n, rng, shares=shares or ())
    elif scheme == "disjoint":
        parts = disjoint(idx, train_labels, names, n, rng, class_sets=class_sets)
    else:
        raise ScenarioError(f"unknown partition scheme {scheme!r}")
    out = []
    for k, (node, tr) in enumerate(zip(nodes, parts)):
        if len(tr) == 0:
            raise ScenarioError(f"cohort {salt!r}: node {node} got no training samples; change the partition")
        present = np.unique(train_labels[tr])
        te = np.flatnonzero(np.isin(test_labels, present))
        if test_samples is not None and test_samples < len(te):
            te = np.sort(te[_rng(seed, f"test:{salt}:{k}").permutation(len(te))[:test_samples]])
        out.append(NodeSplit(node=node, train=tr.astype(np.int64), test=te.astype(np.int64),
                             classes=tuple(names[i] for i in present)))
    return out


def write_npz(path, images_uint8: np.ndarray, labels: np.ndarray, classes: list[str],
              test_images: np.ndarray | None = None, test_labels: np.ndarray | None = None, *,
              val: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Write a MedMNIST-layout .npz (train_*, optional val_* = `val` (images, labels) and
    test_*, `classes`) readable by `atdnode.data` as `npz:PATH` (no pickle: the class names
    are a fixed-width str array)."""
    arrays = {"train_images": images_uint8, "train_labels": labels.astype(np.int64),
              "classes": np.asarray([str(c) for c in classes], dtype=np.str_)}
    if val is not None:
        arrays["val_images"], arrays["val_labels"] = val[0], val[1].astype(np.int64)
    if test_images is not None:
        arrays["test_images"] = test_images
        arrays["test_labels"] = test_labels.astype(np.int64)
    np.savez(path, **arrays)
