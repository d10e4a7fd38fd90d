"""Exclusive TCP listeners for py-libp2p 0.8.1.

py-libp2p opens its TCP listeners with SO_REUSEPORT (for NAT hole punching, which atd
does not use). On Linux that lets any other process of the same user bind the daemon's
port beside it and receive a share of its incoming connections. `install()` replaces
the listener factory with one that binds like `trio.open_tcp_listeners`: SO_REUSEADDR
only (a restarted daemon can rebind a port in TIME_WAIT), no SO_REUSEPORT, so while the
daemon listens nobody else can bind the same address and port.

Outbound hole-punch dials, which bind the listen port, then fall back to an ephemeral
source port (py-libp2p handles that failure itself).
"""
from __future__ import annotations

import errno
import logging

import trio

log = logging.getLogger(__name__)

_failures: dict[tuple[str | None, int], str] = {}  # (host, port) -> why the last listen there failed


async def open_exclusive_listeners(host: str | None, port: int) -> list[trio.SocketListener]:
    """Listening sockets on (host, port) without SO_REUSEPORT; OpenConnectionError if busy."""
    from libp2p.transport.exceptions import OpenConnectionError

    try:
        return list(await trio.open_tcp_listeners(port, host=host))
    except OSError as exc:
        why = str(exc.strerror or exc)
        if exc.errno == errno.EADDRINUSE:
            why += " (another process listens on this port)"
        elif exc.errno == errno.EADDRNOTAVAIL:
            why += " (not an address of this machine)"
        _failures[(host, port)] = why
        raise OpenConnectionError(f"cannot listen on {host or '*'}:{port}: {why}") from exc


def listen_failure(maddr: object) -> str | None:
    """Why the last listen on `maddr`'s host and TCP port failed in this process, if it did."""
    try:
        port = int(maddr.value_for_protocol("tcp"))  # type: ignore[attr-defined]
        hosts = [maddr.value_for_protocol(p) for p in ("ip4", "ip6") if p in [x.name for x in maddr.protocols()]]  # type: ignore[attr-defined]
    except Exception:
        return None
    return _failures.get((hosts[0] if hosts else None, port))


def install() -> None:
    """Make every py-libp2p TCP listener in this process exclusive (idempotent)."""
    from libp2p.transport.tcp import tcp as tcp_mod

    if getattr(tcp_mod, "_open_reuseport_listeners", None) is open_exclusive_listeners:
        return
    if not hasattr(tcp_mod, "_open_reuseport_listeners"):
        log.warning("py-libp2p's TCP listener changed; cannot make the listening socket exclusive")
        return
    tcp_mod._open_reuseport_listeners = open_exclusive_listeners
