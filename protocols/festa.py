"""FESTA: federated split task-agnostic learning with a shared timm transformer body.

Roles (no networking here; a driver moves the messages, see :func:`run_festa_inprocess`):

- :class:`FestaClient` holds a task-specific *head* (timm patch embedding + position
  embedding, optionally a cls token) and *tail* (final norm + task head) and its private data;
- :class:`FestaServer` holds the *body* (timm ``Block`` s) shared by all clients of all tasks.

One training step, as messages (kind: sender -> receiver, tensor)::

    forward   client -> server  x  = head(images)          (b, T, D)
    body_out  server -> client  y  = body(x)               (b, T, D)
    grad_out  client -> server  gy = dLoss/dy (tail)       (b, T, D)
    grad_in   server -> client  gx = dLoss/dx (body)       (b, T, D)   server updates body

with T = N patch tokens (default, tails average them) or 1+N with ``class_token=True``.
                                                            client updates head + tail

The body takes one step per synchronous step on the task-averaged client gradients
(Algorithm 1 l.12, see :mod:`protocols.split_server`). Every ``unifying_rounds`` rounds,
clients of the same task upload head+tail (``state_up``) and receive their uniform
average (``state_down``; sample-weighted with ``part_weighting="samples"``). Phase 2
freezes the body and keeps training (and unifying) heads and tails through it.

Heads (``head=``): ``"vit"`` (default) is a trainable timm patch embedding + position table,
the same architecture as p-FESTA's frozen embedder; ``"conv"`` (:class:`ConvHead`) is a small
task-specific CNN before the patch projection, closer to the paper's setting (FESTA §4: each
task keeps its own CNN head, e.g. a CheXpert-pretrained feature extractor for
classification, in front of a shared Transformer body). `atd split compare` runs FESTA with
the conv head, so its FESTA vs p-FESTA orderings compare a CNN-headed FESTA with p-FESTA's
fixed patch embedder rather than two near-identical embedders.

Deviations. Body step size: Algorithm 1 l.12 scales the task sum by ``eta / K``; the body
here takes ``sum_k lambda_k / N_k sum_c g_c`` (``lambda_k`` = the task's ``loss_weight``,
default 1) into AdamW (:mod:`protocols.split_server`). AdamW's step is invariant to a
constant gradient scale (up to its epsilon), so the 1/K factor changes nothing there; with
plain SGD, set ``loss_weight = 1/K`` to get the paper's step. Heads are not pretrained here
(the paper's classification head starts from CheXpert weights).
"""
from __future__ import annotations

import copy

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from timm.layers import build_sincos2d_pos_embed
from torch import nn

from protocols.seeding import seeded
from protocols.vit_config import ModelConfig
from protocols.comm_cost import CostParams, InProcessChannel, tensor_bytes
from protocols.split_parts import (HEAD_PART, TAIL_PART, BatchSampler, TaskSpec, TaskTail, build_head, task_loss,
                                   task_metric, under_prefix, with_prefix)
from protocols.split_rounds import (Exchange, RoundPlan, SplitRunResult, Step, evaluate_clients,  # noqa: F401
                                    run_rounds, unify_clients)
from protocols.split_server import BodyServer
from protocols.split_state import SplitProtocolError

TRAIN_KINDS = ("forward", "body_out", "grad_out", "grad_in", "state_up", "state_down")
CALIBRATION_SAMPLES = 512  # training images whose body outputs fix the tail's BatchNorm at evaluation


