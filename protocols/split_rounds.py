"""The split-learning round loop, one for FESTA and p-FESTA (no networking here).

:class:`RoundPlan` is the schedule every driver follows — the in-process one below and the
network campaign (`atdnode.split.campaign`, whose coordinator opens, freezes and unifies
rounds by the same plan, and whose clients read it from the offer):

- rounds 1..``rounds`` train the body; rounds ``rounds``+1..``total`` (FESTA phase 2,
  ``phase2_rounds``) freeze it first;
- in each round every live client takes ``steps_per_round`` steps, clients taking turns
  step by step (the body's step barrier, `protocols.split_server`);
- after round r with r % ``unifying_rounds`` == 0, the clients of each task upload their
  shared parts and receive the task's average (:func:`unify_clients`).

:func:`run_rounds` is the in-process loop over a :data:`Step` — one client's training step
as messages through an `InProcessChannel` (`protocols.festa.festa_step`,
`protocols.pfesta.pfesta_step`) — with the logical clock that drops a vanished client at
its round's deadline; :func:`evaluate_clients` runs the final held-out evaluation through
the body.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from protocols.comm_cost import ByteCounter, CostParams, InProcessChannel
from protocols.split_state import SplitProtocolError


@dataclass(frozen=True)
class RoundPlan:
    """The round schedule (module doc)."""

    rounds: int
    steps_per_round: int
    unifying_rounds: int
    phase2_rounds: int = 0

    def __post_init__(self) -> None:
        if min(self.rounds, self.phase2_rounds) < 0 or self.steps_per_round < 1 or self.unifying_rounds < 1:
            raise ValueError(f"round plan {self}: rounds >= 0, phase2_rounds >= 0, steps_per_round >= 1 "
                             "and unifying_rounds >= 1")

    @classmethod
    def from_offer(cls, offer: Mapping[str, Any]) -> "RoundPlan":
        """The plan a server's offer announces (`atdnode.split.settings.SplitSettings.offer`);
        SplitProtocolError if it names none."""
        try:
            return cls(int(offer["rounds"]), int(offer["steps_per_round"]), int(offer["unifying_rounds"]),
                       int(offer.get("phase2_rounds") or 0))
        except (KeyError, TypeError, ValueError) as e:
            raise SplitProtocolError(f"offer: no usable round plan ({e})") from None

    @property
    def total(self) -> int:
        return self.rounds + self.phase2_rounds

    def freezes_at(self, r: int) -> bool:
        """Whether the body is frozen before round ``r`` (the first round of phase 2)."""
        return self.phase2_rounds > 0 and r == self.rounds + 1

    def unifies(self, r: int) -> bool:
        """Whether shared parts are averaged after round ``r``."""
        return r % self.unifying_rounds == 0

    def unifies_after(self, r: int, step: int) -> bool:
        """Whether step ``step`` (0-based) is the last of a unifying round."""
        return step == self.steps_per_round - 1 and self.unifies(r)


# step(client, round, step, vanish) -> the step's loss; with vanish=True the client stops
# answering part-way through the step (what it sent is counted) and the step returns None
Step = Callable[[str, int, int, bool], "float | None"]
# exchange(kind, tensors, meta) -> the reply's tensor (or None): how a client's half of a step
# (`FestaClient.train_step`, `PFestaClient.train_step`) reaches the server, in-process or over
# a split stream (`atdnode.split.roles`)
Exchange = Callable[[str, "dict[str, torch.Tensor]", "dict[str, Any]"], "torch.Tensor | None"]


@dataclass
class SplitRunResult:
    """What an in-process run returns: per-round mean loss and final metric per client,
    the byte counter, the paper's parameters per client, and the clients dropped."""

    losses: dict[str, list[float]] = field(default_factory=dict)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    counter: ByteCounter = field(default_factory=ByteCounter)
    params: dict[str, CostParams] = field(default_factory=dict)
    dropped: dict[str, dict[str, Any]] = field(default_factory=dict)
    train_kinds: tuple[str, ...] = ()


def run_rounds(server: Any, by_id: Mapping[str, Any], plan: RoundPlan, ch: InProcessChannel, step: Step, *,
               vanish: Mapping[str, tuple[int, int]] | None = None) -> dict[str, list[float]]:
    """Rounds 1..plan.total of joined clients ``by_id`` on ``server`` (a `BodyServer`); returns
    each client's per-round mean loss. ``vanish={client: (round, step)}`` makes that client stop
    answering there: the others wait at the step barrier until the round's deadline (a logical
    clock: round r's deadline is r) drops it, and go on."""
    losses: dict[str, list[float]] = {cid: [] for cid in by_id}
    vanish, gone = dict(vanish or {}), set()
    for r in range(1, plan.total + 1):
        if plan.freezes_at(r):
            server.freeze_body()
        server.begin_round(r, deadline=float(r))
        round_loss: dict[str, list[float]] = {c: [] for c in server.live_clients()}
        for s in range(plan.steps_per_round):
            for cid in server.live_clients():
                if cid in gone:
                    continue
                loss = step(cid, r, s, vanish.get(cid) == (r, s))
                if loss is None:  # gone: no gradient will come back
                    gone.add(cid)
                    server.drop_client(cid, f"missed the round {r} deadline")
                    continue
                round_loss[cid].append(loss)
        for cid in server.live_clients():
            server.finish_round(cid)
        server.expire(now=float(r) + 0.5)  # the deadline passed: drop whoever did not finish
        for cid in server.live_clients():
            losses[cid].append(sum(round_loss[cid]) / max(1, len(round_loss[cid])))
        if plan.unifies(r):
            unify_clients(server, by_id, ch)
    return losses


def unify_clients(server: Any, by_id: Mapping[str, Any], ch: InProcessChannel) -> None:
    """Upload every live client's shared parts, average per task, download the average."""
    for cid in server.live_clients():
        m = ch.send(cid, "up", "state_up", by_id[cid].part_state(), {"samples": by_id[cid].num_samples})
        server.submit_state(cid, m.tensors, m.meta["samples"])
    for task in sorted({server.clients[c] for c in server.live_clients()}):
        if not server.unify_ready(task):
            raise SplitProtocolError(f"task {task!r}: not every live client submitted")
        avg = server.unify(task)
        for cid in server.live_clients(task):
            by_id[cid].load_part_state(ch.send(cid, "down", "state_down", avg).tensors)


def evaluate_clients(server: Any, by_id: Mapping[str, Any], ch: InProcessChannel,
                     test_data: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None) -> dict[str, dict[str, float]]:
    """Each live client's task metric on its held-out data, features carried through the body
    as ``eval_forward`` / ``eval_out`` messages."""
    out = {}
    for cid in server.live_clients():
        if not test_data or cid not in test_data:
            continue

        def infer(x: torch.Tensor, cid: str = cid) -> torch.Tensor:
            m = ch.send(cid, "up", "eval_forward", {"x": x})
            return ch.send(cid, "down", "eval_out", {"y": server.infer(cid, m.tensors["x"])}).tensors["y"]

        out[cid] = by_id[cid].evaluate(*test_data[cid], infer)
    return out
