"""The server side shared by FESTA and p-FESTA: a timm transformer body that clients reach
with explicit message-in / message-out calls. No networking: a driver (in-process or a
libp2p stream handler) decodes a client's frame, calls one method, encodes the result.

Contract of one training step for client ``c``::

    out = server.body_forward(c, x)          # keeps (x, version) pending for c
    grad_in = server.body_backward(c, g)     # g = dLoss/d out; updates the body

Clients may interleave (a forward of B between A's forward and backward). If the body
was updated since a client's forward, its forward is recomputed from the stored input
before back-propagating (no in-place-modification errors; the gradient is then taken at
the current weights, the usual staleness of asynchronous split learning).

Body update (``body_update``): "per-message" (one AdamW step per client backward, the
gradient scaled by the task's loss weight) or "algorithm1" (FESTA Algorithm 1 l.12, p-FESTA
l.14: gradients are collected until every live training client sent one, then one step on
sum_k lambda_k (1/N_k) sum_c g_c -- see :meth:`BodyServer.step_body`). Heads / tails are
unified uniformly (the papers' 1/N_k) unless ``unify_weighting="samples"``.
Per-task loss weights scale the body's parameter gradients of that task's clients;
the gradient returned to the client is the unweighted dLoss/d input, so the client's own
parts see their own loss. A client that vanishes mid-round is dropped by
:meth:`drop_client` (or :meth:`expire` at the round deadline): its pending step and
unification upload are discarded, the event is recorded, the rest continue.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from protocols.split_parts import SplitBody, TaskSpec, ViTSplitConfig, fedavg, part_template
from protocols.split_state import (ClientDropped, RoundTracker, SplitProtocolError, SplitStateError,
                                   check_features, load_state, optimizer_from_state, optimizer_to_state,
                                   save_state)

UNIFY_WEIGHTINGS = ("uniform", "samples")
BODY_UPDATES = ("per-message", "algorithm1")


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

    def __init__(self, cfg: ViTSplitConfig, tasks: Sequence[TaskSpec], *, lr: float = 1e-3,
                 weight_decay: float = 0.05, seed: int = 0, max_batch: int = 1024,
                 unify_weighting: str = "uniform", body_update: str = "per-message") -> None:
        if self.has_cls != (self.tail_pool == "token"):
            raise ValueError("a cls token goes with token pooling, and only with it")
        if not tasks or len({t.name for t in tasks}) != len(tasks):
            raise ValueError("a split server needs at least one task, with unique names")
        self.cfg, self.tasks = cfg, {t.name: t for t in tasks}
        self.lr, self.weight_decay, self.seed, self.max_batch = lr, weight_decay, seed, max_batch
        if unify_weighting not in UNIFY_WEIGHTINGS:
            raise ValueError(f"unify_weighting {unify_weighting!r}: choose from {', '.join(UNIFY_WEIGHTINGS)}")
        self.unify_weighting = unify_weighting
        if body_update not in BODY_UPDATES:
            raise ValueError(f"body_update {body_update!r}: choose from {', '.join(BODY_UPDATES)}")
        self.body_update = body_update
        self._grad_acc: dict[str, tuple[list[torch.Tensor], int]] = {}  # algorithm1: client -> (sum, count)
        self.body = SplitBody(cfg, seed=seed)
        self.opt = torch.optim.AdamW(self.body.parameters(), lr=lr, weight_decay=weight_decay)
        self.frozen = False
        self.version = 0  # optimizer steps taken; a pending forward older than this is recomputed
        self.clients: dict[str, str] = {}  # client id -> task name
        self.dropped: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.rounds = RoundTracker()
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
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
        self.rounds.done(client_id)
        self._grad_acc.pop(client_id, None)
        self._maybe_step()  # the others may have been waiting for it
        self.dropped[client_id] = {"round": self.rounds.round, "reason": reason, "task": task}
        self.events.append({"event": "drop", "client": client_id, "round": self.rounds.round, "reason": reason})

    def begin_round(self, round_idx: int, deadline: float, clients: Iterable[str] | None = None) -> None:
        """Start round bookkeeping: every live client (or ``clients``) owes a finish by ``deadline``."""
        self.rounds.begin(round_idx, self.live_clients() if clients is None else clients, deadline)

    def finish_round(self, client_id: str) -> None:
        self.task_of(client_id)
        self.rounds.done(client_id)

    def expire(self, now: float) -> list[str]:
        """Drop every client that has not finished the round by its deadline; returns them."""
        late = self.rounds.overdue(now)
        for c in late:
            self.drop_client(c, f"missed the round {self.rounds.round} deadline")
        return late

    # --- the body ---------------------------------------------------------------------

    def freeze_body(self) -> None:
        """Phase 2: the body stops learning; clients keep training their parts through it."""
        self.frozen = True
        self.body.requires_grad_(False)
        self.events.append({"event": "freeze", "round": self.rounds.round})

    def body_forward(self, client_id: str, x: torch.Tensor, *, need_input_grad: bool = True) -> torch.Tensor:
        """Run the body on a client's tokens (validated) and keep the step pending."""
        self.task_of(client_id)
        if client_id in self._pending:
            raise SplitProtocolError(f"client {client_id} sent a forward while its previous step is pending")
        check_features("features", x, self.token_shape, self.max_batch)
        x = x.detach().requires_grad_(need_input_grad)
        with torch.enable_grad():
            out = self.body(x)  # (B, T, D)
        self._pending[client_id] = (x, out, self.version)
        return out.detach()

    def body_backward(self, client_id: str, grad_out: torch.Tensor) -> torch.Tensor | None:
        """Back-propagate ``grad_out`` (dLoss/d body output), update the body (weighted by the
        task's loss weight, unless frozen); return dLoss/d input (None if not requested)."""
        task = self.task_of(client_id)
        if client_id not in self._pending:
            raise SplitProtocolError(f"client {client_id} sent a gradient without a pending forward")
        x, out, version = self._pending[client_id]
        check_features("gradient", grad_out, tuple(out.shape[1:]), self.max_batch)
        if grad_out.shape[0] != out.shape[0]:
            raise SplitProtocolError(f"gradient: batch {grad_out.shape[0]}, forward had {out.shape[0]}")
        del self._pending[client_id]
        params = [] if self.frozen or task.loss_weight == 0 else [p for p in self.body.parameters()]
        inputs = ([x] if x.requires_grad else []) + params
        if not inputs:
            return None
        with torch.enable_grad():
            if version != self.version:
                out = self.body(x)  # body changed since this forward: recompute at current weights
            grads = torch.autograd.grad(out, inputs, grad_out)
        grad_in = grads[0].detach() if x.requires_grad else None
        if params and self.body_update == "algorithm1":
            self._accumulate(client_id, grads[len(inputs) - len(params):])
            self._maybe_step()
        elif params:
            for p, g in zip(params, grads[len(inputs) - len(params):]):
                p.grad = g * task.loss_weight
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.version += 1
        return grad_in

    def _accumulate(self, client_id: str, grads: Sequence[torch.Tensor]) -> None:
        acc = self._grad_acc.get(client_id)
        if acc is None:
            self._grad_acc[client_id] = ([g.detach().clone() for g in grads], 1)
            return
        for a, g in zip(acc[0], grads):
            a.add_(g)
        self._grad_acc[client_id] = (acc[0], acc[1] + 1)

    def _maybe_step(self) -> None:
        """Step once every live training client has sent at least one gradient since the last step."""
        waiting = [c for c, t in self.clients.items() if self.tasks[t].loss_weight != 0 and c not in self._grad_acc]
        if self._grad_acc and not waiting and not self.frozen:
            self.step_body()

    def step_body(self) -> None:
        """FESTA Algorithm 1 l.12 / p-FESTA Algorithm 1 l.14: one AdamW step on
        sum_k lambda_k * (1/N_k) * sum_{c in task k} g_c (each client's g_c the mean of the
        gradients it sent since the last step), so every task counts by its loss weight,
        not by its number of clients or messages. Sums run in sorted task / client order."""
        by_task: dict[str, list[str]] = {}
        for c in sorted(self._grad_acc):
            if c in self.clients:
                by_task.setdefault(self.clients[c], []).append(c)
        params = list(self.body.parameters())
        total = [torch.zeros_like(p) for p in params]
        for task in sorted(by_task):
            lam, cs = self.tasks[task].loss_weight, by_task[task]
            for c in cs:
                sums, n = self._grad_acc[c]
                for t, g in zip(total, sums):
                    t.add_(g, alpha=lam / (len(cs) * n))
        self._grad_acc.clear()
        if not by_task:
            return
        for p, t in zip(params, total):
            p.grad = t
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.version += 1

    @torch.no_grad()
    def body_infer(self, client_id: str, x: torch.Tensor) -> torch.Tensor:
        """Evaluation forward: no graph kept, no update."""
        self.task_of(client_id)
        check_features("features", x, self.token_shape, self.max_batch)
        return self.body(x)

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
        """Average of what live clients of ``task`` submitted (clears them): uniform, as FESTA
        Algorithm 1 (l.14-15) and p-FESTA Algorithm 1 average the heads / tails (1/N_k each),
        or by sample count with ``unify_weighting="samples"`` (a deviation, kept as an option)."""
        got = self._submitted.pop(task, {})
        got = {c: v for c, v in got.items() if c in self.clients}
        if not got:
            raise SplitProtocolError(f"no client of task {task!r} submitted its state")
        weights = [1.0 if self.unify_weighting == "uniform" else float(n) for _, n in got.values()]
        avg = fedavg([s for s, _ in got.values()], weights)
        self.events.append({"event": "unify", "task": task, "clients": sorted(got), "round": self.rounds.round,
                            "weighting": self.unify_weighting})
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
        scalars = {"kind": self.kind, "cfg": self.cfg.to_dict(), "tasks": [t.to_dict() for t in self.tasks.values()],
                   "lr": self.lr, "weight_decay": self.weight_decay, "seed": self.seed,
                   "max_batch": self.max_batch, "unify_weighting": self.unify_weighting,
                   "body_update": self.body_update, "ctor": self._ctor_kwargs(), "frozen": self.frozen, "version": self.version,
                   "clients": self.clients, "dropped": self.dropped, "events": self.events,
                   "rounds": self.rounds.to_dict(), "opt": opt_meta, "extra": extra_s}
        save_state(directory, tensors, scalars)

    @classmethod
    def load(cls, directory: str | Path):
        """Rebuild a server saved by :meth:`save`; raises SplitStateError on any mismatch."""
        tensors, s = load_state(directory)
        if s.get("kind") != cls.kind:
            raise SplitStateError(f"{directory} holds a {s.get('kind')!r} server, not {cls.kind!r}")
        try:
            srv = cls(ViTSplitConfig.from_dict(s["cfg"]), [TaskSpec.from_dict(t) for t in s["tasks"]],
                      lr=s["lr"], weight_decay=s["weight_decay"], seed=s["seed"], max_batch=s["max_batch"],
                      unify_weighting=s.get("unify_weighting", "samples"),
                      body_update=s.get("body_update", "per-message"), **s["ctor"])
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