class FestaServer(BodyServer):
    """The FESTA body server. Message handlers: :meth:`forward`, :meth:`backward`,
    :meth:`infer`, plus the unification / fault / persistence methods of BodyServer."""

    kind = "festa"
    unify_with_head = True

    def __init__(self, cfg: ModelConfig, tasks: Sequence[TaskSpec], *, class_token: bool = False,
                 head: str = "vit", **kw: Any) -> None:
        """``class_token``: heads send a cls token first and tails pool it (timm "token");
        otherwise tails average the patch tokens (timm "avg"), which trains faster here.
        ``head``: the clients' head (:data:`HEADS`), whose state unification checks."""
        if head not in HEADS or (head == "conv" and class_token):
            raise ValueError(f"head {head!r} (class_token={class_token}): choose from {', '.join(HEADS)};"
                             " the conv head has no class token")
        self.has_cls, self.tail_pool, self.head = class_token, ("token" if class_token else "avg"), head
        super().__init__(cfg, tasks, **kw)
        if head == "conv":  # unification checks the conv head's keys and shapes
            conv = with_prefix(HEAD_PART, ConvHead(cfg).state_dict())
            self._templates = {name: {**{k: v for k, v in t.items() if not k.startswith(HEAD_PART)}, **conv}
                               for name, t in self._templates.items()}

    def _ctor_kwargs(self) -> dict[str, Any]:
        return {"class_token": self.has_cls, "head": self.head}

    def forward(self, client_id: str, task: str, features: torch.Tensor) -> torch.Tensor:
        """``forward`` message -> ``body_out`` reply."""
        if self.task_of(client_id).name != task:
            raise SplitProtocolError(f"client {client_id} joined task {self.clients[client_id]!r}, sent {task!r}")
        return self.body_forward(client_id, features)

    def backward(self, client_id: str, grad_out: torch.Tensor) -> torch.Tensor:
        """``grad_out`` message -> ``grad_in`` reply (updates the body unless frozen)."""
        out = self.body_backward(client_id, grad_out)
        assert out is not None  # FESTA always asks for the input gradient
        return out

    def infer(self, client_id: str, features: torch.Tensor) -> torch.Tensor:
        """``eval_forward`` message -> ``eval_out`` reply; no update."""
        return self.body_infer(client_id, features)


HEADS = ("vit", "conv")


