"""Hostile members of an `atd rounds` campaign on netsim's in-memory back-end.

Each is a `RoundRunner` (the loop behind `atd rounds`) with one step replaced, so it signs
and gossips like any member and every honest member's checks apply to what it sends
(`netsim.fat.run_rounds_memnet(hostile=...)` runs them beside honest nodes):

    ScaledRunner     publishes the round's reference x `scale` (default -1000) as its
                     input instead of training: a verifiable input that FedAvg averages in
                     (the documented limit that robust aggregators close)
    HurryingRunner   trains and publishes honestly, then records the round's aggregate as
                     soon as it holds inputs from a majority of the members, naming the
                     others as missing (a fast member trying to leave a slow one out)
"""
from __future__ import annotations

from dataclasses import replace

from atdnode.models import ModelRecord, load_weights, save_weights
from atdnode.rounds import POLL_S, active_members, round_weights_entries
from atdnode.rounds import RoundRunner
from ledger import Entry

SCALE = -1000.0


class ScaledRunner(RoundRunner):
    """Sends the round's reference x `scale` as its input (trains nothing)."""

    scale = SCALE

    def train_round(self, rnd: int, start: str) -> ModelRecord:
        tensors, meta = load_weights(self.store, start)
        blob = save_weights(self.store, {k: v * self.scale if v.is_floating_point() else v
                                         for k, v in tensors.items()}, meta)
        base = self._base()
        return replace(base, blobs={"full": blob}, provenance={**base.provenance, "start": start})


class HurryingRunner(RoundRunner):
    """Records each round's aggregate over the inputs it holds once they come from a majority."""

    async def wait_inputs(self, rnd: int, expected: list[str], start: str) -> list[Entry]:
        until = self.fabric.now() + self.c.deadline
        while True:
            with self._led() as led:
                entries = round_weights_entries(led, self.campaign, rnd, start)
                members = len(active_members(led))
            held = [e for e in entries if self.store.has(str(e.body.get("blob")))]
            if 2 * len(held) > members or self.fabric.now() >= until:
                return held
            for e in entries:
                if e not in held:
                    await self._await_blob(str(e.body.get("blob")), min(until, self.fabric.now() + 5))
            await self.fabric.sleep(POLL_S)

    async def settle(self, rnd: int, held: list[Entry], expected: list[str], start: str) -> Entry:
        entry = self.record(rnd, held, expected, start)
        await self.adopt(entry)
        return entry
