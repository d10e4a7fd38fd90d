"""Every node's train / test data for a scenario, loaded once through `atdnode.data`.

Class identity is the class name: data sets (and nodes) that name the same class share it,
so three hospitals' files with `normal` / `pneumonia` make a two-class task. A data set with
`namespace = true` gets `"<dataset>:<class>"` names instead, so its classes never merge.
Cohorts that draw on the same data set get disjoint training samples: per class, the
samples are dealt (seeded) among the cohorts that use that class, then each cohort's
share is partitioned among its nodes (`netsim.partition`). Test data is not divided: a
node's test set is the data set's test samples of its label space.

With `[scenario] val_fraction = f` each node's share is then divided (seeded,
stratified by class: `split_val`) into its training data (`train`, the only part any method
trains on or uploads) and its held-out validation split (`val`, written as the node's .npz
`val_*` arrays, so `atd aggregate` judges its candidates on it, `atdnode.aggregation.candidates`).

A node's label space is its cohort's classes (the hospitals agreed on them), except under
the `disjoint` scheme, where it is the node's own class set.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from atdnode.data import MEAN, STD, LabeledImages, load_dataset
from atdnode.data import DataSpec, without_val
from netsim.partition import NodeSplit, _rng, class_subset, partition_cohort, write_npz
from netsim.scenario import Scenario, ScenarioError


@dataclass
class NodeData:
    name: str
    cohort: str
    phase: int
    group: str
    dataset: str
    classes: list[str]  # the node's label space (global names); labels below index into it
    train: LabeledImages
    test: LabeledImages
    class_counts: dict[str, int] = field(default_factory=dict)  # of `train`
    val: LabeledImages | None = None  # the node's held-out val split (val_fraction > 0); never trained on
    # rows of the data set's train split: {"train": ..., "val": ...} (the test rows: ScenarioData.test_index)
    source_index: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def raw_bytes(self) -> int:
        """Bytes to ship this node's training data raw (uint8 pixels + int64 labels)."""
        return int(self.train.images[0].numel() * len(self.train) + 8 * len(self.train))


@dataclass
class ScenarioData:
    nodes: dict[str, NodeData]
    label_space: list[str]  # union of every node's classes, dataset order
    tests: dict[str, LabeledImages]  # dataset -> its whole test split (global labels)
    test_index: dict[str, dict[str, np.ndarray]]  # node -> dataset -> test indices

    def present(self, phase: int) -> list[str]:
        """Nodes that have joined by `phase` (in scenario order)."""
        return [n for n, d in self.nodes.items() if d.phase <= phase]

    def classes_at(self, phase: int) -> list[str]:
        have = {c for n in self.present(phase) for c in self.nodes[n].classes}
        return [c for c in self.label_space if c in have]

    def pooled_train(self, names: list[str], classes: list[str]) -> LabeledImages:
        """The training data of `names`, labels re-indexed into `classes`."""
        return concat([self.nodes[n].train for n in names], classes)

    def pooled_test(self, phase: int) -> LabeledImages:
        """Union of the present nodes' test sets (each sample once), global label space of the phase."""
        classes = self.classes_at(phase)
        parts = []
        for ds, test in self.tests.items():
            idx = sorted({int(i) for n in self.present(phase) for i in self.test_index[n].get(ds, [])})
            if idx:
                parts.append(subset(test, np.asarray(idx, dtype=np.int64), test.classes))
        return concat(parts, classes)


def subset(data: LabeledImages, idx: np.ndarray, classes: list[str]) -> LabeledImages:
    """Rows `idx` of `data`, labels re-indexed into `classes` (every row's class must be in it)."""
    names = [data.classes[int(l)] for l in data.labels[idx]]
    pos = {c: i for i, c in enumerate(classes)}
    labels = torch.tensor([pos[c] for c in names], dtype=torch.int64)
    return LabeledImages(images=data.images[torch.from_numpy(idx)], labels=labels, classes=list(classes), spec=data.spec)


