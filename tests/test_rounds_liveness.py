"""Who a round waits for when the daemon keeps a bounded peer set.

`RoundRunner._live` is exercised on a scripted fabric (connected peers, peer target, a
clock the test moves): with every member reachable (below the target) a member that is
not connected is given up after the grace; at the target, a member outside the peer set
that took part in the previous round is still waited for, one that did not is not.
"""
from __future__ import annotations

from types import SimpleNamespace

import trio

from atdnode.rounds import Fabric, RoundRunner

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
