"""`atd rounds` on netsim's in-memory back-end: methods `fat-fedavg`, `fat-fedwavg` and `fedavg`.

Federated Adversarial Training with Transformers (FedWAvg, Sec. 3 / Eq. 3): rounds in
which every client starts from the global model, trains locally (PGD examples on part of
each batch for the fat-* methods) and the global model is the FedAvg (1/K) or FedWAvg
(softmax(q * cos) of the last layer against the previous global) average. Here each node
is a real `NodeDaemon` on a `MemCluster` and runs `atdnode.rounds.runner.RoundRunner` — the very
loop behind `atd rounds` — through `MemFabric` (its daemon object and the simulated
clock instead of the control socket and the wall clock). Weights travel as signed
`weights` entries + blobs over the simulated network; each round's global model is an
`aggregate` entry every node recomputes bit for bit.

    fedavg       FedAvg rounds, no attack during training (netsim's FedAvg baseline)
    fat-fedavg   FedAvg rounds, PGD adversarial training; robust accuracy reported
    fat-fedwavg  FedWAvg rounds, PGD adversarial training; robust accuracy reported

`run_rounds_memnet` is the library entry for one campaign over given per-node data (other
netsim reports call it for "FedAvg of the whole ViT"); `netsim.baselines.run_rounds_method`
runs a scenario's phases with it (a phase's campaign starts from the previous phase's global
model, its head widened to the new label space — as the other baselines do).

Options after the FedWAvg paper (Sec. 4): the Non-IID(2) / Non-IID(4) class partitions
(`netsim.partition.non_iid`, scenario partitions `non_iid2` / `non_iid4`) and its local
optimiser (`optimizer="sgd"`: momentum 0.9, rate decayed by `lr_decay` per epoch). Every
FedWAvg round's cosines (Eq. 3's c_i) are in its `aggregate` entry and `per_round()`.

Deviations: clients are weighted equally (atd rounds' FedAvg; McMahan et al. weight by
sample count); there is no FedProx term (scenario_check refuses `fedprox_mu > 0`). Bytes
are what the nodes' links carried (gossip, sync, blobs: `MemCluster.link_bytes`), not
model sizes. Times: compute (training, aggregation) is measured wall clock; exchange time
is simulated network time (compute takes none).
"""
from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trio

from atdnode.blobs import volatile_disk
from atdnode.data import MEAN, STD, LabeledImages
from atdnode.learning import AdversarialTransform, ModelConfig, build_model
from atdnode.rounds import Fabric, RoundReport, RoundRunner, RoundsConfig, RoundsError
from atdnode.models import load_weights
from netsim.learn import model_config
from atdnode.data import without_val
from netsim.nodedata import concat, to_uint8
from netsim.partition import write_npz
from netsim.scenario import NetworkSpec
from protocols.adversarial import PGDConfig
from protocols.fedwavg import ROUNDS_Q

LOCAL_TEST = 32  # samples of each node's own test set that `atd rounds`' local training evaluates on

Progress = Callable[[str], None]


class MemFabric(Fabric):
    """A round runner's fabric on a `MemCluster` node: its daemon object, simulated time.
    `train_s`: simulated seconds each local training takes on this node (a slow member;
    default 0: compute takes no simulated time)."""

    wall_clock = False

    def __init__(self, cluster, name: str, *, train_s: float = 0.0) -> None:
        self.cluster, self.name, self.train_s = cluster, name, train_s

    async def trained(self, seconds: float) -> None:
        await trio.sleep(self.train_s)

    def now(self) -> float:
        return trio.current_time()

    async def fetch(self, blob: str, timeout: float) -> None:
        if not self.cluster.alive(self.name):
            raise RoundsError(f"{self.name}'s daemon is down")
        try:
            with trio.fail_after(timeout):
                await self.cluster.daemons[self.name].fetch(blob, timeout=timeout)
        except trio.TooSlowError:
            raise RoundsError(f"fetch of {blob[:12]} timed out") from None
        except Exception as exc:  # DaemonError, TransportError, BlobError: what the control op reports
            raise RoundsError(f"fetch of {blob[:12]}: {exc}") from None

    async def peers(self) -> list[str] | None:
        return self.cluster.peers(self.name) if self.cluster.alive(self.name) else None

    def peer_target(self) -> int | None:
        daemon = self.cluster.daemons.get(self.name)
        return daemon.peerset.cfg.target if daemon is not None else None


