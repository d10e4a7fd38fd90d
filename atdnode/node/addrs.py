"""Checks of the multiaddrs a daemon listens on and dials, before anything starts.

atd runs py-libp2p over TCP only, so a listen address is `/ip4|ip6/ADDR/tcp/PORT`
(PORT 0: any free port) and a bootstrap address is `/ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT/
p2p/PEER_ID`; an announce address (`[network] announce`, what others dial) is a bootstrap
address whose `/p2p/` part may be left out. Each check raises ConfigError with one line naming where the address came
from (`--listen`, `config.toml bootstrap`, ...) and what is wrong with it.
"""
from __future__ import annotations

from atdnode.errors import ConfigError

_IP = ("ip4", "ip6")
_HOST = ("ip4", "ip6", "dns", "dns4", "dns6")


def _parse(addr: object, source: str):
    import multiaddr

    if not isinstance(addr, str) or not addr.startswith("/"):
        raise ConfigError(f"{source} {addr!r}: not a multiaddr (expected e.g. /ip4/127.0.0.1/tcp/4001)")
    try:
        m = multiaddr.Multiaddr(addr)
    except Exception as exc:  # the multiaddr package raises several unrelated types
        detail = str(exc).split(" (string:")[0]
        raise ConfigError(f"{source} {addr!r}: {detail}") from None
    return m, [p.name for p in m.protocols()]


def check_listen(addr: object, source: str = "--listen") -> str:
    """`addr` if the daemon can listen on it, else ConfigError."""
    m, names = _parse(addr, source)
    if len(names) < 2 or names[0] not in _IP or names[1] != "tcp" or any(n != "p2p" for n in names[2:]):
        raise ConfigError(f"{source} {addr!r}: expected /ip4/ADDR/tcp/PORT or /ip6/ADDR/tcp/PORT")
    return str(addr)


def check_bootstrap(addr: object, source: str = "--bootstrap") -> str:
    """`addr` if it names a host, a TCP port and a valid peer id, else ConfigError."""
    m, names = _parse(addr, source)
    if len(names) != 3 or names[0] not in _HOST or names[1] != "tcp" or names[2] != "p2p":
        raise ConfigError(f"{source} {addr!r}: expected /ip4/HOST/tcp/PORT/p2p/PEER_ID "
                          "(the address `atd node start` prints)")
    _check_dialable(m, names, addr, source)
    return str(addr)


def check_announce(addr: object, source: str = "--announce") -> str:
    """`addr` if others can dial it (`/ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT`, optionally with
    `/p2p/PEER_ID`; a real host and port), else ConfigError."""
    m, names = _parse(addr, source)
    if len(names) not in (2, 3) or names[0] not in _HOST or names[1] != "tcp" or names[2:] not in ([], ["p2p"]):
        raise ConfigError(f"{source} {addr!r}: expected /ip4/HOST/tcp/PORT (or /dns4/NAME/tcp/PORT): "
                          "the address other sites dial")
    _check_dialable(m, names, addr, source)
    return str(addr)


def _check_dialable(m, names: list[str], addr: object, source: str) -> None:
    if names[0] in _IP:
        import ipaddress

        if ipaddress.ip_address(m.value_for_protocol(names[0])).is_unspecified:
            raise ConfigError(f"{source} {addr!r}: an unspecified address (0.0.0.0 / ::) cannot be dialled; "
                              "name the host's address")
    if int(m.value_for_protocol("tcp")) == 0:
        raise ConfigError(f"{source} {addr!r}: port 0 cannot be dialled")
    if "p2p" in names:
        try:
            from libp2p.peer.id import ID

            ID.from_base58(m.value_for_protocol("p2p"))
        except Exception:
            raise ConfigError(f"{source} {addr!r}: the /p2p/ part is not a peer id") from None
