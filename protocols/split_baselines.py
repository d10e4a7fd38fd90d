"""The baselines the split-learning papers compare FESTA / p-FESTA against, built from the
same parts (`protocols.split_parts`: FESTA's trainable head, the timm body, the task
tail) so only the training scheme differs:

- :func:`run_central`  -- centralized training: every client of a task sends its images
  and labels once (``data`` messages, counted), one model trains on the pool;
- :func:`run_fl`       -- FedAvg of the whole ViT (head + body + tail) among a task's
  clients: local steps every round, weights up (``weights``) and the average down
  (``global``) every ``unifying_rounds`` rounds. The weights and the average are the
  rule `atd rounds` applies (`protocols.rounds.round_weights` and
  `protocols.aggregation.weighted_average`, the functions behind
  `atdnode.rounds.runner.compute_round`), here over in-memory states instead of blobs;
- :func:`run_sl`       -- sequential (vanilla, U-shaped) split learning: one FESTA server
  body for the task, clients take turns; each trains ``steps_per_round`` batches through
  the body (the body steps on each, as only that client is expected), then hands its
  head + tail to the next client (``handoff``, counted apart: T_SL leaves it out).

All messages go through an :class:`~protocols.comm_cost.InProcessChannel` (encoded,
counted, decoded), so the measured bytes are those of the wire format. Evaluation uses the
same BatchNorm calibration as FESTA's clients (`TaskTail.calibrate`).
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from protocols.aggregation import weighted_average
from protocols.comm_cost import CostParams, InProcessChannel, tensor_bytes
from protocols.festa import CALIBRATION_SAMPLES, FestaClient, FestaServer, SplitRunResult
from protocols.rounds import last_layer_vector, round_weights
from protocols.vit_config import ModelConfig
from protocols.split_parts import (BatchSampler, SplitBody, TaskSpec, TaskTail, build_head,
                                   task_loss, task_metric)

CENTRAL_KINDS = ("data",)
FL_KINDS = ("weights", "global")
SL_KINDS = ("forward", "body_out", "grad_out", "grad_in")
TAIL_LAST_LAYER = ("tail.head.weight", "tail.head.bias")


@dataclass(frozen=True)
class ClientData:
    """One client's share of a task: its id, images (M, C, H, W) in [0, 1] and targets."""

    client_id: str
    images: torch.Tensor
    targets: torch.Tensor


class WholeViT(nn.Module):
    """FESTA's head, the server body and a task tail in one module (what FL and centralized
    training train); initialised exactly like FESTA's parts for the same seeds."""

    def __init__(self, cfg: ModelConfig, task: TaskSpec, seed: int, body_seed: int) -> None:
        super().__init__()
        self.task = task
        self.head = build_head(cfg, seed=seed)
        self.body = SplitBody(cfg, seed=body_seed)
        self.tail = TaskTail(cfg, task, pool="avg", seed=seed + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.body(self.head(x)))

    def part_bytes(self) -> tuple[int, int, int]:
        """(Ph, Pb, Pt): bytes of head, body and tail parameters and buffers."""
        return (tensor_bytes(self.head.state_dict()), tensor_bytes(self.body.state_dict()),
                tensor_bytes(self.tail.state_dict()))

    @torch.no_grad()
    def evaluate(self, calib: torch.Tensor, images: torch.Tensor, targets: torch.Tensor,
                 batch_size: int = 256) -> dict[str, float]:
        """Task metric on held-out images after setting the tail's BatchNorm statistics from
        up to ``CALIBRATION_SAMPLES`` training images (as FESTA's clients do)."""
        self.eval()
        tail = copy.deepcopy(self.tail)
        n = min(calib.shape[0], CALIBRATION_SAMPLES)
        tail.calibrate(torch.cat([tail.pooled(self.body(self.head(calib[i:i + batch_size])))
                                  for i in range(0, n, batch_size)]))
        outs = [tail(self.body(self.head(images[i:i + batch_size]))) for i in range(0, images.shape[0], batch_size)]
        self.train()
        return task_metric(self.task, torch.cat(outs), targets)


