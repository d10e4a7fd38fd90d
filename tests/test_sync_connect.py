"""Which end of a new connection pulls (atdnode.replication.sync_connect): the dialling end
pulls at once; the dialled end pulls only when the dialler's request showed something it
lacks, or when no request came in time. Simulated time, in-memory daemons
(netsim.memnet); periodic sync off, so only connection pulls can carry an entry across a
healed cut."""
from __future__ import annotations

from pathlib import Path
from typing import Awaitable, Callable

import pytest
import trio

from atdnode.node import NodeIdentity
from atdnode.replication.sync_connect import ConnectPulls
from netsim.memnet import MemCluster, simulate
from netsim.scenario import NetworkSpec


def _run(root: Path, body: Callable[[MemCluster], Awaitable[dict]]) -> dict:
    """Start n0 and n1 (established ledgers in step, n1 dials n0), wait until both own
    heads are confirmed and the connection pulls are done, then `body(cluster)`; returns
    what it returned."""
    c = MemCluster(root, ["n0", "n1"], seed=3, network=NetworkSpec(latency_ms=5), sync_interval=1e6,
                   poll_interval=0.1, established=True)
    out: dict = {}

    async def main() -> None:
        async with c.running():
            await c.start("n0")
            await c.start("n1", bootstrap=["n0"])
            with trio.fail_after(20):
                while not all(c.daemons[n].head_confirmed for n in ("n0", "n1")) or not c.peers("n0"):
                    await trio.sleep(0.05)
            await trio.sleep(1.0)  # connection pulls (and waits) done
            out.update(await body(c))

    simulate(main, seed=3)
    return out


def _pulls(c: MemCluster, n: str) -> int:
    return c.daemons[n].stats["sync_pulls"]


def _skipped(c: MemCluster, n: str) -> int:
    return c.daemons[n].stats.get("connect_pulls_skipped", 0)


def _other(n: str) -> str:
    return "n1" if n == "n0" else "n0"


def test_ledgers_in_step_pull_once_per_connection_and_the_dialled_end_is_confirmed(tmp_path: Path) -> None:
    """Two established ledgers in step connect (n1 dials n0): one pull in all, the
    dialler's; the dialled end skips its own and its own chain head is confirmed by the
    dialler's request alone. Both ends pulling -- the old rule -- makes two."""

    async def body(c: MemCluster) -> dict:
        return dict(dialler=_pulls(c, "n1"), dialled=_pulls(c, "n0"), skipped=_skipped(c, "n0"),
                    confirmed=c.daemons["n0"].head_confirmed, direction=c.daemons["n1"].transport.dialled(c.peer_ids["n0"]))

    out = _run(tmp_path, body)
    assert out == {"dialler": 1, "dialled": 0, "skipped": 1, "confirmed": True, "direction": True}


async def _cut(c: MemCluster) -> None:
    c.partition([["n0"], ["n1"]])
    await c.daemons["n0"].transport.disconnect(c.peer_ids["n1"])


async def _reconnect(c: MemCluster, dialler: str) -> None:
    """Heal the cut and connect from `dialler` (nobody re-dials a lost peer for
    `redial_after_s`, 30 s: the test's dial is the connection)."""
    c.heal()
    peer = _other(dialler)
    assert c.peer_ids[peer] not in c.peers(dialler)
    await c.daemons[dialler].transport.connect(c.address(peer))
    assert c.daemons[dialler].transport.dialled(c.peer_ids[peer]) is True


@pytest.mark.parametrize("dialler", ["n0", "n1"])
@pytest.mark.parametrize("writer_role", ["dialler", "dialled"])
def test_whoever_lacks_the_entry_gets_it_on_reconnecting(tmp_path: Path, writer_role: str, dialler: str) -> None:
    """One side appended while the link was cut. If the dialler wrote it, the dialled end
    learns from the dialler's request that it lacks something and pulls (one that always
    skipped would never get it: periodic sync is off); if the dialled end wrote it, the
    dialler's own pull fetches it and the dialled end, lacking nothing, skips its pull.
    Either peer-id order."""
    dialled = _other(dialler)
    writer = dialler if writer_role == "dialler" else dialled

    async def body(c: MemCluster) -> dict:
        await _cut(c)
        seq = await c.append(writer, "metrics", {"k": 1})  # gossiped into the cut: reaches no one
        await trio.sleep(10.0)  # past any gossip history window
        reader, pid = _other(writer), c.peer_ids[writer]
        assert (await c.heads(reader)).get(pid, 0) < seq
        before = {n: (_pulls(c, n), _skipped(c, n)) for n in ("n0", "n1")}
        await _reconnect(c, dialler)
        with trio.fail_after(30):
            while (await c.heads(reader)).get(pid, 0) < seq:
                await trio.sleep(0.05)
        await trio.sleep(1.0)
        return {"dialled_pulled": _pulls(c, dialled) > before[dialled][0],
                "dialled_skipped": _skipped(c, dialled) > before[dialled][1],
                "dialler_pulled": _pulls(c, dialler) > before[dialler][0]}

    out = _run(tmp_path, body)
    if writer_role == "dialler":
        assert out == {"dialled_pulled": True, "dialled_skipped": False, "dialler_pulled": True}
    else:
        assert out == {"dialled_pulled": False, "dialled_skipped": True, "dialler_pulled": True}


