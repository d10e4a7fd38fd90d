"""The addresses a node tells others to dial: its signed `hello`, `atd node status`, the dashboard.

A listener's own address is not always one another site can dial: `/ip4/0.0.0.0/tcp/4001`
(listen on every interface) names no host, and behind NAT or a port forward the address
others reach differs from any local one. So:

* `[network] announce` in config.toml (or `atd node start --announce`) is the list others
  dial, as given (`atdnode.node.addrs.check_announce`; `/p2p/<own peer id>` appended);
* without it, each listen address is advertised as bound, except an unspecified one
  (0.0.0.0 / ::), which becomes the host's interface addresses of that family on the bound
  port: every non-loopback, non-link-local one outside container and VM bridges (docker0,
  br-*, veth*, virbr*, ...: another host's bridge has the same address), or loopback where
  that is all there is. A host on several networks should set `announce`.

An unspecified address is never advertised. Addresses that are not IP (the in-memory
transport's `/memory/...`) pass unchanged. At most MAX_ADDRS_PER_MEMBER are advertised
(the most a dialer keeps of a member), announced or bound ones first.
"""
from __future__ import annotations

import ipaddress
from typing import Callable, Iterable

from atdnode.peers import MAX_ADDRS_PER_MEMBER

UNSPECIFIED = {"ip4": "0.0.0.0", "ip6": "::"}
BRIDGES = ("docker", "br-", "veth", "virbr", "cni", "podman", "lxcbr", "lxdbr", "flannel", "cali", "vnet")
LOOPBACK = {"ip4": "127.0.0.1", "ip6": "::1"}


def interface_addresses(nics: dict | None = None) -> dict[str, list[str]]:
    """{"ip4": [...], "ip6": [...]}: the host's interface addresses that another host may
    dial (not loopback, not link-local, not on a container or VM bridge), in interface
    order. `nics`: `psutil.net_if_addrs()` (read when not given)."""
    import socket

    if nics is None:
        import psutil

        nics = psutil.net_if_addrs()
    out: dict[str, list[str]] = {"ip4": [], "ip6": []}
    for name, snics in nics.items():
        if name.startswith(BRIDGES):
            continue
        for s in snics:
            fam = {socket.AF_INET: "ip4", socket.AF_INET6: "ip6"}.get(s.family)
            if fam is None:
                continue
            try:
                ip = ipaddress.ip_address(s.address.split("%", 1)[0])
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast:
                continue
            if str(ip) not in out[fam]:
                out[fam].append(str(ip))
    return out


def _with_peer(addr: str, peer_id: str) -> str:
    return addr if "/p2p/" in addr else f"{addr.rstrip('/')}/p2p/{peer_id}"


def advertised(bound: Iterable[str], *, peer_id: str, announce: Iterable[str] = (),
               interfaces: Callable[[], dict[str, list[str]]] = interface_addresses) -> list[str]:
    """What others dial: `announce` when given, else `bound` (the listener's addresses) with
    every unspecified host expanded (module doc). Each ends in `/p2p/<peer_id>`; no duplicates;
    at most MAX_ADDRS_PER_MEMBER."""
    announce = list(announce)
    if announce:
        return list(dict.fromkeys(_with_peer(a, peer_id) for a in announce))[:MAX_ADDRS_PER_MEMBER]
    found: dict[str, list[str]] | None = None
    out: list[str] = []
    for addr in bound:
        parts = addr.split("/")  # "", "ip4", HOST, "tcp", PORT, ...
        fam = parts[1] if len(parts) > 2 else ""
        if fam not in UNSPECIFIED or ipaddress.ip_address(parts[2]) != ipaddress.ip_address(UNSPECIFIED[fam]):
            out.append(_with_peer(addr, peer_id))
            continue
        if found is None:
            found = interfaces()  # read only when an unspecified address needs it
        for host in found.get(fam) or [LOOPBACK[fam]]:
            out.append(_with_peer("/".join(["", fam, host, *parts[3:]]), peer_id))
    return list(dict.fromkeys(out))[:MAX_ADDRS_PER_MEMBER]