def concat(parts: list[LabeledImages], classes: list[str]) -> LabeledImages:
    """Concatenate, re-indexing labels into `classes`."""
    pos = {c: i for i, c in enumerate(classes)}
    images = torch.cat([p.images for p in parts])
    labels = torch.cat([torch.tensor([pos[p.classes[int(l)]] for l in p.labels], dtype=torch.int64) for p in parts])
    return LabeledImages(images=images, labels=labels, classes=list(classes), spec="+".join(p.spec for p in parts))


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Normalised float images (N, C, H, W) -> uint8 (N, H, W) or (N, H, W, C), as stored in .npz."""
    u8 = torch.round((images * STD + MEAN).clamp(0, 1) * 255.0).to(torch.uint8)
    u8 = u8[:, 0] if u8.shape[1] == 1 else u8.permute(0, 2, 3, 1)
    return u8.contiguous().numpy()


def from_uint8(u8: np.ndarray) -> torch.Tensor:
    """The exact inverse path `atdnode.data` takes when it reads a .npz at the model's size."""
    x = torch.from_numpy(np.ascontiguousarray(u8)).float() / 255.0
    x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
    return (x.clamp(0, 1) - MEAN) / STD


def _prepare(data: LabeledImages, prefix: str | None) -> LabeledImages:
    """Quantise to uint8 pixels (what the nodes' .npz files hold, so every method sees the
    very same pixels) and namespace the class names when several data sets are mixed."""
    classes = data.classes if prefix is None else [f"{prefix}:{c}" for c in data.classes]
    return LabeledImages(images=from_uint8(to_uint8(data.images)), labels=data.labels, classes=classes,
                         spec=data.spec)