class ConvHead(nn.Module):
    """A small task-specific CNN head (FESTA §4's setting, scaled down): two 3x3 convolutions
    (C -> ``width`` -> ``width``, GELU) keep the resolution, a ``patch_size``-strided
    convolution makes one D-wide token per patch, plus a trainable position table started at
    the public 2-D sin-cos one: (B, C, H, W) -> (B, N, D), the body's input."""

    def __init__(self, cfg: ModelConfig, *, width: int = 16, seed: int = 0) -> None:
        super().__init__()
        with seeded(seed):
            self.convs = nn.Sequential(nn.Conv2d(cfg.in_chans, width, 3, padding=1), nn.GELU(),
                                       nn.Conv2d(width, width, 3, padding=1), nn.GELU())
            self.proj = nn.Conv2d(width, cfg.embed_dim, cfg.patch_size, cfg.patch_size)
        side = cfg.img_size // cfg.patch_size
        self.pos = nn.Parameter(build_sincos2d_pos_embed([side, side], dim=cfg.embed_dim).unsqueeze(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.convs(x)).flatten(2).transpose(1, 2) + self.pos  # (B, N, D)


class FestaClient:
    """A FESTA client: head + tail for one task, its data, one AdamW over head and tail.
    ``head``: one of :data:`HEADS` (module doc). Head and tail run on ``device`` (the node's
    device rule, `atdnode.learning.device`); every tensor a method returns for the wire (features,
    gradients, shared parts) is a CPU tensor, the same on any device, and every tensor it is
    given may be a CPU one. Images and targets stay where they are given; batches move."""

    def __init__(self, client_id: str, cfg: ModelConfig, task: TaskSpec, images: torch.Tensor,
                 targets: torch.Tensor, *, batch_size: int = 32, lr: float = 1e-3,
                 weight_decay: float = 0.05, class_token: bool = False, seed: int = 0, head: str = "vit",
                 device: torch.device | str = "cpu") -> None:
        if images.shape[0] != targets.shape[0]:
            raise ValueError(f"{client_id}: {images.shape[0]} images but {targets.shape[0]} targets")
        if head not in HEADS or (head == "conv" and class_token):
            raise ValueError(f"{client_id}: head {head!r} (class_token={class_token}): choose from {', '.join(HEADS)};"
                             " the conv head has no class token")
        self.client_id, self.cfg, self.task = client_id, cfg, task
        self.images, self.targets = images, targets
        self.class_token, self.device = class_token, torch.device(device)
        self.head = (ConvHead(cfg, seed=seed) if head == "conv"
                     else build_head(cfg, seed=seed, class_token=class_token)).to(self.device)
        self.tail = TaskTail(cfg, task, pool="token" if class_token else "avg", seed=seed + 1).to(self.device)
        self.opt = torch.optim.AdamW([*self.head.parameters(), *self.tail.parameters()], lr=lr,
                                     weight_decay=weight_decay)
        self.sampler = BatchSampler(images.shape[0], batch_size, seed=seed + 2)
        self._feats: torch.Tensor | None = None
        self._batch_idx: torch.Tensor | None = None
        self._batch_targets: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return int(self.images.shape[0])

    def head_forward(self) -> torch.Tensor:
        """Draw the next batch and return its head features (the ``forward`` message)."""
        idx = self.sampler.next()
        self.head.train()
        self.opt.zero_grad(set_to_none=True)
        self._feats = self.head(self.images[idx].to(self.device))  # (b, T, D), graph kept for head_backward
        self._batch_idx, self._batch_targets = idx, self.targets[idx].to(self.device)
        return self._feats.detach().cpu()

    def tail_step(self, body_out: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``body_out`` -> (``grad_out`` message, loss): tail loss, backward into the tail."""
        if self._feats is None or body_out.shape != self._feats.shape:
            raise SplitProtocolError(f"{self.client_id}: body output {tuple(body_out.shape)} does not match "
                                     "the pending forward")
        y = body_out.detach().to(self.device).requires_grad_(True)
        self.tail.train()
        loss = task_loss(self.task, self.tail(y), self._batch_targets)
        loss.backward()
        return y.grad.detach().cpu(), float(loss.detach())

    def head_backward(self, grad_in: torch.Tensor) -> None:
        """``grad_in`` -> backward into the head, then one optimizer step on head + tail."""
        if self._feats is None or grad_in.shape != self._feats.shape:
            raise SplitProtocolError(f"{self.client_id}: gradient {tuple(grad_in.shape)} does not match "
                                     "the pending forward")
        self._feats.backward(grad_in.to(self.device))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._feats = None

    def train_step(self, exchange: Exchange, round_idx: int) -> float:
        """The client's half of one training step (module doc), run by the in-process driver
        and by `atd split join` alike: ``exchange(kind, tensors, meta)`` carries a message to the
        server and returns the tensor of its reply (``forward`` -> body_out's y, ``grad_out`` ->
        grad_in's g). Returns the step's loss."""
        y = exchange("forward", {"x": self.head_forward()}, {"task": self.task.name, "round": round_idx})
        g, loss = self.tail_step(y)
        self.head_backward(exchange("grad_out", {"g": g}, {}))
        return loss

    def part_state(self) -> dict[str, torch.Tensor]:
        """What this client shares at a unification (the ``state_up`` message; CPU tensors)."""
        return {**with_prefix(HEAD_PART, self.head.state_dict(), copy=True),
                **with_prefix(TAIL_PART, self.tail.state_dict(), copy=True)}

    def load_part_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Adopt the task's averaged head + tail (the ``state_down`` message)."""
        self.head.load_state_dict(under_prefix(HEAD_PART, tensors))
        self.tail.load_state_dict(under_prefix(TAIL_PART, tensors))

    @torch.no_grad()
    def evaluate(self, images: torch.Tensor, targets: torch.Tensor,
                 infer: Callable[[torch.Tensor], torch.Tensor], batch_size: int = 256) -> dict[str, float]:
        """Task metric on held-out data; ``infer`` carries head features through the server body.
        The tail's BatchNorm statistics (avg pooling) are first recomputed at the final body
        from up to ``CALIBRATION_SAMPLES`` training images (:meth:`TaskTail.calibrate`)."""
        self.head.eval()
        tail = copy.deepcopy(self.tail).eval()  # calibrated copy: the shared tail stays as unified

        def body(x: torch.Tensor) -> torch.Tensor:  # head here, body there (CPU tensors on the wire)
            return infer(self.head(x.to(self.device)).cpu()).to(self.device)

        if tail.pool == "avg":
            n = min(self.num_samples, CALIBRATION_SAMPLES)
            tail.calibrate(torch.cat([tail.pooled(body(self.images[i:i + batch_size]))
                                      for i in range(0, n, batch_size)]))
        outs = [tail(body(images[i:i + batch_size])).cpu() for i in range(0, images.shape[0], batch_size)]
        return task_metric(self.task, torch.cat(outs), targets)

    def cost_params(self, *, steps_per_round: int, rounds: int, unifying_rounds: int,
                    body_bytes: int) -> CostParams:
        """The paper's symbols for this client (F = G = one sample's (N [+1 cls]) x D float32 tokens)."""
        f = (self.cfg.num_patches + int(self.class_token)) * self.cfg.embed_dim * 4
        return CostParams(D=self.num_samples, B=steps_per_round * self.sampler.batch_size, R=rounds,
                          n=unifying_rounds, F=f, G=f, Ph=tensor_bytes(self.head.state_dict()),
                          Pb=body_bytes, Pt=tensor_bytes(self.tail.state_dict()))


def festa_step(server: FestaServer, by_id: Mapping[str, FestaClient], ch: InProcessChannel) -> Step:
    """One FESTA training step of a client, as messages through ``ch`` (module doc): the
    :data:`protocols.split_rounds.Step` of :func:`run_festa_inprocess`. A vanishing client
    sends its forward and never takes the body output."""

    class Vanished(Exception):
        pass

    def step(cid: str, r: int, s: int, vanish: bool) -> float | None:
        def exchange(kind: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> torch.Tensor:
            m = ch.send(cid, "up", kind, tensors, meta)
            if kind == "forward":
                y = server.forward(cid, m.meta["task"], m.tensors["x"])
                if vanish:
                    raise Vanished
                return ch.send(cid, "down", "body_out", {"y": y}).tensors["y"]
            return ch.send(cid, "down", "grad_in", {"g": server.backward(cid, m.tensors["g"])}).tensors["g"]

        try:
            return by_id[cid].train_step(exchange, r)
        except Vanished:
            return None

    return step


def run_festa_inprocess(server: FestaServer, clients: Sequence[FestaClient], *, rounds: int,
                        steps_per_round: int, unifying_rounds: int, phase2_rounds: int = 0,
                        channel: InProcessChannel | None = None,
                        test_data: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                        vanish: Mapping[str, tuple[int, int]] | None = None) -> SplitRunResult:
    """Run FESTA with every message encoded, counted and decoded by ``channel``: the round loop
    of `protocols.split_rounds` (rounds 1..rounds train the body, rounds+1..rounds+phase2_rounds
    freeze it; unification after every round r with r % n == 0) over :func:`festa_step`.
    ``vanish={client: (round, step)}`` makes that client send its forward and then never
    answer: the server drops it at the round deadline and the others go on."""
    ch = channel or InProcessChannel()
    plan = RoundPlan(rounds, steps_per_round, unifying_rounds, phase2_rounds)
    res = SplitRunResult(counter=ch.counter, train_kinds=TRAIN_KINDS)
    for c in clients:
        server.join(c.client_id, c.task.name)
    by_id = {c.client_id: c for c in clients}
    res.losses = run_rounds(server, by_id, plan, ch, festa_step(server, by_id, ch), vanish=vanish)
    body_bytes = tensor_bytes(server.body.state_dict())
    for cid in server.live_clients():
        res.params[cid] = by_id[cid].cost_params(steps_per_round=steps_per_round, rounds=plan.total,
                                                 unifying_rounds=unifying_rounds, body_bytes=body_bytes)
    res.metrics = evaluate_clients(server, by_id, ch, test_data)
    res.dropped = dict(server.dropped)
    return res
