"""What a node tells others to dial (atdnode.node.advertise, `[network] announce`).

The unit tests check the expansion of an unspecified listen address and the announce list;
the network test runs three real `NodeDaemon`s over real libp2p on three loopback
addresses (127.0.0.2 stands in for one site, 127.0.0.3 and 127.0.0.4 for two more, those two
listening on 0.0.0.0 with `[network] announce` naming their address): the two newcomers are
given only the first site's address and find each other through the `hello` entries alone.
"""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import trio

from atdnode.errors import ConfigError
from atdnode.node import advertised
from atdnode.node.advertise import interface_addresses
from atdnode.node import NodeConfig, NodeDaemon, set_key
from ledger import Ledger
from tests.factories import make_consortium, run, wait_for

PEER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


def _ifaces(ip4: list[str], ip6: list[str] = ()):
    return lambda: {"ip4": list(ip4), "ip6": list(ip6)}


def test_unspecified_listen_address_becomes_the_hosts_interface_addresses() -> None:
    bound = [f"/ip4/0.0.0.0/tcp/4001/p2p/{PEER}", f"/ip6/::/tcp/4002/p2p/{PEER}"]
    got = advertised(bound, peer_id=PEER, interfaces=_ifaces(["10.1.2.3", "192.168.5.6"], ["2001:db8::7"]))
    assert got == [f"/ip4/10.1.2.3/tcp/4001/p2p/{PEER}", f"/ip4/192.168.5.6/tcp/4001/p2p/{PEER}",
                   f"/ip6/2001:db8::7/tcp/4002/p2p/{PEER}"]


def test_a_host_with_loopback_only_advertises_loopback_and_a_bound_address_passes() -> None:
    got = advertised([f"/ip4/0.0.0.0/tcp/9/p2p/{PEER}", f"/ip4/127.0.0.2/tcp/8/p2p/{PEER}", f"/ip6/::/tcp/7/p2p/{PEER}"],
                     peer_id=PEER, interfaces=_ifaces([]))
    assert got == [f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}", f"/ip4/127.0.0.2/tcp/8/p2p/{PEER}", f"/ip6/::1/tcp/7/p2p/{PEER}"]


def test_no_more_addresses_than_a_dialer_keeps() -> None:
    from atdnode.peers import MAX_ADDRS_PER_MEMBER

    many = [f"10.0.{i}.1" for i in range(MAX_ADDRS_PER_MEMBER + 5)]
    got = advertised([f"/ip4/127.0.0.2/tcp/1/p2p/{PEER}", f"/ip4/0.0.0.0/tcp/2/p2p/{PEER}"], peer_id=PEER,
                     interfaces=_ifaces(many))
    assert len(got) == MAX_ADDRS_PER_MEMBER and got[0] == f"/ip4/127.0.0.2/tcp/1/p2p/{PEER}"


def test_announce_replaces_the_listen_addresses() -> None:
    got = advertised([f"/ip4/0.0.0.0/tcp/4001/p2p/{PEER}"], peer_id=PEER,
                     announce=["/ip4/203.0.113.9/tcp/4001", "/dns4/node.example.org/tcp/4001"],
                     interfaces=_ifaces(["10.1.2.3"]))
    assert got == [f"/ip4/203.0.113.9/tcp/4001/p2p/{PEER}", f"/dns4/node.example.org/tcp/4001/p2p/{PEER}"]


def test_interface_addresses_of_this_host_are_never_loopback_or_unspecified() -> None:
    found = interface_addresses()
    for fam, addrs in found.items():
        for a in addrs:
            assert not a.startswith("127.") and a not in ("0.0.0.0", "::", "::1"), (fam, a)


