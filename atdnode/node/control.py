"""Local control endpoint: CLI commands talk to a running daemon over a Unix socket.

The socket lives in the node home (`control.sock`, mode 0600 directory-local), so only
the node's OS user can drive it. One request per connection, each a length-prefixed
msgpack map `{"op": name, ...}`; the answer is `{"ok": true, ...}` or
`{"ok": false, "error": "one line"}`.

The client side is plain blocking sockets (the CLI has no event loop); the server side
is trio, inside the daemon.
"""
from __future__ import annotations

import os
import socket
import struct
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgpack
import trio

from atdnode.errors import DaemonError

_HDR = struct.Struct(">I")
MAX_CONTROL_FRAME = 4 << 20

Handler = Callable[[dict], Awaitable[dict]]


# ---------------------------------------------------------------- client (CLI side)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise DaemonError("the daemon closed the control connection")
        buf += chunk
    return bytes(buf)


def call(sock_path: Path, op: str, *, timeout: float = 30.0, **args: Any) -> dict:
    """Send one request to the daemon at `sock_path`; return its answer map.

    Raises DaemonError when no daemon listens there or it answers with an error.
    """
    if not sock_path.exists():
        raise DaemonError(f"no running daemon for this home (start it with `atd node start --home {sock_path.parent}`)")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            s.connect(str(sock_path))
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise DaemonError(
                f"no running daemon for this home (stale socket; start it with `atd node start --home {sock_path.parent}`)"
            ) from exc
        body = msgpack.packb({"op": op, **args})
        s.sendall(_HDR.pack(len(body)) + body)
        (n,) = _HDR.unpack(_recv_exact(s, _HDR.size))
        if n > MAX_CONTROL_FRAME:
            raise DaemonError("oversized answer from the daemon")
        reply = msgpack.unpackb(_recv_exact(s, n), raw=False)
    except socket.timeout as exc:
        raise DaemonError(f"the daemon did not answer {op!r} within {timeout:.0f} s") from exc
    finally:
        s.close()
    if not reply.get("ok"):
        raise DaemonError(str(reply.get("error", "the daemon refused the request")))
    return reply


def daemon_running(sock_path: Path) -> bool:
    """True when a daemon answers a ping on `sock_path`."""
    try:
        call(sock_path, "ping", timeout=5.0)
        return True
    except DaemonError:
        return False


# ---------------------------------------------------------------- server (daemon side)


async def _read_exact(stream: trio.SocketStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


async def serve(sock_path: Path, handler: Handler, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve control requests on `sock_path` until cancelled; removes the socket on exit."""
    if sock_path.exists():
        sock_path.unlink()  # stale socket of a daemon that died; a live one was ruled out by the caller
    listener_sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await listener_sock.bind(str(sock_path))
    os.chmod(sock_path, 0o600)
    listener_sock.listen(16)
    listener = trio.SocketListener(listener_sock)

    async def one(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                (n,) = _HDR.unpack(await _read_exact(stream, _HDR.size))
                if n > MAX_CONTROL_FRAME:
                    return
                req = msgpack.unpackb(await _read_exact(stream, n), raw=False)
                if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                    reply = {"ok": False, "error": "malformed control request"}
                else:
                    try:
                        reply = {"ok": True, **(await handler(req))}
                    except Exception as exc:  # the error goes back to the CLI as one line
                        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc)}
                body = msgpack.packb(reply)
                await stream.send_all(_HDR.pack(len(body)) + body)
            except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, ValueError):
                return

    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            await trio.serve_listeners(one, [listener], handler_nursery=nursery)
    finally:
        try:
            sock_path.unlink()
        except FileNotFoundError:
            pass
