"""One split-learning stream with byte accounting, used by both ends of `/atd/split/1.0.0`.

Every message is one tensor frame (`protocols.tensor_frames`: msgpack header with
``meta["kind"]`` + raw little-endian tensor bytes; never pickle) carried as one
length-prefixed transport frame. The training messages are exactly those of the
in-process drivers (`protocols.festa.TRAIN_KINDS`, `protocols.pfesta.TRAIN_KINDS`,
``eval_forward`` / ``eval_out``, MSD's ``upload`` / ``weights``); the session adds a few
small control messages, counted under their own kinds:

    client -> server   info                      ask for the offer (no state change)
    server -> client   offer {offer}
    client -> server   secret {entry: id | None}  p-FESTA / MSD: ask for / offer the campaign's
    server -> client   secret_ok {entry, clients} embedder secret entry (ids only; `secret.py`)
    client -> server   join {task, num_samples, rounds, resume}
    server -> client   welcome {offer, next_round, last_round, uploaded, batch_size, body_bytes}
    server -> client   done                      (p-FESTA / MSD: no more training messages)
    client -> server   bye                       clean end of the session
    either             error {error}             the sender closes the stream after it

Byte accounting: each frame is recorded in a `ByteCounter` as ``len(frame) + 4`` wire bytes
(the transport's 4-byte length prefix, exactly what `InProcessChannel` counts) and its
raw tensor bytes, under (client, direction, kind) with ``up`` = client -> server. A frame
that does not decode is recorded under kind ``malformed`` before the error is raised.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import trio

from atdnode.transport import Stream
from protocols.comm_cost import ByteCounter
from protocols.split_state import SplitProtocolError
from protocols.tensor_frames import LENGTH_PREFIX_BYTES, Frame, FrameDecodeError, decode_frame, encode_frame

SPLIT_PROTOCOL = "/atd/split/1.0.0"  # the stream protocol id both ends speak

CONTROL_KINDS = ("info", "offer", "secret", "secret_ok", "join", "welcome", "done", "bye", "error")
EVAL_KINDS = ("eval_forward", "eval_out")
OFFLOAD_BYTES = 1 << 20  # encode / decode bigger frames in a worker thread


class RemoteError(SplitProtocolError):
    """The peer sent an ``error`` message (and closes the stream)."""


class MalformedFrame(SplitProtocolError):
    """Bytes on the stream are not a valid tensor frame."""


class SplitChannel:
    """Typed messages over one `Stream`, every byte counted for ``client_id``.

    ``side`` is "client" or "server": it decides which direction a sent frame counts as.
    ``read_timeout`` bounds each receive (trio.TooSlowError).
    Not safe for concurrent senders (or concurrent receivers), like the stream itself."""

    def __init__(self, stream: Stream, counter: ByteCounter, client_id: str, *, side: str,
                 max_frame: int, read_timeout: float | None = None) -> None:
        if side not in ("client", "server"):
            raise ValueError(f"side must be 'client' or 'server', not {side!r}")
        self.stream, self.counter, self.client_id = stream, counter, client_id
        self.max_frame = max_frame
        self.read_timeout = read_timeout  # each recv: trio.TooSlowError after this many seconds
        self._out, self._in = ("up", "down") if side == "client" else ("down", "up")

    async def send(self, kind: str, tensors: Mapping[str, torch.Tensor] | None = None,
                   meta: Mapping[str, Any] | None = None) -> int:
        """Encode and send one message; returns its wire bytes."""
        big = tensors is not None and sum(t.numel() * t.element_size() for t in tensors.values()) > OFFLOAD_BYTES
        enc = lambda: encode_frame(tensors, {"kind": kind, **(meta or {})}, max_bytes=self.max_frame)  # noqa: E731
        frame = await trio.to_thread.run_sync(enc) if big else enc()
        await self.stream.write_frame(frame)
        payload = sum(t.numel() * t.element_size() for t in (tensors or {}).values())
        wire = len(frame) + LENGTH_PREFIX_BYTES
        self.counter.record(self.client_id, self._out, kind, wire_bytes=wire, payload_bytes=payload)
        return wire

    async def recv(self, *kinds: str) -> Frame:
        """Receive one message; if ``kinds`` are given it must be one of them.

        Raises MalformedFrame (undecodable; counted as "malformed"), RemoteError (the peer
        sent ``error``), SplitProtocolError (unexpected kind), or the transport's errors
        (StreamClosed at a clean end, FrameError / TransportError otherwise)."""
        if self.read_timeout is None:
            raw = await self.stream.read_frame(self.max_frame)
        else:
            with trio.fail_after(self.read_timeout):
                raw = await self.stream.read_frame(self.max_frame)
        try:
            if len(raw) > OFFLOAD_BYTES:
                frame = await trio.to_thread.run_sync(lambda: decode_frame(raw, max_bytes=self.max_frame))
            else:
                frame = decode_frame(raw, max_bytes=self.max_frame)
            kind = frame.meta.get("kind")
            if not isinstance(kind, str):
                raise FrameDecodeError("meta has no string 'kind'")
        except FrameDecodeError as e:
            self.counter.record(self.client_id, self._in, "malformed", wire_bytes=len(raw) + LENGTH_PREFIX_BYTES,
                                payload_bytes=0)
            raise MalformedFrame(f"malformed frame: {e}") from None
        self.counter.record(self.client_id, self._in, kind, wire_bytes=len(raw) + LENGTH_PREFIX_BYTES,
                            payload_bytes=frame.payload_bytes)
        if kind == "error":
            raise RemoteError(str(frame.meta.get("error", "unspecified error")))
        if kinds and kind not in kinds:
            raise SplitProtocolError(f"expected {' or '.join(kinds)}, got {kind!r}")
        return frame

    async def send_error(self, message: str) -> None:
        """Best effort: tell the peer why the stream is about to close."""
        try:
            with trio.move_on_after(2):
                await self.send("error", None, {"error": message[:500]})
        except Exception:  # the stream may already be broken; the close that follows says enough
            pass


def tensor(frame: Frame, name: str) -> torch.Tensor:
    """The named tensor of a received message (SplitProtocolError if absent)."""
    t = frame.tensors.get(name)
    if t is None:
        raise SplitProtocolError(f"{frame.meta.get('kind')!r} message lacks tensor {name!r}")
    return t


def meta_int(frame: Frame, key: str, *, low: int = 0) -> int:
    """An integer meta field >= ``low`` (SplitProtocolError otherwise)."""
    v = frame.meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise SplitProtocolError(f"{frame.meta.get('kind')!r} message: {key} must be an integer >= {low}")
    return v
