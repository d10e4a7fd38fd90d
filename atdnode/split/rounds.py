"""Round coordination for a split server: who takes part in which round, deadlines, barriers.

All of it runs on the trio thread (plain dicts and sets, no locks); the protocol server
object itself is only touched through `SplitService._call` (one worker thread at a time).

A *campaign* is rounds 1..total. Round r opens with the clients that are ready then
(joined; p-FESTA / MSD: upload complete) and whose requested last round is >= r; they owe
`steps_per_round` steps (and, every `unifying_rounds`, their shared parts) before the
round's deadline. Whoever has not delivered by then is dropped; the others go on.
Clients that join while round r is open take part from round r+1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import trio


@dataclass
class Member:
    """What the server remembers of a client across sessions and restarts (JSON-able)."""

    task: str
    num_samples: int
    last_round: int
    rounds_done: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "num_samples": self.num_samples, "last_round": self.last_round,
                "rounds_done": list(self.rounds_done)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Member:
        return cls(task=str(d["task"]), num_samples=int(d["num_samples"]), last_round=int(d["last_round"]),
                   rounds_done=[int(r) for r in d.get("rounds_done", [])])


class Board:
    """Shared round state plus a broadcast "something changed" signal."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.round = 0            # the open round (0: campaign not started)
        self.completed = 0        # last round fully completed (and saved)
        self.started = False
        self.done = False
        self.members: dict[str, Member] = {}
        self.round_members: set[str] = set()   # taking part in the open round
        self.finished: dict[str, int] = {}      # client -> last round whose steps it finished
        self.submitted: dict[str, int] = {}     # client -> round of its last state upload
        self.downloads: dict[str, tuple[int, dict]] = {}  # client -> (round, averaged parts)
        self.ready: set[str] = set()            # connected and (if needed) fully uploaded
        self._changed = trio.Event()

    def notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, cond: Callable[[], bool], deadline: float = math.inf) -> bool:
        """Wait until ``cond()`` holds (True) or trio's clock passes ``deadline`` (False)."""
        while not cond():
            ev = self._changed
            with trio.move_on_at(deadline):
                await ev.wait()
            if trio.current_time() >= deadline and not cond():
                return False
        return True

    def next_round_for(self, client: str) -> int:
        """The first round a (re-)joining client takes part in."""
        if self.round >= 1 and not self.done and client in self.round_members \
                and self.finished.get(client, 0) < self.round:
            return self.round
        return max(self.round, self.completed) + 1

    def pending(self) -> set[str]:
        """Members of the open round that have not finished its steps."""
        return {c for c in self.round_members if self.finished.get(c, 0) < self.round}

    def to_dict(self) -> dict[str, Any]:
        return {"completed": self.completed, "started": self.started, "done": self.done,
                "members": {c: m.to_dict() for c, m in self.members.items()}}

    def load_dict(self, d: dict[str, Any]) -> None:
        self.completed = int(d["completed"])
        self.round = self.completed
        self.started, self.done = bool(d["started"]), bool(d["done"])
        self.members = {str(c): Member.from_dict(m) for c, m in d["members"].items()}
