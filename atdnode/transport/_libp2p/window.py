"""Yamux receive windows enforced (py-libp2p 0.8.1 `Yamux`, stock and `TunedYamux` alike).

A yamux receiver grants each stream a window; a sender may have at most that many
unacknowledged bytes in flight. py-libp2p's `Yamux.handle_incoming` notices a DATA frame
past the window ("peer exceeded receive window"), then keeps its bytes anyway and sets the
window to 0, so a peer writing on a stream the node never reads (the pubsub stream a node
opens to every member and only writes on) grew the node's memory by every byte it sent.

`install()` gives every Yamux connection a `StreamBuffers` as its `stream_buffers`. The
only `[]` reads of that mapping are handle_incoming's `stream_buffers[sid].extend(body)`,
made before it charges the body to the stream's window; there a body longer than the
stream's remaining window is dropped and the connection is closed, as go-yamux does
(`ErrRecvWindowExceeded` ends the session). The close goes through handle_incoming's own
teardown for a DATA body that timed out (`ReceiveWindowExceeded` is a `trio.TooSlowError`,
the one exception every branch of its loop lets through to that teardown): streams are
reset, the socket closed and the swarm told. So a peer can make a node hold at most the
windows it granted, plus one frame (<= 16 MiB, py-libp2p's frame limit) while it is read.

Every credit the node returns raises `recv_window` before the WINDOW_UPDATE leaves (py-
libp2p's auto-tuning, `batch_yamux_credit`, `grant_window`), so a sender that respects the
window is never refused.
"""
from __future__ import annotations

import logging
from typing import Any

import trio
from libp2p.stream_muxer.yamux import yamux as _y

log = logging.getLogger(__name__)


class ReceiveWindowExceeded(trio.TooSlowError):
    """A peer sent a DATA frame past the receive window of its stream (module doc)."""


class StreamBuffers(dict):
    """A Yamux connection's `stream_buffers` (stream id -> bytearray of unread bytes) whose
    `[]` reads check the next `extend` against the stream's receive window.

    `adopt`: a large DATA body `TunedYamux` just decrypted into a fresh bytearray; when it
    lands on a stream whose buffer is empty it becomes the buffer instead of being copied
    into it. Any other extend (small frames, a stream with bytes waiting) copies as before."""

    adopt: bytearray | None = None

    def __init__(self, muxer: Any) -> None:
        super().__init__()
        self.streams: dict = muxer.streams  # the muxer's own (never rebound; cleared in place)
        self.peer = muxer.peer_id

    def __getitem__(self, sid: int) -> "_Landing":
        body, self.adopt = self.adopt, None
        return _Landing(self, sid, dict.__getitem__(self, sid), body)


class _Landing:
    """One DATA body about to land on stream `sid` (StreamBuffers.__getitem__)."""

    __slots__ = ("d", "sid", "buf", "body")

    def __init__(self, d: StreamBuffers, sid: int, buf: bytearray, body: bytearray | None) -> None:
        self.d, self.sid, self.buf, self.body = d, sid, buf, body

    def extend(self, data: Any) -> None:
        stream = self.d.streams.get(self.sid)
        window = stream.recv_window if stream is not None else None
        if window is not None and len(data) > window:
            log.warning("peer %s sent %d bytes on stream %d past its receive window of %d: "
                        "bytes dropped, connection closed", self.d.peer, len(data), self.sid, window)
            raise ReceiveWindowExceeded(f"stream {self.sid}: {len(data)} bytes past a window of {window}")
        if data is self.body and not self.buf:
            dict.__setitem__(self.d, self.sid, data)
        else:
            self.buf.extend(data)


def install() -> None:
    """Give every Yamux connection made from now on a window-checking `StreamBuffers`
    (idempotent). Must run before any yamux connection exists; `libp2p_transport` calls it
    at import."""
    init = _y.Yamux.__init__
    if getattr(init, "atd_windowed", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.stream_buffers = StreamBuffers(self)

    __init__.atd_windowed = True
    _y.Yamux.__init__ = __init__