def test_the_dialled_end_pulls_when_the_dialler_never_does(tmp_path: Path) -> None:
    """A dialler that does not pull on connecting (an older daemon, one in a back-off, a
    split client): the dialled end hears no request and pulls after its wait, so it still
    gets the dialler's entry."""

    async def body(c: MemCluster) -> dict:
        c.daemons["n1"].replica.on_connected = lambda _peer, _start_soon: None  # what the daemon calls
        await _cut(c)
        seq = await c.append("n1", "metrics", {"k": 1})
        await trio.sleep(10.0)
        before = _pulls(c, "n0")
        t0 = trio.current_time()
        await _reconnect(c, "n1")
        with trio.fail_after(30):
            while (await c.heads("n0")).get(c.peer_ids["n1"], 0) < seq:
                await trio.sleep(0.05)
        return {"waited": trio.current_time() - t0 >= c.daemons["n0"].replica.connect_pulls.wait_s,
                "dialled_pulled": _pulls(c, "n0") > before, "dialler_pulled": _pulls(c, "n1") > 2}

    out = _run(tmp_path, body)
    assert out == {"waited": True, "dialled_pulled": True, "dialler_pulled": False}


@pytest.mark.parametrize("dialler", ["n0", "n1"])
def test_a_revoked_member_learns_it_whichever_end_dials(tmp_path: Path, dialler: str) -> None:
    """n0 holds the revocation of n1 but still admits it (the moment before it applies it:
    its membership refresh is held back here), n1 does not know. Only connection pulls can
    tell n1 (periodic sync off, the cut ate the gossip): when n1 dials, its own pull at
    once; when n0 dials, n1 is the dialled end and n0's request shows an entry n1 lacks, so
    n1 pulls at once too instead of skipping or waiting."""

    async def body(c: MemCluster) -> dict:
        d0, d1 = c.daemons["n0"], c.daemons["n1"]

        async def not_yet() -> None:
            await trio.lowlevel.checkpoint()

        d0.replica.refresh_members = not_yet  # n0 keeps admitting n1 (and dialling it) for now
        await _cut(c)
        pk1 = NodeIdentity.load(c.c.homes["n1"]).public_key
        await d0.ledger.run(lambda led: led.revoke(d0.identity.signer, pk1))
        await trio.sleep(10.0)
        assert not d1.dialer.policy.revoked
        t0 = trio.current_time()
        await _reconnect(c, dialler)
        with trio.fail_after(30):
            while not d1.dialer.policy.revoked:
                await trio.sleep(0.01)
        return {"learned_within_s": trio.current_time() - t0}

    out = _run(tmp_path, body)
    assert out["learned_within_s"] < ConnectPulls().wait_s / 2  # no wait for a request that shows it


def test_only_a_request_after_the_connection_counts() -> None:
    """An observation made before the dialled end started waiting (an earlier connection's)
    is no evidence about this one: the waiter times out and says pull; an observation that
    the dialler is ahead ends the wait at once with "pull"."""
    cp = ConnectPulls(wait_s=1.0)
    out: list[tuple[bool, float]] = []

    async def main() -> None:
        cp.observed("a", False)  # before anyone waits: forgotten
        t0 = trio.current_time()
        out.append((await cp.peer_has_nothing_new("a", cp.expect("a")), trio.current_time() - t0))
        async with trio.open_nursery() as nursery:
            async def later(ahead: bool) -> None:
                await trio.sleep(0.2)
                cp.observed("a", ahead)

            for ahead in (False, True):
                nursery.start_soon(later, ahead)
                t0 = trio.current_time()
                out.append((await cp.peer_has_nothing_new("a", cp.expect("a")), trio.current_time() - t0))
        assert not cp._waiting  # nothing left behind

    simulate(main, seed=1)
    assert [(skip, round(t, 3)) for skip, t in out] == [(False, 1.0), (True, 0.2), (False, 0.2)]
    assert ConnectPulls.waits(False, True) and not ConnectPulls.waits(True, True)
    assert not ConnectPulls.waits(None, True) and not ConnectPulls.waits(False, False)  # unknown / not a member: pull
