"""The server side shared by FESTA and p-FESTA: a timm transformer body that clients reach
with explicit message-in / message-out calls. No networking: a driver (in-process or a
libp2p stream handler) decodes a client's frame, calls one method, encodes the result.

Contract of one training step for client ``c``::

    out = server.body_forward(c, x)          # keeps (x, out) pending for c
    grad_in = server.body_backward(c, g)     # g = dLoss/d out; stores c's body gradient

**Body update (FESTA Algorithm 1 l.12, p-FESTA Algorithm 1 l.14).** The body takes one
optimizer step per synchronous step, on

    g_body = sum_k  lambda_k * (1 / N_k) * sum_{c in task k} g_c

where N_k is the number of clients of task k that took part in the step and lambda_k the
task's ``loss_weight``: every task counts equally whatever its number of clients, and
each client equally within its task. The step is taken once every client that owes the
open round something (:meth:`begin_round` ... :meth:`finish_round`) has sent its
gradient for it, or was dropped (:meth:`drop_client`, :meth:`expire`). A client that
already sent this step's gradient may not start the next step before the barrier
(:meth:`can_forward`; a forward then raises :class:`StepBarrier`), so every forward of
a step sees the same body and the sum runs in client-id order: the update does not depend
on the order or timing in which clients send. The gradient returned to the client is the
unweighted dLoss/d input at that same body, so its own parts see its own loss.

Deviation: the papers' round is one batch per client; here a campaign round groups
``steps_per_round`` such synchronous steps between deadlines and unifications (with
``steps_per_round = 1`` a round is exactly the paper's). The server keeps one body
gradient per client until the barrier (memory: clients x body size).

**Unification** of heads / tails (Algorithm 1, every n rounds) is the uniform average
over a task's clients by default, as in the papers; ``part_weighting="samples"`` weights
by the clients' sample counts (FedAvg's rule) instead.

**Device.** The body, its optimizer and the pending steps live on ``device`` (default the
CPU; the node passes its device, atdnode.learning.device). Tensors come in and go out on the CPU —
what a driver encodes for the wire is the same on any device.

A client that vanishes mid-round is dropped by :meth:`drop_client` (or :meth:`expire`
at the round deadline): its pending step and unification upload are discarded, the
event is recorded, the rest continue (the barrier no longer waits for it).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from protocols.vit_config import ModelConfig
from protocols.split_parts import SplitBody, TaskSpec, fedavg, part_template, split_config, split_dict
from protocols.split_state import (ClientDropped, RoundTracker, SplitProtocolError, SplitStateError,
                                   check_features, load_state, optimizer_from_state, optimizer_to_state,
                                   save_state)


PART_WEIGHTINGS = ("uniform", "samples")


class StepBarrier(SplitProtocolError):
    """A client asked for its next step before the body took the current one."""


class BodyServer:
    """Shared body, per-client pending steps, unification of client parts, faults, persistence."""

    kind = "body"
    unify_with_head = False  # whether clients share head.* (FESTA) or only tail.* (p-FESTA)
    tail_pool = "avg"
    has_cls = False  # whether the tokens a client sends start with a cls token

    @property
    def token_shape(self) -> tuple[int, int]:
        """(T, D) of one sample's tokens at the cut."""
        return (self.cfg.num_patches + int(self.has_cls), self.cfg.embed_dim)

    def __init__(self, cfg: ModelConfig, tasks: Sequence[TaskSpec], *, lr: float = 1e-3,
                 weight_decay: float = 0.05, seed: int = 0, max_batch: int = 1024,
                 part_weighting: str = "uniform", device: torch.device | str = "cpu") -> None:
        if self.has_cls != (self.tail_pool == "token"):
            raise ValueError("a cls token goes with token pooling, and only with it")
        if not tasks or len({t.name for t in tasks}) != len(tasks):
            raise ValueError("a split server needs at least one task, with unique names")
        if part_weighting not in PART_WEIGHTINGS:
            raise ValueError(f"part_weighting must be one of {PART_WEIGHTINGS}, not {part_weighting!r}")
        self.part_weighting = part_weighting
        self.cfg, self.tasks = cfg, {t.name: t for t in tasks}
        self.lr, self.weight_decay, self.seed, self.max_batch = lr, weight_decay, seed, max_batch
        self.device = torch.device(device)
        self.body = SplitBody(cfg, seed=seed).to(self.device)  # initialised on the CPU: the same on any device
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(self.body.parameters(), lr=lr, weight_decay=weight_decay, **fused)
        self.frozen = False
        self.version = 0  # optimizer steps taken; a pending forward older than this is recomputed
        self.clients: dict[str, str] = {}  # client id -> task name
        self.dropped: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.rounds = RoundTracker()
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        # body gradients of the open step, per client (None: nothing to add, e.g. loss weight 0)
        self._step_grads: dict[str, list[torch.Tensor] | None] = {}
        self._submitted: dict[str, dict[str, tuple[dict[str, torch.Tensor], int]]] = {}
        self._templates = {t.name: part_template(cfg, t, with_head=self.unify_with_head, pool=self.tail_pool)
                           for t in tasks}

    # --- membership and faults -------------------------------------------------------

    def join(self, client_id: str, task: str) -> None:
        """Admit (or re-admit after a drop) a client for ``task``."""
        if task not in self.tasks:
            raise SplitProtocolError(f"unknown task {task!r}; this server offers {sorted(self.tasks)}")
        self.dropped.pop(client_id, None)
        self._pending.pop(client_id, None)
        self.clients[client_id] = task
        self.events.append({"event": "join", "client": client_id, "task": task, "round": self.rounds.round})

    def task_of(self, client_id: str) -> TaskSpec:
        if client_id in self.dropped:
            raise ClientDropped(f"client {client_id} was dropped in round {self.dropped[client_id]['round']} "
                                f"({self.dropped[client_id]['reason']}); it must join again")
        if client_id not in self.clients:
            raise SplitProtocolError(f"client {client_id} has not joined")
        return self.tasks[self.clients[client_id]]

    def live_clients(self, task: str | None = None) -> list[str]:
        return sorted(c for c, t in self.clients.items() if task is None or t == task)

    def drop_client(self, client_id: str, reason: str) -> None:
        """Forget a client's in-flight step and upload; later messages raise ClientDropped."""
        task = self.clients.pop(client_id, None)
        self._pending.pop(client_id, None)
        if task is not None:
            self._submitted.get(task, {}).pop(client_id, None)
        self._step_grads.pop(client_id, None)
        self.rounds.done(client_id)
        self.dropped[client_id] = {"round": self.rounds.round, "reason": reason, "task": task}
        self.events.append({"event": "drop", "client": client_id, "round": self.rounds.round, "reason": reason})
        self._maybe_step()

    def begin_round(self, round_idx: int, deadline: float, clients: Iterable[str] | None = None) -> None:
        """Start round bookkeeping: every live client (or ``clients``) owes a finish by ``deadline``."""
        self.rounds.begin(round_idx, self.live_clients() if clients is None else clients, deadline)

    def finish_round(self, client_id: str) -> None:
        self.task_of(client_id)
        self.rounds.done(client_id)
        self._maybe_step()

    def expire(self, now: float) -> list[str]:
        """Past the round deadline, drop the clients that hold the round up (:meth:`stalling`);
        returns them. Those only waiting at the step barrier stay and go on."""
        late = self.stalling() if self.rounds.overdue(now) else []
        for c in late:
            self.drop_client(c, f"missed the round {self.rounds.round} deadline")
        return late

    def stalling(self) -> list[str]:
        """Clients that have not finished the round and are not merely waiting at the step
        barrier for others (they already sent the open step's gradient)."""
        return sorted(c for c in self.rounds.pending() if c not in self._step_grads)

    # --- the body ---------------------------------------------------------------------

    def freeze_body(self) -> None:
        """Phase 2: the body stops learning; clients keep training their parts through it."""
        self.frozen = True
        self.body.requires_grad_(False)
        self.events.append({"event": "freeze", "round": self.rounds.round})

    def can_forward(self, client_id: str) -> bool:
        """Whether ``client_id`` may start a step now: False while the body waits for other
        clients' gradients of the step this client already finished (see the module doc)."""
        return client_id not in self._step_grads

    def step_waiting_for(self) -> list[str]:
        """Clients whose gradient the open body step still waits for (empty: no step open)."""
        if not self._step_grads:
            return []
        return sorted(c for c in self._expected() if c not in self._step_grads)

    def _expected(self) -> set[str]:
        """Who owes a gradient to every body step of the open round: live clients that have
        not finished the round."""
        return {c for c in self.rounds.pending() if c in self.clients}

    def body_forward(self, client_id: str, x: torch.Tensor, *, need_input_grad: bool = True) -> torch.Tensor:
        """Run the body on a client's tokens (validated) and keep the step pending."""
        self.task_of(client_id)
        if client_id in self._pending:
            raise SplitProtocolError(f"client {client_id} sent a forward while its previous step is pending")
        if not self.can_forward(client_id):
            raise StepBarrier(f"client {client_id} started a step before the body took the previous one "
                              f"(waiting for {self.step_waiting_for()})")
        check_features("features", x, self.token_shape, self.max_batch)
        x = x.detach().to(self.device).requires_grad_(need_input_grad)
        with torch.enable_grad(), self._autocast():
            out = self.body(x).float()  # (B, T, D)
        self._pending[client_id] = (x, out, self.version)
        return out.detach().cpu()

    def body_backward(self, client_id: str, grad_out: torch.Tensor) -> torch.Tensor | None:
        """Back-propagate ``grad_out`` (dLoss/d body output); keep the body gradient for the
        step (unless frozen) and take the step once every expected client sent its gradient
        (:meth:`_maybe_step`); return dLoss/d input (None if not requested)."""
        task = self.task_of(client_id)
        if client_id not in self._pending:
            raise SplitProtocolError(f"client {client_id} sent a gradient without a pending forward")
        x, out, version = self._pending[client_id]
        check_features("gradient", grad_out, tuple(out.shape[1:]), self.max_batch)
        if grad_out.shape[0] != out.shape[0]:
            raise SplitProtocolError(f"gradient: batch {grad_out.shape[0]}, forward had {out.shape[0]}")
        del self._pending[client_id]
        if not grad_out.isfinite().all():
            raise SplitProtocolError(f"gradient of {client_id} contains NaN or inf")
        grad_out = grad_out.to(self.device)
        params = [] if self.frozen or task.loss_weight == 0 else [p for p in self.body.parameters()]
        inputs = ([x] if x.requires_grad else []) + params
        grads: tuple[torch.Tensor, ...] = ()
        if inputs:
            with torch.enable_grad(), self._autocast():
                if version != self.version:
                    out = self.body(x).float()  # only after a restart or a drop: recompute at current weights
                grads = torch.autograd.grad(out, inputs, grad_out)
        grad_in = grads[0].detach().cpu() if x.requires_grad else None
        if not self.frozen:
            self._step_grads[client_id] = [g.detach() for g in grads[len(inputs) - len(params):]] if params else None
            self._maybe_step()
        return grad_in

    def _maybe_step(self) -> None:
        """Take the body step once no expected client's gradient is missing (Algorithm 1
        l.12 / l.14): per task the mean over its clients, times the task's loss weight,
        summed over tasks in name order, clients in id order (bit-reproducible)."""
        if not self._step_grads or any(c not in self._step_grads for c in self._expected()):
            return
        by_task: dict[str, list[str]] = {}
        for c in sorted(self._step_grads):
            if c in self.clients:
                by_task.setdefault(self.clients[c], []).append(c)
        total: list[torch.Tensor] | None = None
        for name in sorted(by_task):
            clients = by_task[name]
            w = self.tasks[name].loss_weight / len(clients)  # lambda_k / N_k
            for c in clients:
                g = self._step_grads[c]
                if g is None:
                    continue
                total = [w * gi for gi in g] if total is None else [t + w * gi for t, gi in zip(total, g)]
        self._step_grads = {}
        if total is None or self.frozen:
            return
        for p, g in zip(self.body.parameters(), total):
            p.grad = g
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.version += 1

    @torch.no_grad()
    def body_infer(self, client_id: str, x: torch.Tensor) -> torch.Tensor:
        """Evaluation forward: no graph kept, no update."""
        self.task_of(client_id)
        check_features("features", x, self.token_shape, self.max_batch)
        with self._autocast():
            return self.body(x.to(self.device)).float().cpu()

    def _autocast(self):
        """bf16 autocast on CUDA (the CPU stays float32, bit-reproducible)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    # --- unification (FedAvg of client parts per task) ----------------------------------

    def submit_state(self, client_id: str, tensors: Mapping[str, torch.Tensor], samples: int) -> None:
        """A client's shared parts for this unification; validated against the task template."""
        task = self.task_of(client_id)
        tmpl = self._templates[task.name]
        if set(tensors) != set(tmpl):
            missing, extra = sorted(set(tmpl) - set(tensors)), sorted(set(tensors) - set(tmpl))
            raise SplitProtocolError(f"state of {client_id}: missing {missing[:3]}, unexpected {extra[:3]}")
        for k, t in tensors.items():
            if t.shape != tmpl[k].shape or t.dtype != tmpl[k].dtype:
                raise SplitProtocolError(f"state of {client_id}: {k} is {tuple(t.shape)} {t.dtype}, "
                                         f"expected {tuple(tmpl[k].shape)} {tmpl[k].dtype}")
            if not bool(torch.isfinite(t).all()):
                raise SplitProtocolError(f"state of {client_id}: {k} contains NaN or inf")
        if not isinstance(samples, int) or samples < 1:
            raise SplitProtocolError(f"state of {client_id}: samples must be a positive int")
        self._submitted.setdefault(task.name, {})[client_id] = ({k: tensors[k] for k in tmpl}, samples)

    def unify_ready(self, task: str) -> bool:
        """Every live client of ``task`` has submitted (call :meth:`expire` to stop waiting)."""
        got = self._submitted.get(task, {})
        return bool(got) and all(c in got for c in self.live_clients(task))

    def unify(self, task: str) -> dict[str, torch.Tensor]:
        """Average of what live clients of ``task`` submitted (uniform, or by sample count
        with ``part_weighting="samples"``), in client-id order; clears them."""
        got = self._submitted.pop(task, {})
        order = sorted(c for c in got if c in self.clients)
        if not order:
            raise SplitProtocolError(f"no client of task {task!r} submitted its state")
        weights = [got[c][1] if self.part_weighting == "samples" else 1 for c in order]
        avg = fedavg([got[c][0] for c in order], weights)
        self.events.append({"event": "unify", "task": task, "clients": order, "round": self.rounds.round,
                            "weighting": self.part_weighting})
        return avg

    # --- persistence ----------------------------------------------------------------------

    def _ctor_kwargs(self) -> dict[str, Any]:
        """Subclass constructor arguments to persist (JSON values)."""
        return {}

    def _extra_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {}

    def _load_extra_state(self, tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, Any]) -> None:
        pass

    def save(self, directory: str | Path) -> None:
        """Persist body, optimizer, membership, rounds and subclass state (in-flight steps are
        not saved: after a restart clients redo their current step)."""
        tensors = {f"body.{k}": v for k, v in self.body.state_dict().items()}
        opt_t, opt_meta = optimizer_to_state(self.opt, "opt")
        extra_t, extra_s = self._extra_state()
        tensors.update(opt_t)
        tensors.update(extra_t)
        tensors = {k: v.cpu() for k, v in tensors.items()}  # saved bytes do not depend on the device
        scalars = {"kind": self.kind, "cfg": split_dict(self.cfg), "tasks": [t.to_dict() for t in self.tasks.values()],
                   "lr": self.lr, "weight_decay": self.weight_decay, "seed": self.seed,
                   "max_batch": self.max_batch, "part_weighting": self.part_weighting,
                   "ctor": self._ctor_kwargs(), "frozen": self.frozen, "version": self.version,
                   "clients": self.clients, "dropped": self.dropped, "events": self.events,
                   "rounds": self.rounds.to_dict(), "opt": opt_meta, "extra": extra_s}
        save_state(directory, tensors, scalars)

    @classmethod
    def load(cls, directory: str | Path, *, device: torch.device | str = "cpu"):
        """Rebuild a server saved by :meth:`save` on ``device``; raises SplitStateError on any mismatch."""
        tensors, s = load_state(directory)
        if s.get("kind") != cls.kind:
            raise SplitStateError(f"{directory} holds a {s.get('kind')!r} server, not {cls.kind!r}")
        try:
            srv = cls(split_config(s["cfg"]), [TaskSpec.from_dict(t) for t in s["tasks"]],
                      lr=s["lr"], weight_decay=s["weight_decay"], seed=s["seed"], max_batch=s["max_batch"],
                      part_weighting=s.get("part_weighting", "samples"), device=device, **s["ctor"])
            body = {k[5:]: v for k, v in tensors.items() if k.startswith("body.")}
            srv.body.load_state_dict(body, strict=True)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise SplitStateError(f"saved state in {directory} does not fit: {e}") from None
        optimizer_from_state(srv.opt, "opt", tensors, s["opt"])
        if s["frozen"]:
            srv.frozen = True
            srv.body.requires_grad_(False)
        srv.version, srv.clients, srv.dropped = s["version"], dict(s["clients"]), dict(s["dropped"])
        srv.events = list(s["events"])
        srv.rounds.load_dict(s["rounds"])
        srv._load_extra_state(tensors, s["extra"])
        return srv
