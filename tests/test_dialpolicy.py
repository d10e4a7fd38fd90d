"""`atdnode.peers.dialpolicy`: back-offs, newest-hello-first addresses, unreachable members."""
from __future__ import annotations

import pytest

from atdnode.peers import MAX_ADDRS_PER_MEMBER
from atdnode.peers.dialpolicy import DialPolicy, addresses_newest_first
from atdnode.retry import Backoff
from atdnode.errors import ConfigError
from atdnode.peers import PeerSetConfig


def test_backoff_doubles_to_its_cap_and_clears() -> None:
    b = Backoff(1.0, 8.0)
    delays = [b.fail("p", 100.0) for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert b.blocked("p", 107.9) and not b.blocked("p", 108.0) and not b.blocked("q", 100.0)
    b.clear("p")
    assert b.fail("p", 200.0) == 1.0  # a fresh episode starts at the base again
    assert b.fail("q", 0.0, cap=0.5) == 0.5  # a per-failure cap


def test_addresses_newest_hello_first_without_duplicates() -> None:
    hellos = [("A", ["/old/1", "/both"]), ("B", ["/b"]), ("A", ["/new/1", "/both"])]  # log order
    got = addresses_newest_first(hellos)
    assert got == {"A": ("/new/1", "/both", "/old/1"), "B": ("/b",)}
    assert addresses_newest_first(list(hellos))["A"] is got["A"]  # one shared tuple per address list
    many = [("A", [f"/a/{i}"]) for i in range(3 * MAX_ADDRS_PER_MEMBER)]
    got = addresses_newest_first(many)["A"]
    assert len(got) == MAX_ADDRS_PER_MEMBER and got[0] == f"/a/{3 * MAX_ADDRS_PER_MEMBER - 1}"


def test_refusals_back_off_and_a_membership_change_lifts_them() -> None:
    p = DialPolicy(refusal_base=1.0, refusal_cap=30.0, refusal_cap_joining=5.0)
    assert [p.refused_by("m", 0.0) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert not p.may_contact("m", 29.0) and p.may_contact("other", 0.0)
    p.membership_changed()
    assert p.may_contact("m", 0.0)
    assert max(p.refused_by("j", 0.0, joining=True) for _ in range(10)) == 5.0  # a joiner retries soon


def test_a_revoked_node_contacts_no_one_and_says_so_once() -> None:
    p = DialPolicy()
    assert p.learned_revoked() and not p.learned_revoked()
    assert not p.may_contact("m", 0.0) and not p.may_dial("m", 0.0)
    assert p.may_contact("m", 0.0, connected=True)  # a member that dialled us may hold our re-admission
    assert p.readmitted() and p.may_dial("m", 0.0) and not p.readmitted()
    assert p.learned_revoked()  # revoked again: said again


def test_a_new_hello_lifts_the_dial_back_off() -> None:
    p = DialPolicy(dial_base=1.0, dial_cap=30.0)
    p.set_addresses("m", ["/ip4/127.0.0.1/tcp/1"])
    for _ in range(5):
        p.dial_failed("m", 0.0)
    assert not p.may_dial("m", 10.0)
    p.set_addresses("m", ["/ip4/127.0.0.1/tcp/1"])  # the same addresses: still backing off
    assert not p.may_dial("m", 10.0)
    p.set_addresses("m", ["/ip4/127.0.0.1/tcp/2", "/ip4/127.0.0.1/tcp/1"])  # restarted on a new port
    assert p.may_dial("m", 10.0)


def test_unreachable_member_reported_once_per_episode() -> None:
    p = DialPolicy(unreachable_after_s=60.0)
    p.dial_failed("m", 0.0)
    assert p.observe([], 30.0) == ([], []) and p.unreachable(30.0) == {}
    p.dial_failed("m", 40.0)
    newly, back = p.observe([], 61.0)
    assert newly == [("m", 61.0)] and back == []
    assert p.observe([], 120.0) == ([], [])  # said once
    assert p.unreachable(120.0) == {"m": 120.0}
    assert p.observe(["m"], 130.0) == ([], ["m"])  # reachable again: said once, cleared
    assert p.unreachable(200.0) == {}
    p.dial_failed("m", 300.0)
    assert p.observe([], 361.0)[0] == [("m", 61.0)]  # a new episode is reported again


def test_unreachable_after_is_configurable() -> None:
    assert PeerSetConfig.from_table({"unreachable_after_s": 5}).unreachable_after_s == 5
    with pytest.raises(ConfigError):
        PeerSetConfig.from_table({"unreachable_after_s": -1})


def test_backoff_floor_and_when_a_wait_ends() -> None:
    b = Backoff(1.0, 60.0)
    assert b.until("blob", 5.0) == 5.0  # no failures: due now
    assert b.fail("blob", 0.0, 600.0, at_least=30.0) == 30.0  # a disk error: a long first wait
    assert b.until("blob", 5.0) == 30.0 and b.fail("blob", 30.0) == 60.0


def test_retry_waits_doubling_and_gives_up_at_the_deadline() -> None:
    import trio
    import trio.testing

    from atdnode.retry import retry

    tries: list[float] = []

    async def flaky() -> str:
        tries.append(trio.current_time())
        if len(tries) < 4:
            raise OSError("not yet")
        return "up"

    async def never() -> str:
        raise OSError("down")

    async def main() -> None:
        t0 = trio.current_time()
        assert await retry(flaky, base=0.2, cap=0.5, deadline=t0 + 10, retry_on=(OSError,)) == "up"
        assert [round(t - t0, 3) for t in tries] == [0.0, 0.2, 0.6, 1.1]  # 0.2, 0.4, then the 0.5 cap
        t1 = trio.current_time()
        try:
            await retry(never, base=1.0, cap=8.0, deadline=t1 + 5, retry_on=(OSError,))
        except OSError:
            assert round(trio.current_time() - t1, 6) == 3.0  # waited 1 + 2; the next wait (4) would pass the deadline
        else:
            raise AssertionError("retry returned without a success")

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