def pgd_config(*, eps: float = 8 / 255, step: float | None = None, steps: int = 3, ratio: float = 0.5,
               in_chans: int = 1) -> PGDConfig:
    """The attack of `atd rounds --adversarial` (PGD in pixel units over normalised inputs)."""
    return PGDConfig(eps=eps, step=eps / 4 if step is None else step, steps=steps, ratio=ratio,
                     mean=(MEAN,) * in_chans, std=(STD,) * in_chans)


@dataclass
class RoundsResult:
    """One campaign on the in-memory back-end."""

    weighting: str
    adversarial: bool
    nodes: list[str]
    classes: list[str]
    reports: dict[str, list[RoundReport]]  # node -> its round reports
    state: dict[str, torch.Tensor]  # the final global model
    bytes: dict[str, dict[str, int]]  # node -> link bytes sent / received over the campaign
    sim_s: float  # simulated seconds the campaign took
    wall_s: float
    identical: bool  # every honest node ended with the same global blob
    cfg: ModelConfig
    hostile: list[str] = field(default_factory=list)  # nodes run by a hostile RoundRunner (no report checks)

    def per_round(self) -> list[dict]:
        """Per round: mean of the honest nodes' train / exchange / aggregate seconds, weights, missing."""
        out = []
        rounds = sorted({r.round for reps in self.reports.values() for r in reps})
        for rnd in rounds:
            reps = [r for n, reps in self.reports.items() if n not in self.hostile for r in reps if r.round == rnd]
            mean = lambda k: round(sum(getattr(r, k) for r in reps) / len(reps), 4)  # noqa: E731
            out.append({"round": rnd, "train_s": mean("train_s"), "exchange_s": mean("exchange_s"),
                        "aggregate_s": mean("aggregate_s"), "max_train_s": max(r.train_s for r in reps),
                        "max_exchange_s": max(r.exchange_s for r in reps),
                        "max_aggregate_s": max(r.aggregate_s for r in reps),
                        "weight_bytes_out": mean("bytes_out"), "weight_bytes_in": mean("bytes_in"),
                        "weights": reps[0].weights, "cosines": reps[0].cosines, "missing": reps[0].missing,
                        "identical": len({r.blob for r in reps}) == 1})
        return out

    def model(self) -> torch.nn.Module:
        """The final global model (eval mode)."""
        m = build_model(self.cfg)
        m.load_state_dict(self.state)
        m.eval()
        return m


def _write_node_data(path: Path, train: LabeledImages, test: LabeledImages | None, classes: list[str]) -> str:
    """The node's data as `npz:PATH` in the campaign's label space (every member the same)."""
    tr = concat([train], classes)
    te = concat([test], classes) if test is not None and len(test) else tr
    k = min(LOCAL_TEST, len(te))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_npz(path, to_uint8(tr.images), tr.labels.numpy(), classes, to_uint8(te.images[:k]), te.labels[:k].numpy())
    return without_val(f"npz:{path}")  # trains on all it holds, like the in-process runs it is compared with


