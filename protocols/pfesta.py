"""p-FESTA: a frozen plain patch embedder on clients, random patch permutation, and a server
that stores the permuted embeddings once and trains the body against clients' task tails.

Message flow (kind: sender -> receiver)::

    upload    client -> server  once: every image's N patch embeddings (pos embed added),
                                each image under a fresh random permutation     (k, N, D)
                                (the permutation keys never leave the client)
    body_out  server -> client  per step: body(stored[idx]) and the indices       (b, N, D)
    grad_out  client -> server  the client un-permutes with its keys, runs its tail,
                                and returns dLoss/d body_out in permuted order     (b, N, D)
    state_up / state_down       tails averaged per task every ``unifying_rounds``

The body has no position embedding and no cls token inside, so it is permutation-
equivariant: ``body(x[:, p]) == body(x)[:, p]``. Classification / regression tails pool
by the mean over tokens; segmentation tails see tokens back in image order.

**Ablation switches** (p-FESTA paper, ablation study: fixed vs learnable head, with vs
without position embedding); the defaults are the paper's method:

- ``head="fixed"`` (default): the embedder is frozen and each image is uploaded once.
  ``head="learnable"``: every client trains its own copy of the embedder (projection
  and position table) through the body, so nothing can be stored: per step the server
  names the batch (``batch {idx}``, meta only), the client sends freshly permuted
  embeddings (``forward``), gets ``body_out``, returns ``grad_out`` and receives
  ``grad_in`` (dLoss/d its embeddings), then steps embedder + tail. Cost
  ``2BR(F+G) + 2R Pt/n`` (:func:`protocols.comm_cost.t_pfesta_learnable_head`).
  Heads stay on their clients (only tails are averaged), so the embedder never reaches
  the server, as with the fixed head; deviation: the paper does not say whether its
  learnable heads were averaged.
- ``pos_embed=True`` (default): the embedder adds its (secret) position table before
  the permutation. ``pos_embed=False``: it adds none (the table is zero and stays zero),
  so after the permutation the body sees an unordered bag of patches.

**Deviation: the tail.** The paper's tails are "a simpler linear classifier" after the
body. Here a classification / regression tail is LayerNorm per token, the mean over tokens,
a BatchNorm1d without affine parameters (MAE's linear-probe norm: it standardises the
pooled features across the batch, which a fresh, near-identity body otherwise leaves
almost constant), then the linear layer (`protocols.split_parts.TaskTail`). Because the
unified tail's BatchNorm statistics are an average of the clients', evaluation first
*recalibrates* them on body outputs of up to ``CALIBRATION_SAMPLES`` of the client's own
training images (:meth:`PFestaClient.evaluate`, `TaskTail.calibrate`; extra evaluation
traffic, not counted as training bytes), on a copy, so the shared tail stays as unified.
"""
from __future__ import annotations

import copy
import hashlib

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from protocols.vit_config import ModelConfig
from protocols.comm_cost import CostParams, InProcessChannel, tensor_bytes
from protocols.split_rounds import Exchange, RoundPlan, SplitRunResult, Step, evaluate_clients, run_rounds
from protocols.split_parts import (TAIL_PART, BatchSampler, TaskSpec, TaskTail, TimmStem, task_loss,
                                   task_metric, under_prefix, with_prefix)
from protocols.split_server import BodyServer
from protocols.split_state import SplitProtocolError, check_features

TRAIN_KINDS = ("upload", "body_out", "grad_out", "state_up", "state_down")
# head="learnable": no upload; per step batch (meta) down, forward up, body_out down, grad_out up, grad_in down
LEARNABLE_TRAIN_KINDS = ("batch", "forward", "body_out", "grad_out", "grad_in", "state_up", "state_down")
HEADS = ("fixed", "learnable")


def train_kinds(head: str = "fixed") -> tuple[str, ...]:
    """The training message kinds of a p-FESTA run with this head (see the module doc)."""
    return LEARNABLE_TRAIN_KINDS if head == "learnable" else TRAIN_KINDS


def check_head(head: str) -> str:
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, not {head!r}")
    return head