def _train(model: WholeViT, opt: torch.optim.Optimizer, sampler: BatchSampler, images: torch.Tensor,
           targets: torch.Tensor, steps: int) -> float:
    """``steps`` AdamW steps on batches from ``sampler``; mean loss."""
    model.train()
    total = 0.0
    for _ in range(steps):
        idx = sampler.next()
        loss = task_loss(model.task, model(images[idx]), targets[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += float(loss.detach())
    return total / max(1, steps)


def _params(cfg: ModelConfig, model: WholeViT, *, D: int, B: int, R: int, n: int) -> CostParams:
    """The paper's symbols for a client of this model (F = G = one sample's N x D tokens)."""
    f = cfg.num_patches * cfg.embed_dim * 4
    ph, pb, pt = model.part_bytes()
    return CostParams(D=D, B=B, R=R, n=n, F=f, G=f, Ph=ph, Pb=pb, Pt=pt)


def run_central(cfg: ModelConfig, task: TaskSpec, clients: Sequence[ClientData], *, steps: int,
                batch_size: int, lr: float, seed: int, body_seed: int, test: tuple[torch.Tensor, torch.Tensor],
                steps_per_round: int, rounds: int, unifying_rounds: int,
                channel: InProcessChannel | None = None) -> SplitRunResult:
    """Pool the clients' data (each sends it once), train one model for ``steps`` batches;
    every client's metric is the pooled model's. ``steps_per_round`` / ``rounds`` /
    ``unifying_rounds`` only fill the cost symbols (the formulas beside the data bytes)."""
    ch = channel or InProcessChannel()
    res = SplitRunResult(counter=ch.counter, train_kinds=CENTRAL_KINDS)
    xs, ys = [], []
    for c in clients:
        m = ch.send(c.client_id, "up", "data", {"x": c.images, "y": c.targets})
        xs.append(m.tensors["x"])
        ys.append(m.tensors["y"])
    x, y = torch.cat(xs), torch.cat(ys)
    model = WholeViT(cfg, task, seed, body_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sampler = BatchSampler(x.shape[0], min(batch_size, x.shape[0]), seed=seed + 2)
    loss = _train(model, opt, sampler, x, y, steps)
    metrics = model.evaluate(x, *test)
    for c in clients:
        res.losses[c.client_id] = [loss]
        res.metrics[c.client_id] = dict(metrics)
        res.params[c.client_id] = _params(cfg, model, D=c.images.shape[0], R=rounds, n=unifying_rounds,
                                          B=steps_per_round * min(batch_size, c.images.shape[0]))
    return res


def run_fl(cfg: ModelConfig, task: TaskSpec, clients: Sequence[ClientData], *, rounds: int,
           steps_per_round: int, unifying_rounds: int, batch_size: int, lr: float, seed: int, body_seed: int,
           test: tuple[torch.Tensor, torch.Tensor], weighting: str = "fedavg",
           channel: InProcessChannel | None = None) -> SplitRunResult:
    """FedAvg (``weighting="fedavg"``; "fedwavg" is `atd rounds`' other rule) of the whole ViT
    among ``clients``: all start from one global model, each trains ``steps_per_round``
    batches per round (its own AdamW state kept), and every ``unifying_rounds`` rounds the
    states go up and their average comes down. Metrics: the final global model's."""
    if rounds % unifying_rounds:
        raise ValueError(f"FL: rounds ({rounds}) must be a multiple of unifying_rounds ({unifying_rounds})")
    ch = channel or InProcessChannel()
    res = SplitRunResult(counter=ch.counter, train_kinds=FL_KINDS)
    glob = WholeViT(cfg, task, seed, body_seed)
    models = {c.client_id: copy.deepcopy(glob) for c in clients}
    opts = {cid: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.05) for cid, m in models.items()}
    samplers = {c.client_id: BatchSampler(c.images.shape[0], min(batch_size, c.images.shape[0]), seed=seed + 2 + i)
                for i, c in enumerate(clients)}
    order = sorted(models)
    for r in range(1, rounds + 1):
        for c in clients:
            loss = _train(models[c.client_id], opts[c.client_id], samplers[c.client_id], c.images, c.targets,
                          steps_per_round)
            res.losses.setdefault(c.client_id, []).append(loss)
        if r % unifying_rounds == 0:
            ref = last_layer_vector(glob.state_dict(), TAIL_LAST_LAYER)
            states = [ch.send(cid, "up", "weights", models[cid].state_dict()).tensors for cid in order]
            w = round_weights(weighting, reference=ref, q=1.0,
                              layers=[last_layer_vector(s, TAIL_LAST_LAYER) for s in states])
            avg = weighted_average([lambda s=s: s for s in states], w, names=order)
            glob.load_state_dict(avg)
            for cid in order:
                models[cid].load_state_dict(ch.send(cid, "down", "global", avg).tensors)
    calib = torch.cat([c.images for c in clients])
    metrics = glob.evaluate(calib, *test)
    for c in clients:
        res.metrics[c.client_id] = dict(metrics)
        res.params[c.client_id] = _params(cfg, glob, D=c.images.shape[0], R=rounds, n=unifying_rounds,
                                          B=steps_per_round * samplers[c.client_id].batch_size)
    return res


def run_sl(cfg: ModelConfig, task: TaskSpec, clients: Sequence[FestaClient], *, rounds: int,
           steps_per_round: int, lr: float, seed: int, test: tuple[torch.Tensor, torch.Tensor],
           unifying_rounds: int = 1, channel: InProcessChannel | None = None) -> SplitRunResult:
    """Sequential split learning: clients (FESTA clients of one task, each with its own head
    and tail optimizer) take turns in id order every round through one body; before its turn
    a client receives the previous client's head + tail (``handoff``). ``unifying_rounds``
    only fills the cost symbols (T_SL has no n; the other formulas beside it do)."""
    ch = channel or InProcessChannel()
    res = SplitRunResult(counter=ch.counter, train_kinds=SL_KINDS)
    server = FestaServer(cfg, [task], lr=lr, seed=seed)
    by_id = {c.client_id: c for c in clients}
    order = sorted(by_id)
    for cid in order:
        server.join(cid, task.name)
    prev: str | None = None
    for r in range(1, rounds + 1):
        for cid in order:
            c = by_id[cid]
            if prev is not None and prev != cid:
                m = ch.send(prev, "up", "handoff", by_id[prev].part_state())
                c.load_part_state(ch.send(cid, "down", "handoff", m.tensors).tensors)
            server.begin_round(r, deadline=float("inf"), clients=[cid])  # only cid owes this body step
            losses = []
            for _ in range(steps_per_round):
                m = ch.send(cid, "up", "forward", {"x": c.head_forward()}, {"task": task.name})
                y = ch.send(cid, "down", "body_out", {"y": server.forward(cid, task.name, m.tensors["x"])})
                g, loss = c.tail_step(y.tensors["y"])
                gin = server.backward(cid, ch.send(cid, "up", "grad_out", {"g": g}).tensors["g"])
                c.head_backward(ch.send(cid, "down", "grad_in", {"g": gin}).tensors["g"])
                losses.append(loss)
            server.finish_round(cid)
            res.losses.setdefault(cid, []).append(sum(losses) / len(losses))
            prev = cid
    last = by_id[prev] if prev is not None else clients[0]
    body_bytes = tensor_bytes(server.body.state_dict())
    for cid in order:  # the model is the last client's head + tail on the body
        by_id[cid].load_part_state(last.part_state())
        res.metrics[cid] = by_id[cid].evaluate(*test, lambda x, cid=cid: server.infer(cid, x))
        res.params[cid] = by_id[cid].cost_params(steps_per_round=steps_per_round, rounds=rounds,
                                                 unifying_rounds=unifying_rounds,
                                                 body_bytes=body_bytes)
    return res


def mean_metric(metrics: Mapping[str, Mapping[str, float]], clients: Sequence[str], key: str) -> float:
    """The mean of ``key`` over ``clients``' metrics."""
    return sum(metrics[c][key] for c in clients) / len(clients)