def run_rounds_memnet(train: dict[str, LabeledImages], *, classes: list[str], model: ModelConfig, rounds: int,
                      weighting: str = "fedavg", q: float = ROUNDS_Q, adversarial: PGDConfig | None = None,
                      local_epochs: int = 1, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
                      network: NetworkSpec = NetworkSpec(), test: dict[str, LabeledImages] | None = None,
                      init_state: dict[str, torch.Tensor] | None = None, deadline: float = 300.0,
                      optimizer: str = "adamw", lr_decay: float = 0.0, byzantine: int = 1,
                      hostile: dict[str, type[RoundRunner]] | None = None, slow: dict[str, float] | None = None,
                      work: Path | None = None, log: Progress = lambda _m: None) -> RoundsResult:
    """Run one `atd rounds` campaign among the nodes of `train` (name -> its training data)
    as real daemons on the in-memory network; returns the final global model and the
    per-node round reports and link bytes. `classes` is the shared label space (each node's
    labels are re-indexed into it); `model` a ModelConfig (num_classes is set from
    `classes`); `init_state` optional shared initial weights; `optimizer="sgd"` with `lr_decay`
    the FedWAvg paper's local SGD (momentum 0.9, rate x (1 - lr_decay) per epoch). `weighting`: the
    aggregator (`protocols.rounds.AGGREGATORS`), `byzantine` its f. `hostile`: node -> the
    RoundRunner subclass it runs instead (`netsim.hostile_rounds`); the result's model, checks
    and `identical` are the honest nodes'. `slow`: node -> simulated seconds each of its local
    trainings takes (`MemFabric.train_s`). `work` (default: a temporary
    directory, removed) holds the node homes."""
    from netsim.memnet import MemCluster, simulate

    names = list(train)
    if not names:
        raise RoundsError("no nodes")
    tmp = work is None
    root = Path(tempfile.mkdtemp(prefix="atd-fat-")) if tmp else Path(work)
    try:
        specs = {n: _write_node_data(root / "data" / f"{n}.npz", train[n], (test or {}).get(n), classes)
                 for n in names}
        cfg = model_config(model, len(classes))
        cluster = MemCluster(root / "homes", names, seed=seed, network=network, auto_fetch=False)
        transform = AdversarialTransform(adversarial) if adversarial is not None else None
        reports: dict[str, list[RoundReport]] = {n: [] for n in names}

        async def main() -> float:
            async with cluster.running():
                await cluster.start(names[0])
                for n in names[1:]:
                    await cluster.start(n, [names[0]])
                with trio.move_on_after(60):
                    while len(names) > 1 and any(not cluster.peers(n) for n in names):
                        await trio.sleep(0.05)
                t0 = trio.current_time()
                runners = [(hostile or {}).get(n, RoundRunner)(cluster.c.homes[n], RoundsConfig(
                    data=specs[n], cfg=cfg, rounds=rounds, weighting=weighting, byzantine=byzantine, q=q,
                    local_epochs=local_epochs,
                    batch_size=batch_size, lr=lr, seed=seed, deadline=deadline, batch_transform=transform,
                    init_state=init_state, optimizer=optimizer, lr_decay=lr_decay, log=lambda m, n=n: log(f"{n}: {m}")), fabric=MemFabric(cluster, n, train_s=(slow or {}).get(n, 0.0)))
                    for n in names]
                async with trio.open_nursery() as nursery:
                    for n, r in zip(names, runners):
                        nursery.start_soon(r.run, reports[n].append)
                return trio.current_time() - t0

        w0 = time.perf_counter()
        with volatile_disk():  # simulated homes: no fsync (atdnode.blobs.fs)
            sim_s = simulate(main, seed=seed)
        wall = time.perf_counter() - w0
        honest = [n for n in names if n not in (hostile or {})]
        last = {n: reports[n][-1].blob for n in honest if reports[n]}
        if not honest or len(last) != len(honest) or any(len(reports[n]) != rounds for n in honest):
            raise RoundsError(f"campaign incomplete: rounds per node {[len(r) for r in reports.values()]}")
        from atdnode.blobs import BlobStore

        state = load_weights(BlobStore(cluster.c.homes[honest[0]].blobs_dir), last[honest[0]])[0]
        res = RoundsResult(weighting=weighting, adversarial=adversarial is not None, nodes=names, classes=list(classes),
                           reports=reports, state=state, bytes={n: dict(cluster.link_bytes(n)) for n in names},
                           sim_s=round(sim_s, 3), wall_s=round(wall, 3), identical=len(set(last.values())) == 1, cfg=cfg,
                           hostile=sorted(hostile or {}))
        return res
    finally:
        if tmp:
            shutil.rmtree(root, ignore_errors=True)