CALIBRATION_SAMPLES = 512  # training images whose body outputs fix the tail's BatchNorm at evaluation


def random_permutations(batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """One fresh uniform permutation of ``n`` positions per image: (batch, n) long."""
    return torch.argsort(torch.rand(batch, n, generator=gen), dim=1)


def permute_tokens(tokens: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``out[b, j] = tokens[b, perm[b, j]]`` for (B, N, D) tokens and (B, N) keys."""
    return tokens.gather(1, perm.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))


def unpermute_tokens(tokens: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute_tokens` (differentiable: gradients flow back permuted)."""
    return permute_tokens(tokens, torch.argsort(perm, dim=1))


def client_seed(seed: int, client_id: str) -> int:
    """A 63-bit seed from a campaign seed and a client id (stable across processes)."""
    digest = hashlib.sha256(f"{seed}\x00{client_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class FeatureStore:
    """Permuted embeddings each client uploaded once, received in order in chunks; kept on
    the server body's ``device`` (so a step gathers its batch there), saved from the CPU."""

    def __init__(self, token_shape: tuple[int, int], max_batch: int, device: torch.device | str = "cpu") -> None:
        self.token_shape, self.max_batch, self.device = token_shape, max_batch, torch.device(device)
        self.features: dict[str, torch.Tensor] = {}
        self.received: dict[str, int] = {}

    def open(self, client_id: str, num_samples: int) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise SplitProtocolError(f"{client_id}: num_samples must be a positive int")
        if self.features.get(client_id) is not None and self.features[client_id].shape[0] == num_samples:
            return  # re-join after a restart or drop: keep what was uploaded
        self.features[client_id] = torch.empty(num_samples, *self.token_shape, device=self.device)
        self.received[client_id] = 0

    def receive(self, client_id: str, start: int, feats: torch.Tensor) -> None:
        if client_id not in self.features:
            raise SplitProtocolError(f"{client_id} uploads without having joined")
        check_features("upload", feats, self.token_shape, self.max_batch)
        have, total = self.received[client_id], self.features[client_id].shape[0]
        if start != have:
            raise SplitProtocolError(f"{client_id}: upload chunk starts at {start}, expected {have}")
        if have + feats.shape[0] > total:
            raise SplitProtocolError(f"{client_id}: upload exceeds the announced {total} samples")
        self.features[client_id][have:have + feats.shape[0]] = feats
        self.received[client_id] = have + feats.shape[0]

    def complete(self, client_id: str) -> bool:
        return client_id in self.features and self.received[client_id] == self.features[client_id].shape[0]

    def get(self, client_id: str, idx: Sequence[int]) -> torch.Tensor:
        if not self.complete(client_id):
            raise SplitProtocolError(f"{client_id}: upload incomplete ({self.received.get(client_id, 0)} samples)")
        return self.features[client_id][torch.as_tensor(list(idx), dtype=torch.long).to(self.device)]

    def to_state(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        return ({f"store.{c}": f.cpu() for c, f in self.features.items()}, dict(self.received))

    def load_state(self, tensors: Mapping[str, torch.Tensor], received: Mapping[str, int]) -> None:
        for c, n in received.items():
            self.features[c], self.received[c] = tensors[f"store.{c}"].clone().to(self.device), int(n)


class PFestaServer(BodyServer):
    """The p-FESTA server: stores uploads, chooses batches, trains the body."""

    kind = "pfesta"
    unify_with_head = False
    tail_pool = "avg"
    has_cls = False

    def __init__(self, cfg: ModelConfig, tasks: Sequence[TaskSpec], *, batch_size: int = 32,
                 head: str = "fixed", **kw: Any) -> None:
        """``head``: "fixed" (the paper's method: uploads stored once) or "learnable" (the
        ablation: clients send embeddings every step, see the module doc)."""
        super().__init__(cfg, tasks, **kw)
        self.batch_size, self.head = batch_size, check_head(head)
        self.store = FeatureStore(self.token_shape, self.max_batch, self.device)
        self.sizes: dict[str, int] = {}  # client -> samples it announced
        self._samplers: dict[str, BatchSampler] = {}

    def _ctor_kwargs(self) -> dict[str, Any]:
        return {"head": self.head}

    def join(self, client_id: str, task: str, num_samples: int) -> None:  # type: ignore[override]
        """Admit a client that will upload ``num_samples`` embeddings (kept across re-joins);
        with a learnable head nothing is stored, the size only drives the batch choice."""
        if self.head == "learnable" and (not isinstance(num_samples, int) or num_samples < 1):
            raise SplitProtocolError(f"{client_id}: num_samples must be a positive int")
        super().join(client_id, task)
        if self.head == "fixed":
            self.store.open(client_id, num_samples)
        if self.sizes.get(client_id) != num_samples:
            self._samplers.pop(client_id, None)
        self.sizes[client_id] = num_samples

    def receive_features(self, client_id: str, start: int, feats: torch.Tensor) -> None:
        """``upload`` message: a chunk of permuted embeddings starting at sample ``start``."""
        self.task_of(client_id)
        if self.head == "learnable":
            raise SplitProtocolError("this p-FESTA server trains learnable heads: nothing is uploaded")
        self.store.receive(client_id, start, feats)

    def batch_size_for(self, client_id: str) -> int:
        """The size of the client's training batches: the server's, capped by its samples."""
        return min(self.batch_size, self.sizes[client_id])

    def forget_upload(self, client_id: str) -> None:
        """Drop what the client uploaded and its batch order: a new client process has new
        permutation keys, so its old upload is useless (it joins and uploads afresh)."""
        self.store.features.pop(client_id, None)
        self.store.received.pop(client_id, None)
        self._samplers.pop(client_id, None)

    def next_indices(self, client_id: str) -> list[int]:
        """The server's choice of the client's next training batch: a per-client shuffle whose
        seed is a function of the campaign seed and the client id only (not of the order in
        which clients joined or how far the body got), so the schedule is reproducible."""
        self.task_of(client_id)
        if client_id not in self._samplers:
            n = self.sizes[client_id]
            self._samplers[client_id] = BatchSampler(n, self.batch_size_for(client_id),
                                                     seed=client_seed(self.seed, client_id))
        return self._samplers[client_id].next().tolist()

    def forward(self, client_id: str, idx: Sequence[int]) -> torch.Tensor:
        """Body output for stored samples ``idx`` (the ``body_out`` message)."""
        if self.head == "learnable":
            raise SplitProtocolError("this p-FESTA server trains learnable heads: send the batch's embeddings")
        n = self.store.features.get(client_id, torch.empty(0)).shape[0]
        if not idx or any(not isinstance(i, int) or not 0 <= i < n for i in idx):
            raise SplitProtocolError(f"{client_id}: indices must be ints in 0..{n - 1}")
        return self.body_forward(client_id, self.store.get(client_id, idx), need_input_grad=False)

    def forward_features(self, client_id: str, features: torch.Tensor) -> torch.Tensor:
        """Learnable head: body output for the (permuted) embeddings the client sent for the
        batch :meth:`next_indices` named (``forward`` -> ``body_out``)."""
        if self.head != "learnable":
            raise SplitProtocolError("this p-FESTA server stores uploads (fixed head): send indices, not features")
        return self.body_forward(client_id, features, need_input_grad=True)

    def backward(self, client_id: str, grad_out: torch.Tensor) -> torch.Tensor | None:
        """``grad_out`` message: update the body. Fixed head: nothing goes back (None); a
        learnable head gets dLoss/d its embeddings (the ``grad_in`` message)."""
        return self.body_backward(client_id, grad_out)

    def infer(self, client_id: str, features: torch.Tensor) -> torch.Tensor:
        """``eval_forward`` -> ``eval_out``: body output for fresh (permuted) test embeddings."""
        return self.body_infer(client_id, features)

    def _extra_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        t, received = self.store.to_state()
        return t, {"received": received, "batch_size": self.batch_size, "sizes": dict(self.sizes)}

    def _load_extra_state(self, tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, Any]) -> None:
        self.batch_size = int(scalars["batch_size"])
        self.store.load_state(tensors, scalars["received"])
        self.sizes = {str(c): int(n) for c, n in scalars.get("sizes", {}).items()}
        for c, f in self.store.features.items():
            self.sizes.setdefault(c, int(f.shape[0]))


class PFestaClient:
    """A p-FESTA client: the shared embedder, its permutation keys, a task tail.

    ``head="fixed"`` (the paper's): the embedder is frozen and shared. ``"learnable"``:
    this client trains its own copy (never sent). ``pos_embed=False``: the embedder adds
    no position table (a zeroed, frozen copy). See the module doc.

    Embedder and tail run on ``device`` (the node's device rule, `atdnode.learning.device`; an
    embedder elsewhere is copied there); permutation keys are drawn and kept on the CPU, and
    every tensor a method returns for the wire (embeddings, gradients, tails) is a CPU
    tensor, the same on any device."""

    def __init__(self, client_id: str, cfg: ModelConfig, task: TaskSpec, images: torch.Tensor,
                 targets: torch.Tensor, embedder: TimmStem, *, permute: bool = True, lr: float = 1e-3,
                 weight_decay: float = 0.05, seed: int = 0, head: str = "fixed", pos_embed: bool = True,
                 device: torch.device | str = "cpu") -> None:
        if images.shape[0] != targets.shape[0]:
            raise ValueError(f"{client_id}: {images.shape[0]} images but {targets.shape[0]} targets")
        self.client_id, self.cfg, self.task = client_id, cfg, task
        self.head, self.pos_embed = check_head(head), pos_embed
        self.images, self.targets, self.permute = images, targets, permute
        self.device = torch.device(device)
        if head == "learnable" or not pos_embed or next(embedder.parameters()).device != self.device:
            embedder = copy.deepcopy(embedder)  # ours alone: the shared one stays as it is
            if not pos_embed:
                with torch.no_grad():
                    embedder.vit.pos_embed.zero_()
            if head == "learnable":
                embedder.requires_grad_(True)
            embedder.vit.pos_embed.requires_grad_(head == "learnable" and pos_embed)
        self.embedder = embedder.to(self.device)
        self.tail = TaskTail(cfg, task, pool="avg", seed=seed + 1).to(self.device)
        params = [*self.tail.parameters()]
        if head == "learnable":
            params += [p for p in self.embedder.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self._gen = torch.Generator().manual_seed(seed + 2)
        n = cfg.num_patches
        self.keys = torch.arange(n).repeat(images.shape[0], 1)  # (M, N); replaced at upload
        self._feats: torch.Tensor | None = None  # learnable head: the pending step's embeddings (graph kept)

    @property
    def num_samples(self) -> int:
        return int(self.images.shape[0])

    @torch.no_grad()
    def embed(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of ``images`` under fresh permutations: (tokens (b, N, D), keys (b, N)), on the CPU."""
        tokens, keys = self._embed(images)
        return tokens.cpu(), keys

    def _embed(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(permuted tokens on the device, CPU keys): the keys come from this client's CPU
        generator, so they are the same on any device."""
        tokens = self.embedder(images.to(self.device))  # (b, N, D), pos embed added (zero with pos_embed=False)
        keys = (random_permutations(tokens.shape[0], tokens.shape[1], self._gen) if self.permute
                else torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1))
        return permute_tokens(tokens, keys.to(self.device)), keys

    def head_forward(self, idx: Sequence[int]) -> torch.Tensor:
        """Learnable head, ``batch {idx}`` -> ``forward``: the samples' embeddings under fresh
        permutations (keys remembered for the tail), graph kept for :meth:`head_backward`."""
        if self.head != "learnable":
            raise SplitProtocolError(f"{self.client_id}: a fixed head uploads once, it sends no per-step features")
        if not idx or any(not isinstance(i, int) or not 0 <= i < self.num_samples for i in idx):
            raise SplitProtocolError(f"{self.client_id}: batch indices must be ints in 0..{self.num_samples - 1}")
        ix = torch.as_tensor(list(idx), dtype=torch.long)
        self.opt.zero_grad(set_to_none=True)
        feats, keys = self._embed(self.images[ix])
        self.keys[ix] = keys
        self._feats = feats
        return feats.detach().cpu()

    def head_backward(self, grad_in: torch.Tensor) -> None:
        """Learnable head, ``grad_in``: back-propagate into the embedder, then one step on
        embedder + tail (the tail's gradient is already there from :meth:`tail_step`)."""
        if self._feats is None or grad_in.shape != self._feats.shape:
            raise SplitProtocolError(f"{self.client_id}: gradient {tuple(grad_in.shape)} does not match "
                                     "the pending forward")
        self._feats.backward(grad_in.to(self.device))
        self._feats = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def upload_chunks(self, chunk: int = 256) -> Iterator[tuple[int, torch.Tensor]]:
        """(start, permuted embeddings) for the one-time ``upload``; remembers the keys."""
        for start in range(0, self.num_samples, chunk):
            feats, keys = self.embed(self.images[start:start + chunk])
            self.keys[start:start + chunk] = keys
            yield start, feats

    def tail_step(self, idx: Sequence[int], body_out: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``body_out`` for stored samples ``idx`` -> (``grad_out`` in permuted order, loss)."""
        if (body_out.dim() != 3 or body_out.shape[0] != len(idx)
                or any(not 0 <= i < self.num_samples for i in idx)):
            raise SplitProtocolError(f"{self.client_id}: body output {tuple(body_out.shape)} does not fit "
                                     f"{len(idx)} indices of {self.num_samples} samples")
        ix = torch.as_tensor(list(idx), dtype=torch.long)
        self.tail.train()
        y = body_out.detach().to(self.device).requires_grad_(True)
        out = self.tail(unpermute_tokens(y, self.keys[ix].to(self.device)))  # tail sees image order
        loss = task_loss(self.task, out, self.targets[ix].to(self.device))
        if self.head == "fixed":
            self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.head == "fixed":  # a learnable head steps with the embedder, at grad_in
            self.opt.step()
        return y.grad.detach().cpu(), float(loss.detach())

    def train_step(self, idx: Sequence[int], body_out: torch.Tensor, exchange: Exchange) -> float:
        """The client's half of one training step once the body output of batch ``idx`` is here,
        run by the in-process driver and by `atd split join` alike: the tail step, ``grad_out``
        through ``exchange(kind, tensors, meta)`` (its reply: ``grad_in``'s gradient for a
        learnable head, then the embedder steps; None for the fixed head). Returns the loss."""
        g, loss = self.tail_step(idx, body_out)
        gin = exchange("grad_out", {"g": g}, {})
        if self.head == "learnable":
            self.head_backward(gin)
        return loss

    def part_state(self) -> dict[str, torch.Tensor]:
        """The task tail (the ``state_up`` message; CPU tensors)."""
        return with_prefix(TAIL_PART, self.tail.state_dict(), copy=True)

    def load_part_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tail.load_state_dict(under_prefix(TAIL_PART, tensors))

    @torch.no_grad()
    def evaluate(self, images: torch.Tensor, targets: torch.Tensor,
                 infer: Callable[[torch.Tensor], torch.Tensor], batch_size: int = 256) -> dict[str, float]:
        """Task metric on held-out images, sent permuted like training data. First the tail's
        BatchNorm statistics are recomputed at the final body from up to ``CALIBRATION_SAMPLES``
        of this client's training images (:meth:`TaskTail.calibrate`; extra evaluation traffic,
        not part of the paper's T_pFESTA)."""
        tail = copy.deepcopy(self.tail).eval()  # calibrated copy: the shared tail stays as unified

        def body(x: torch.Tensor) -> torch.Tensor:  # in image order, on the device
            feats, keys = self.embed(x)
            return unpermute_tokens(infer(feats).to(self.device), keys.to(self.device))

        tail.calibrate(torch.cat([tail.pooled(body(self.images[i:i + batch_size]))
                                  for i in range(0, min(self.num_samples, CALIBRATION_SAMPLES), batch_size)]))
        outs = [tail(body(images[i:i + batch_size])).cpu() for i in range(0, images.shape[0], batch_size)]
        return task_metric(self.task, torch.cat(outs), targets)

    def cost_params(self, *, batch_size: int, steps_per_round: int, rounds: int, unifying_rounds: int,
                    body_bytes: int) -> CostParams:
        """The paper's symbols; F = G = one sample's N x D float32 tokens, Ph = the embedder."""
        f = self.cfg.num_patches * self.cfg.embed_dim * 4
        return CostParams(D=self.num_samples, B=steps_per_round * batch_size, R=rounds, n=unifying_rounds,
                          F=f, G=f, Ph=tensor_bytes(self.embedder.state_dict()), Pb=body_bytes,
                          Pt=tensor_bytes(self.tail.state_dict()))


def upload_all(server: PFestaServer, client: PFestaClient, ch: InProcessChannel, chunk: int = 256) -> None:
    """The one-time upload of a client's permuted embeddings through ``ch``."""
    for start, feats in client.upload_chunks(chunk):
        m = ch.send(client.client_id, "up", "upload", {"x": feats}, {"start": start})
        server.receive_features(client.client_id, m.meta["start"], m.tensors["x"])


def pfesta_step(server: PFestaServer, by_id: Mapping[str, PFestaClient], ch: InProcessChannel) -> Step:
    """One p-FESTA training step of a client, as messages through ``ch`` (module doc): the
    :data:`protocols.split_rounds.Step` of :func:`run_pfesta_inprocess`. The server names the
    batch; a vanishing client receives its body output and never answers."""

    def step(cid: str, r: int, s: int, vanish: bool) -> float | None:
        c, idx = by_id[cid], server.next_indices(cid)
        if server.head == "learnable":  # the client embeds the named batch afresh
            b = ch.send(cid, "down", "batch", None, {"idx": idx})
            x = ch.send(cid, "up", "forward", {"x": c.head_forward(b.meta["idx"])}).tensors["x"]
            m = ch.send(cid, "down", "body_out", {"y": server.forward_features(cid, x)}, {"idx": idx})
        else:
            m = ch.send(cid, "down", "body_out", {"y": server.forward(cid, idx)}, {"idx": idx})
        if vanish:
            return None

        def exchange(kind: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> torch.Tensor | None:
            gin = server.backward(cid, ch.send(cid, "up", kind, tensors, meta).tensors["g"])
            return None if gin is None else ch.send(cid, "down", "grad_in", {"g": gin}).tensors["g"]  # learnable head

        return c.train_step(m.meta["idx"], m.tensors["y"], exchange)

    return step


def run_pfesta_inprocess(server: PFestaServer, clients: Sequence[PFestaClient], *, rounds: int,
                         steps_per_round: int, unifying_rounds: int, upload_chunk: int = 256,
                         channel: InProcessChannel | None = None,
                         test_data: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                         vanish: Mapping[str, tuple[int, int]] | None = None) -> SplitRunResult:
    """Run p-FESTA with every message through ``channel``: upload once, then the round loop of
    `protocols.split_rounds` over :func:`pfesta_step` (``rounds`` rounds of ``steps_per_round``
    server-chosen batches per client, tails unified every n rounds).
    ``vanish={client: (round, step)}``: that client receives its body output and never answers."""
    ch = channel or InProcessChannel()
    if any(c.head != server.head for c in clients):
        raise ValueError(f"every client must have the server's head ({server.head!r})")
    plan = RoundPlan(rounds, steps_per_round, unifying_rounds)
    res = SplitRunResult(counter=ch.counter, train_kinds=train_kinds(server.head))
    by_id = {c.client_id: c for c in clients}
    for c in clients:
        server.join(c.client_id, c.task.name, c.num_samples)
        if server.head == "fixed":
            upload_all(server, c, ch, upload_chunk)
    res.losses = run_rounds(server, by_id, plan, ch, pfesta_step(server, by_id, ch), vanish=vanish)
    body_bytes = tensor_bytes(server.body.state_dict())
    for cid in server.live_clients():
        res.params[cid] = by_id[cid].cost_params(batch_size=server.batch_size_for(cid), steps_per_round=steps_per_round,
                                                 rounds=rounds, unifying_rounds=unifying_rounds, body_bytes=body_bytes)
    res.metrics = evaluate_clients(server, by_id, ch, test_data)
    res.dropped = dict(server.dropped)
    return res
