"""Who a round waits for: members when the daemon keeps a bounded peer set, and the coordinator.

`RoundRunner._live` is exercised on a scripted fabric (connected peers, peer target, a
clock the test moves): with every member reachable (below the target) a member that is
not connected is given up after the grace; at the target, a member outside the peer set
that took part in the previous round is still waited for, one that did not is not.

A whole round runs on three in-process homes whose inputs are all held, on a fabric whose
clock `sleep` moves: the coordinator never records, and a member waits for its aggregate
until the deadline while it stays connected, for the grace only once it has gone away (it
crashed before its aggregate left it), then records the aggregate itself. A connected
member that signed an input of a later round (it resumed past this one) is not waited for.
"""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import trio

from atdnode.models import load_weights, save_weights
from atdnode.rounds import Fabric, RoundRunner, RoundsConfig
from ledger import Ledger
from tests.vgs_homes import cfg, consortium, peer_ids, sync

MEMBERS = [f"m{i:02d}" for i in range(12)]
ME = MEMBERS[0]
GRACE = 20.0


class ScriptedFabric(Fabric):
    def __init__(self, peers: list[str], target: int) -> None:
        self.connected, self.target, self.t = peers, target, 0.0

    def now(self) -> float:
        return self.t

    async def peers(self) -> list[str] | None:
        return list(self.connected)

    def peer_target(self) -> int | None:
        return self.target


def live_after_grace(peers: list[str], target: int, recent: set[str]) -> set[str]:
    fabric = ScriptedFabric(peers, target)
    runner = SimpleNamespace(fabric=fabric, me=ME, c=SimpleNamespace(absent_grace=GRACE))
    gone: dict[str, float] = {}

    async def main() -> set[str]:
        await RoundRunner._live(runner, MEMBERS, gone, recent)  # first look starts the grace
        fabric.t = GRACE + 1
        return set(await RoundRunner._live(runner, MEMBERS, gone, recent))

    return trio.run(main)


def test_below_the_peer_target_an_unconnected_member_is_given_up_after_the_grace() -> None:
    connected = MEMBERS[1:6]  # 5 connections, target 8: every reachable member would be connected
    live = live_after_grace(connected, target=8, recent=set(MEMBERS))
    assert live == {ME, *connected}


def test_at_the_peer_target_previous_participants_outside_the_set_are_still_waited_for() -> None:
    connected = MEMBERS[1:9]  # 8 connections = target: the others may simply be outside the set
    outside_recent, outside_new = MEMBERS[9:11], MEMBERS[11:]
    live = live_after_grace(connected, target=8, recent={ME, *connected, *outside_recent})
    assert live == {ME, *connected, *outside_recent}
    assert not live & set(outside_new)  # did not take part last round: not waited for after the grace


def test_without_a_daemon_every_member_is_waited_for() -> None:
    runner = SimpleNamespace(fabric=Fabric(), me=ME, c=SimpleNamespace(absent_grace=GRACE))
    assert trio.run(RoundRunner._live, runner, MEMBERS, {}, set()) == MEMBERS


class ClockFabric(ScriptedFabric):
    """A scripted fabric whose `sleep` moves its clock (a wait costs no wall time)."""

    async def sleep(self, seconds: float) -> None:
        self.t += seconds
        await trio.lowlevel.checkpoint()


def publish_untrained(r: RoundRunner, scale: float, rnd: int = 0) -> None:
    """Round `rnd`'s input of `r`: the shared initial model x `scale` (no training)."""
    tensors, meta = load_weights(r.store, r.init)
    blob = save_weights(r.store, {k: v * scale if v.is_floating_point() else v for k, v in tensors.items()}, meta)
    base = r._base()
    r.publish(rnd, replace(base, blobs={"full": blob}, provenance={**base.provenance, "start": r.init}))


@pytest.mark.parametrize("coordinator_stays", [True, False])
def test_a_coordinator_that_went_away_is_passed_over_after_the_grace(tmp_path, coordinator_stays: bool) -> None:
    homes = consortium(tmp_path, ["a", "b", "c"])
    order = sorted(range(3), key=lambda i: peer_ids(homes)[i])  # order[0]: the coordinator
    coordinator, me, third = (peer_ids(homes)[i] for i in order)
    deadline = 40.0
    fabric = ClockFabric([third, *([coordinator] if coordinator_stays else [])], target=8)  # what `me` sees
    runners = []
    for i, k in enumerate(order):
        conf = RoundsConfig(data=f"digits?shard={k + 1}/3&limit=90", cfg=cfg(), rounds=1, weighting="fedavg",
                            deadline=deadline, absent_grace=GRACE)
        runners.append(RoundRunner(homes[k], conf, fabric=fabric if i == 1 else None))
        publish_untrained(runners[-1], 1.0 + i / 10)
    sync(homes)  # every input reached every member; the coordinator records nothing
    rep = trio.run(runners[1].run_round, 0)
    waited = fabric.now()
    assert len(rep.inputs) == 3 and rep.coordinator and not rep.missing  # recorded by `me`, over every input
    if coordinator_stays:
        assert waited >= deadline
    else:
        assert GRACE <= waited < GRACE + 5


@pytest.mark.parametrize("later_input_by", ["silent", "other", "misfit", None])
def test_a_member_that_moved_past_the_round_is_not_waited_for(tmp_path, later_input_by: str | None) -> None:
    """Every member stays connected; `silent` publishes no round-0 input. With its own round-1
    input held (it resumed past round 0) the round ends at once; with none, with a round-1
    input signed by another member, or with a `weights` entry of its own whose body does not
    fit the spec (round "1"), `silent` is waited for until the deadline."""
    homes = consortium(tmp_path, ["a", "b", "c"])
    ids = peer_ids(homes)
    order = sorted(range(3), key=lambda i: ids[i])
    me, other, silent = order[0], order[1], order[2]  # `me`, the smaller publisher, coordinates
    deadline = 40.0
    fabric = ClockFabric([ids[other], ids[silent]], target=8)  # what `me` sees
    runners = {}
    for k in order:
        conf = RoundsConfig(data=f"digits?shard={k + 1}/3&limit=90", cfg=cfg(), rounds=2, weighting="fedavg",
                            deadline=deadline, absent_grace=GRACE)
        runners[k] = RoundRunner(homes[k], conf, fabric=fabric if k == me else None)
    publish_untrained(runners[me], 1.0)
    publish_untrained(runners[other], 1.1)
    if later_input_by == "misfit":
        with Ledger.open(homes[silent].ledger_db) as led:
            led.append(runners[silent].ident.signer, "weights", {"campaign": runners[silent].campaign, "round": "1"})
    elif later_input_by is not None:
        publish_untrained(runners[silent if later_input_by == "silent" else other], 1.2, rnd=1)
    sync(homes)
    rep = trio.run(runners[me].run_round, 0)
    assert rep.coordinator and len(rep.inputs) == 2 and rep.missing == [ids[silent]]
    if later_input_by == "silent":
        assert fabric.now() < 5
    else:
        assert fabric.now() >= deadline