def write_node_npz(node: NodeData, path: Path) -> Path:
    """Write the node's train, val (when it has one) and test data as a MedMNIST-layout .npz
    that `atdnode.data` reads back (`npz:PATH`) to exactly `node.train` / `.val` / `.test`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    val = None if node.val is None else (to_uint8(node.val.images), node.val.labels.numpy())
    write_npz(path, to_uint8(node.train.images), node.train.labels.numpy(), node.classes,
              to_uint8(node.test.images), node.test.labels.numpy(), val=val)
    return path


def node_spec(node: NodeData, path: Path) -> str:
    """`npz:PATH` of the node's data written to `path` (`write_node_npz`); with no val split
    (val_fraction 0) `val=train`: the node trains on all of its share, as every method netsim
    compares does, and its keep decision makes no choice (never one on its test data)."""
    spec = f"npz:{write_node_npz(node, path)}"
    return spec if node.val is not None else without_val(spec)


def split_val(idx: np.ndarray, labels: np.ndarray, fraction: float, rng: np.random.Generator
              ) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, val rows) of `idx`: per class, round(fraction x its count) seeded rows go
    to val, but every class keeps at least one training row (a class of one sample has none
    in val); both sorted and disjoint."""
    train, val = [], []
    for c in np.unique(labels[idx]):
        rows = idx[labels[idx] == c]
        rows = rows[rng.permutation(len(rows))]
        k = min(int(np.floor(fraction * len(rows) + 0.5)), len(rows) - 1)
        val.append(rows[:k])
        train.append(rows[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def load_scenario_data(scn: Scenario) -> ScenarioData:
    """Load the data sets and partition them among the nodes (deterministic in scn.seed)."""
    m = scn.model
    used = {c.dataset for c in scn.cohorts}
    spaced = {d.name for d in scn.datasets if d.namespace}
    trains: dict[str, LabeledImages] = {}
    tests: dict[str, LabeledImages] = {}
    for d in scn.datasets:
        if d.name not in used:
            continue
        prefix = d.name if d.namespace else None
        spec, scored = without_val(d.spec), "test"  # the whole training split is dealt; each node's val comes from its share
        if scn.score_split == "val":  # a selection run: the source's val split (carved from train) stands in for test
            spec, scored = _with_val(d.spec, scn.source), "val"
        trains[d.name] = _prepare(load_dataset(spec, m.img_size, m.in_chans, "train", seed=scn.seed), prefix)
        tests[d.name] = _prepare(load_dataset(spec, m.img_size, m.in_chans, scored, seed=scn.seed), prefix)
    pools = _cohort_pools(scn, trains, spaced)
    nodes: dict[str, NodeData] = {}
    test_index: dict[str, dict[str, np.ndarray]] = {}
    for co in scn.cohorts:
        tr, te = trains[co.dataset], tests[co.dataset]
        names = tr.classes
        cls = None if co.classes is None else tuple(_global(c, co.dataset, spaced) for c in co.classes)
        sets = None if co.class_sets is None else tuple(tuple(_global(c, co.dataset, spaced) for c in s)
                                                        for s in co.class_sets)
        labels = tr.labels.numpy()
        splits = partition_cohort(nodes=co.nodes, train_labels=labels, pool=pools[co.name],
                                  test_labels=te.labels.numpy(), names=names, scheme=co.partition, seed=scn.seed,
                                  salt=co.name, classes=cls, alpha=co.alpha, fractions=co.fractions, class_sets=sets, shares=co.class_shares,
                                  train_samples=co.train_samples,
                                  test_samples=co.test_samples)
        cohort_classes = [names[i] for i in np.unique(labels[pools[co.name]])]
        for sp in splits:
            space = list(sp.classes) if co.partition == "disjoint" else cohort_classes
            nodes[sp.node] = _node_data(sp, co, tr, space, scn.val_fraction, scn.seed, scn.source)
            test_index[sp.node] = {co.dataset: _test_idx(te, space, co.test_samples, scn.seed, sp.node)}
            nodes[sp.node].test = subset(te, test_index[sp.node][co.dataset], space)
    order = list(dict.fromkeys(c for ds in trains for c in trains[ds].classes))  # by name, first seen
    have = {c for d in nodes.values() for c in d.classes}
    return ScenarioData(nodes=nodes, label_space=[c for c in order if c in have], tests=tests, test_index=test_index)


def _with_val(spec: str, source: str) -> str:
    """`spec` keeping its val split apart (`val=val`, carved from train where the source has
    none): what a `score_split = "val"` run deals (train) and scores on (val)."""
    val = DataSpec.parse(spec).val
    if val != "val":
        raise ScenarioError(f"{source}: scenario.score_split = \"val\" needs data sets whose val split stays apart "
                            f"({spec} says val={val})")
    return spec


def _global(c: str, ds: str, spaced: set[str]) -> str:
    return f"{ds}:{c}" if ds in spaced else c


def _test_idx(te: LabeledImages, space: list[str], cap: int | None, seed: int, node: str) -> np.ndarray:
    idx = class_subset(te.labels.numpy(), te.classes, tuple(space))
    if cap is not None and cap < len(idx):
        idx = np.sort(idx[_rng(seed, f"test:{node}").permutation(len(idx))[:cap]])
    return idx


def _node_data(sp: NodeSplit, co, tr: LabeledImages, space: list[str], val_fraction: float, seed: int,
               source: str) -> NodeData:
    rows, val_rows = sp.train, None
    if val_fraction > 0:
        rows, val_rows = split_val(sp.train, tr.labels.numpy(), val_fraction, _rng(seed, f"val:{sp.node}"))
        if len(val_rows) == 0:
            raise ScenarioError(f"{source}: scenario.val_fraction: node {sp.node}'s {len(sp.train)} training "
                                f"samples leave no val sample at {val_fraction}; raise it or the node's samples")
    train = subset(tr, rows, space)
    counts = {space[i]: int(n) for i, n in enumerate(torch.bincount(train.labels, minlength=len(space)).tolist())}
    index = {"train": rows} if val_rows is None else {"train": rows, "val": val_rows}
    return NodeData(name=sp.node, cohort=co.name, phase=co.phase, group=co.group, dataset=co.dataset,
                    classes=list(space), train=train, test=train, class_counts=counts,
                    val=None if val_rows is None else subset(tr, val_rows, space), source_index=index)


def _cohort_pools(scn: Scenario, trains: dict[str, LabeledImages], spaced: set[str]) -> dict[str, np.ndarray]:
    """Per class, deal the data set's training samples (seeded) among the cohorts using that class."""
    pools: dict[str, list[np.ndarray]] = {c.name: [] for c in scn.cohorts}
    for ds, tr in trains.items():
        labels = tr.labels.numpy()
        users = [c for c in scn.cohorts if c.dataset == ds]
        for k, name in enumerate(tr.classes):
            takers = [c.name for c in users if c.classes is None
                      or name in {_global(x, ds, spaced) for x in c.classes}]
            if not takers:
                continue
            idx = np.flatnonzero(labels == k)
            idx = idx[_rng(scn.seed, f"pool:{ds}:{name}").permutation(len(idx))]
            for j, t in enumerate(takers):
                pools[t].append(idx[j::len(takers)])
    out = {}
    for name, parts in pools.items():
        if not parts:
            raise ScenarioError(f"{scn.source}: cohort {name!r} has no training samples (check its classes)")
        out[name] = np.sort(np.concatenate(parts))
    return out