def test_announce_is_validated_when_set_and_when_the_node_loads_its_config(tmp_path: Path) -> None:
    home = make_consortium(tmp_path, 1)[0]
    for bad in ("/ip4/0.0.0.0/tcp/4001", "/ip4/10.0.0.1/tcp/0", "10.0.0.1:4001", "/ip4/10.0.0.1/udp/4001"):
        before = home.config_file.read_bytes()
        with pytest.raises(ConfigError, match="announce"):
            set_key(home, "network.announce", bad)
        assert home.config_file.read_bytes() == before  # a refusal changes nothing
    assert set_key(home, "network.announce", "/ip4/203.0.113.9/tcp/4001") == ["/ip4/203.0.113.9/tcp/4001"]
    assert NodeConfig.load(home).announce() == ["/ip4/203.0.113.9/tcp/4001"]
    cfg = NodeConfig.load(home)  # hand-edited: refused when the daemon is built, before anything runs
    cfg.extra["network"] = {"announce": ["/ip6/::/tcp/1"]}
    cfg.save(home)
    with pytest.raises(ConfigError, match="unspecified"):
        NodeDaemon(home)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _hello_addrs(home) -> dict[str, list[str]]:
    from ledger.keys import peer_id_from_public_key

    with Ledger.open(home.ledger_db) as led:
        return {peer_id_from_public_key(e.author): e.body["addrs"] for e in led.query(kind="hello")}


@pytest.mark.slow
def test_three_sites_on_three_addresses_find_each_other_through_hello(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 3)
    ports = {1: _free_port("127.0.0.3"), 2: _free_port("127.0.0.4")}
    for i, host in ((1, "127.0.0.3"), (2, "127.0.0.4")):
        set_key(homes[i], "network.announce", f"/ip4/{host}/tcp/{ports[i]}")
    ds = [NodeDaemon(h, sync_interval=0.5, poll_interval=0.05, auto_fetch=False) for h in homes]
    peer = [d.transport.peer_id for d in ds]
    want = {peer[0]: "/ip4/127.0.0.2/tcp/", peer[1]: f"/ip4/127.0.0.3/tcp/{ports[1]}/p2p/",
            peer[2]: f"/ip4/127.0.0.4/tcp/{ports[2]}/p2p/"}
    got_status: dict[str, list[str]] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            first = await nursery.start(ds[0].run, ["/ip4/127.0.0.2/tcp/0"], [])
            assert len(first) == 1 and first[0].startswith(want[peer[0]])
            for i in (1, 2):  # each newcomer is given the first site's address only
                said = await nursery.start(ds[i].run, [f"/ip4/0.0.0.0/tcp/{ports[i]}"], first)
                assert said == [want[peer[i]] + peer[i]]  # what `atd node start` prints
            await wait_for(lambda: peer[2] in ds[1].transport.peers() and peer[1] in ds[2].transport.peers(),
                           "the two newcomers connected to each other", 30)
            for d in ds:
                got_status[d.transport.peer_id] = (await d.status())["addrs"]
                d.stop()

    run(main, timeout=60)
    for p, addrs in got_status.items():
        assert addrs and all(a.startswith(want[p]) for a in addrs), addrs
    hellos = _hello_addrs(homes[0])  # the signed hellos the first site holds
    assert set(hellos) == set(peer)
    for p, addrs in hellos.items():
        assert addrs and all(a.startswith(want[p]) and "/0.0.0.0/" not in a for a in addrs), (p, addrs)


def test_node_start_refuses_a_bad_announce_address_in_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.app import app

    home = make_consortium(tmp_path, 1)[0]
    r = CliRunner().invoke(app, ["node", "start", "--home", str(home.root), "--announce", "/ip4/0.0.0.0/tcp/4001"])
    assert r.exit_code != 0 and "--announce '/ip4/0.0.0.0/tcp/4001': an unspecified address" in str(r.exception)
    assert not (home.root / "daemon.json").exists()  # refused before anything started


def test_container_bridges_link_local_and_loopback_are_not_advertised() -> None:
    from collections import namedtuple

    A = namedtuple("A", "family address")
    nics = {"lo": [A(socket.AF_INET, "127.0.0.1"), A(socket.AF_INET6, "::1")],
            "eth0": [A(socket.AF_INET, "10.20.30.40"), A(socket.AF_INET6, "fe80::1%eth0"),
                     A(socket.AF_INET6, "2001:db8::5"), A(socket.AF_PACKET, "aa:bb:cc:dd:ee:ff")],
            "docker0": [A(socket.AF_INET, "172.17.0.1")], "br-1a2b": [A(socket.AF_INET, "172.18.0.1")],
            "wg0": [A(socket.AF_INET, "10.99.0.2")]}  # a VPN between sites is kept
    assert interface_addresses(nics) == {"ip4": ["10.20.30.40", "10.99.0.2"], "ip6": ["2001:db8::5"]}
    assert interface_addresses({"lo": nics["lo"], "docker0": nics["docker0"]}) == {"ip4": [], "ip6": []}
