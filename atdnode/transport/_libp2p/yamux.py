"""Faster yamux streams for bulk data on py-libp2p 0.8.1, wire-compatible with stock peers.

Why: on stock py-libp2p a 1 MiB chunk crosses as 16 yamux DATA frames of 64 KiB, each
paying the muxer's per-frame Python work on both sides (two locks, a header and a payload
copy, debug f-strings formatted even with logging off, a scheduler pass in the receiver's
`handle_incoming` and in the reader) on top of its Noise message; a sender whose window ran
out polls it every 10 ms (`trio.sleep(0.01)`), and the window is 256 KiB. Throughput against
raw TCP: `bench/transfer_bench.py`, the per-frame costs: `bench/transfer_stream_profile.py`.

What `TunedYamux` (the muxer `Libp2pTransport` offers) changes, on its own connections only:

* large DATA frames: `YamuxStream.write` sends up to FRAME_MAX bytes per frame, never more
  than the peer's send window, holding the stream's write lock for the whole write (one
  write is contiguous on the stream; the pubsub layer's own lock stays). The yamux spec
  bounds a DATA frame by the receiver's window only, and py-libp2p accepts frames up to
  16 MiB (`MAX_WINDOW_SIZE`), go-yamux up to its window; Noise still cuts each frame
  into messages of <= 65535 bytes, each one encrypted (nothing crosses in the clear).
* window waits are event-driven: a writer with no window sleeps until a WINDOW_UPDATE
  raises `send_window` (a property that wakes it), not in 10 ms polls.
* one copy per byte through Noise: a large DATA frame is sealed message by message from
  the writer's buffer into one output buffer (`NoiseTx`, `encrypt_into`) and opened from
  one receive buffer straight into the frame's buffer (`NoiseRx`, `recv_into` +
  `decrypt_into`; both buffers come from a small pool shared by all connections), with
  the session's own keys and nonce counters; the Noise messages on the wire are exactly
  py-libp2p's (which copies each byte several times on each side). Small frames keep
  py-libp2p's path.
* a larger receive window on the streams we open: right after its SYN, each grants
  RECV_WINDOW bytes with one WINDOW_UPDATE frame. The spec makes window updates
  per-stream deltas a receiver may send at any time, and go-yamux grants a larger initial
  window the same way. Credit then returns in batches (`_libp2p.pubsub.batch_yamux_credit`)
  once half of it is consumed. Streams a peer opens to us keep the
  default 256 KiB (auto-tuning may grow it as we read): the bulk receiver is the opener
  (the blob fetcher), and a peer cannot make us hold RECV_WINDOW per stream it opens.

Applied to every Noise connection (wire-identical, so stock peers see the same bytes): a
write longer than one Noise message is sealed message by message as before, then sent with
ONE socket write instead of one per 64 KiB (`_coalesced_write_msg`; NoiseTx's fallback).

Cost: a stream we opened may hold up to RECV_WINDOW unread bytes, and no more (the window
is enforced: `_libp2p.window`); the blob fetcher reads its streams continuously.

Stock peers: a stock py-libp2p peer that talks to a `TunedYamux` gets 256 KiB frames at most
(its window) and grants the window it always did; it receives our larger window grant as an
ordinary WINDOW_UPDATE. `tests/test_yamux_tuning.py` runs a blob transfer with one side on
stock `Yamux` both ways. Streams of a stock `Yamux` connection in this process keep py-libp2p's
own write path (the patched `write` checks `conn.atd_tuned`).
"""
from __future__ import annotations

import logging
import struct
from typing import Any

import trio
from cryptography.exceptions import InvalidTag
from libp2p.io.exceptions import IncompleteReadError
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, NoiseTransportReadWriter
from libp2p.stream_muxer.exceptions import MuxedStreamError
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.stream_muxer.yamux import yamux as _y

from atdnode.transport._libp2p.window import StreamBuffers

log = logging.getLogger(__name__)

FRAME_MAX = 1 << 20  # largest DATA frame payload we send (bounded by the peer's window too)
RECV_WINDOW = 4 << 20  # receive window each stream a TunedYamux opens grants at once
DIRECT_MIN = 1 << 17  # DATA frames larger than this are sealed by NoiseTx, opened by NoiseRx
_MAX_NONCE = 2**64 - 1  # noise's MAX_NONCE: that nonce is never used
WINDOW_WAIT = 5.0  # seconds a writer waits for window before giving up (py-libp2p's 5 s)
WHOLE_FRAME_WAIT = 0.5  # seconds a writer waits for the window of a whole frame before cutting a piece
_HEADER = struct.Struct(_y.YAMUX_HEADER_FORMAT)


class TunedYamux(_y.Yamux):
    """py-libp2p's Yamux with large frames, event-driven window waits and a RECV_WINDOW
    grant per stream it opens (module doc). Same protocol id, same wire format."""

    atd_tuned = True

    async def open_stream(self) -> Any:
        stream = await super().open_stream()
        await grant_window(stream)
        return stream

    async def _read_data_body(self, length: int) -> bytes | bytearray:
        """A DATA frame's body; a large one is decrypted straight into one buffer (NoiseRx)."""
        rx = self.__dict__.get("_atd_rx", False)
        if rx is False:
            rx = self.__dict__["_atd_rx"] = NoiseRx.attach(self.secured_conn)
        if rx is None or length <= DIRECT_MIN:
            return await super()._read_data_body(length)
        with trio.fail_after(_y._yamux_data_read_timeout()):
            body = await rx.read_plain(length)
        if isinstance(self.stream_buffers, StreamBuffers):
            self.stream_buffers.adopt = body  # handle_incoming's `extend(body)` next: adopt, not copy
        return body

    async def read_stream(self, stream_id: int, n: int = -1) -> bytes | bytearray:
        """Yamux.read_stream; what an open stream has buffered is returned at once, without
        the stock path's lock and debug formatting, or as soon as data arrives: a large run is
        handed over whole (the bytearray itself, a fresh one takes its place) instead of
        copied, or copied once. Closing, closed and reset streams take the stock path."""
        while True:
            buf, stream = self.stream_buffers.get(stream_id), self.streams.get(stream_id)
            if (buf is None or stream is None or stream.closed or stream.reset_received
                    or self.event_shutting_down.is_set()):
                return await super().read_stream(stream_id, n)
            if buf:
                break
            ev = self.stream_events.get(stream_id)
            if stream.recv_closed or ev is None:
                return await super().read_stream(stream_id, n)
            await ev.wait()  # as the stock path waits, but the data is then handed over, not copied
            if self.stream_events.get(stream_id) is ev:
                self.stream_events[stream_id] = trio.Event()
        if n is None or n < 0 or n >= len(buf):
            if len(buf) >= DIRECT_MIN:
                self.stream_buffers[stream_id] = bytearray()
                return buf
            out = bytes(buf)
            buf.clear()
            return out
        if n >= DIRECT_MIN and len(buf) - n < n:  # hand over the head, keep a copy of the shorter tail
            self.stream_buffers[stream_id] = buf[n:]
            del buf[n:]
            return buf
        out = bytes(memoryview(buf)[:n])
        del buf[:n]
        return out

    async def _write_data(self, header: bytes, body: memoryview) -> None:
        """One DATA frame; a large one is sealed straight from `body` (NoiseTx)."""
        tx = self.__dict__.get("_atd_tx", False)
        if tx is False:
            tx = self.__dict__["_atd_tx"] = NoiseTx.attach(self.secured_conn)
        if tx is None or len(body) <= DIRECT_MIN:
            return await self._write_frame(b"".join((header, body)))
        async with self._write_lock:  # every write of this connection takes it: nonces stay in wire order
            await tx.write(header, body)
        await trio.lowlevel.checkpoint()


class _Pool:
    """A few BUF_SIZE buffers shared by every connection's NoiseRx / NoiseTx: one is taken
    for one frame and given back after it, so an idle connection holds none and idle memory
    stays <= KEEP buffers in all (fresh 1 MiB buffers per frame cost page faults)."""

    KEEP = 4

    def __init__(self, size: int) -> None:
        self.size, self.free = size, list[bytearray]()

    def take(self) -> bytearray:
        return self.free.pop() if self.free else bytearray(self.size)

    def give(self, buf: bytearray) -> None:
        if len(self.free) < self.KEEP:
            self.free.append(buf)


BUF_SIZE = FRAME_MAX + (1 << 16)  # a whole FRAME_MAX frame's Noise messages with room to spare
_buffers = _Pool(BUF_SIZE)


class NoiseRx:
    """Reads the plaintext of a large yamux DATA frame from a Noise session with one copy
    per byte: ciphertext lands in one buffer (`recv_into`), each Noise message is
    authenticated and decrypted into the frame's buffer (`decrypt_into`, the session's own
    key and nonce counter, advanced exactly as `noise` does). py-libp2p's path copied each
    byte ~8 times (read_exactly, SecureSession and raw-read buffers). It never reads past
    the Noise message holding the frame's last byte, so the session's ordinary reader
    (headers, small frames) goes on where it stops; plaintext past the frame goes back
    into the session's buffer, bytes read ahead by `buffer_raw_reads` are used first."""

    RECV = BUF_SIZE  # ciphertext buffer (from _buffers, per frame): a whole frame per recv_into

    def __init__(self, session: Any, raw: Any, sock: Any, cipher_state: Any) -> None:
        self.session, self.raw, self.sock, self.cs = session, raw, sock, cipher_state
        self.aead = cipher_state.cipher.cipher
        self.buf, self.view = bytearray(), memoryview(b"")
        self.lo = self.hi = 0

    @classmethod
    def attach(cls, session: Any) -> "NoiseRx | None":
        """A reader for this secured connection, or None when it is not py-libp2p's Noise over
        TCP as expected (then the ordinary path is used)."""
        try:
            noise = session.conn
            raw = noise.read_writer.read_write_closer
            sock = raw.stream.stream.socket
            cs = noise.noise_state.noise_protocol.cipher_state_decrypt
            ok = (isinstance(noise, NoiseTransportReadWriter) and hasattr(session, "_drain")
                  and hasattr(session, "_fill") and hasattr(cs.cipher.cipher, "decrypt_into")
                  and hasattr(sock, "recv_into") and type(cs.n) is int)
        except AttributeError:
            ok = False
        return cls(session, raw, sock, cs) if ok else None

    async def _need(self, k: int, hint: int) -> None:
        """Hold at least k unread bytes; read at most max(k, hint) past what is held."""
        if self.hi - self.lo >= k:
            return
        if self.lo:
            held = self.hi - self.lo
            self.buf[:held] = bytes(self.view[self.lo : self.hi])  # overlapping: copy out first
            self.lo, self.hi = 0, held
        while self.hi - self.lo < k:
            ahead = self.raw.__dict__.get("_atd_buf")  # bytes buffer_raw_reads already took: first
            if ahead:
                take = min(len(ahead), self.RECV - self.hi)
                self.view[self.hi : self.hi + take] = memoryview(ahead)[:take]
                del ahead[:take]
                self.hi += take
                continue
            want = min(self.RECV - self.hi, max(k, hint) - (self.hi - self.lo))
            try:
                got = await self.sock.recv_into(self.view[self.hi : self.hi + want])
            except OSError as e:
                raise IncompleteReadError(f"connection broke inside a frame: {e}", k, self.hi - self.lo) from None
            if not got:
                raise IncompleteReadError("connection closed inside a frame", k, self.hi - self.lo)
            self.hi += got

    def _give_back(self) -> None:
        """Unread ciphertext returns to the raw connection's read-ahead buffer, the buffer to
        the pool."""
        if self.hi > self.lo:
            ahead = self.raw.__dict__.setdefault("_atd_buf", bytearray())
            ahead[:0] = self.view[self.lo : self.hi]
        self.lo = self.hi = 0
        _buffers.give(self.buf)
        self.buf, self.view = bytearray(), memoryview(b"")

    async def read_plain(self, length: int) -> bytearray:
        out = bytearray(length)
        ov = memoryview(out)
        first = self.session._drain(length)  # plaintext left over from the header's message
        at = len(first)
        ov[:at] = first
        self.buf = _buffers.take()
        self.view = memoryview(self.buf)
        try:
            while at < length:
                left = length - at
                hint = left + 18 * -(-left // MAX_PLAINTEXT_LENGTH)  # never past the frame's end
                await self._need(2, hint)
                n = int.from_bytes(self.view[self.lo : self.lo + 2], "big")
                if n < 16:
                    raise IncompleteReadError(f"bad Noise message length {n}", n, 0)
                await self._need(2 + n, hint)
                ct = self.view[self.lo + 2 : self.lo + 2 + n]
                plain = n - 16
                if self.cs.n >= _MAX_NONCE:
                    raise IncompleteReadError("Noise nonce exhausted", n, 0)
                nonce = self.cs.cipher.format_nonce(self.cs.n)
                try:
                    if plain <= left:
                        self.aead.decrypt_into(nonce, ct, None, ov[at : at + plain])
                    else:  # this message also starts the next frame: keep its tail for the session
                        tail = self.aead.decrypt(nonce, bytes(ct), None)
                        ov[at:] = memoryview(tail)[:left]
                        self.session._fill(tail[left:])
                        plain = left
                except InvalidTag:
                    raise IncompleteReadError("Noise message failed authentication", n, 0) from None
                self.cs.n += 1
                self.lo += 2 + n
                at += plain
        finally:
            self._give_back()
        return out


class NoiseTx:
    """Seals a large yamux DATA frame into Noise messages with one copy per byte: each
    message is encrypted (`encrypt_into`, the session's own key and nonce counter, advanced
    as `noise` does) from the caller's buffer into one output buffer (from _buffers), which
    goes out in one socket write. The messages are exactly those py-libp2p's `write_msg` makes
    (<= MAX_PLAINTEXT_LENGTH plaintext bytes each, a 2-byte length before each). Callers
    hold the connection's write lock."""

    def __init__(self, raw: Any, cipher_state: Any) -> None:
        self.raw, self.cs = raw, cipher_state
        self.aead = cipher_state.cipher.cipher

    @classmethod
    def attach(cls, session: Any) -> "NoiseTx | None":
        try:
            noise = session.conn
            raw = noise.read_writer.read_write_closer
            cs = noise.noise_state.noise_protocol.cipher_state_encrypt
            ok = (isinstance(noise, NoiseTransportReadWriter) and hasattr(cs.cipher.cipher, "encrypt_into")
                  and type(cs.n) is int and hasattr(raw, "write"))
        except AttributeError:
            ok = False
        return cls(raw, cs) if ok else None

    async def write(self, header: bytes, body: memoryview) -> None:
        total = len(header) + len(body)
        size = total + 18 * -(-total // MAX_PLAINTEXT_LENGTH)
        buf = _buffers.take() if size <= BUF_SIZE else bytearray(size)
        try:
            await self._seal_and_send(header, body, memoryview(buf))
        finally:
            if len(buf) == BUF_SIZE:
                _buffers.give(buf)

    async def _seal_and_send(self, header: bytes, body: memoryview, out: memoryview) -> None:
        lead = MAX_PLAINTEXT_LENGTH - len(header)
        src: Any = header + bytes(body[:lead])  # the first message carries the header
        at, pos = len(src) - len(header), 0
        while True:
            n = len(src) + 16
            if self.cs.n >= _MAX_NONCE:
                raise MuxedStreamError("Noise nonce exhausted")
            out[pos : pos + 2] = n.to_bytes(2, "big")
            self.aead.encrypt_into(self.cs.cipher.format_nonce(self.cs.n), src, None, out[pos + 2 : pos + 2 + n])
            self.cs.n += 1
            pos += 2 + n
            if at >= len(body):
                break
            src = body[at : at + MAX_PLAINTEXT_LENGTH]
            at += len(src)
        await self.raw.write(out[:pos])


async def grant_window(stream: Any, window: int | None = None) -> None:
    """Raise `stream`'s receive window to `window` (default RECV_WINDOW) with one
    WINDOW_UPDATE (a delta, as the spec defines it). Never raises: a stream that is
    already gone needs no window."""
    extra = (window or RECV_WINDOW) - stream.target_recv_window
    if extra <= 0:
        return
    async with stream.window_lock:
        stream.target_recv_window += extra
        stream.recv_window += extra
    try:
        await stream.send_window_update(extra)
    except Exception as e:  # connection closing: the stream is unusable anyway
        log.debug("window grant on stream %s failed: %s", stream.stream_id, e)


def _window_get(self: Any) -> int:
    return self.__dict__.get("_atd_send_window", 0)


def _window_set(self: Any, value: int) -> None:
    d = self.__dict__
    grew = value > d.get("_atd_send_window", 0)
    d["_atd_send_window"] = value
    if value > d.get("_atd_max_window", 0):
        d["_atd_max_window"] = value  # the largest window the peer ever granted (`_whole_frame_soon`)
    if grew and (ev := d.pop("_atd_window_event", None)) is not None:
        ev.set()


def _whole_frame_soon(stream: Any, want: int) -> bool:
    """Is it worth waiting for window to send `want` bytes in ONE frame instead of cutting a
    piece now? Only when the peer grants large windows (> 2 FRAME_MAX: a TunedYamux opener)
    and holds at least half of its window unread: a receiver returns credit once half its
    window is consumed (go-yamux, libp2p_pubsub.batch_yamux_credit), so credit is coming
    without anything more from us. A split costs the receiver a join of the pieces (a copy
    of the chunk) and both sides a frame and a Noise message more."""
    top = stream.__dict__.get("_atd_max_window", 0)
    return top > 2 * FRAME_MAX and top - stream.send_window >= top // 2 and stream.send_window < want


async def _wait_window(stream: Any, want: int = 1) -> None:
    """Sleep until the peer's window holds `want` bytes (or the stream closes). Without any
    window after WINDOW_WAIT seconds: MuxedStreamError, as py-libp2p's own writer does;
    with some but less than `want`, return (the caller sends a piece)."""
    with trio.move_on_after(WINDOW_WAIT) as scope:
        while stream.send_window < want and not (stream.closed or stream.send_closed):
            ev = stream.__dict__.get("_atd_window_event")
            if ev is None:
                ev = stream.__dict__["_atd_window_event"] = trio.Event()
            with trio.move_on_after(0.25):  # close/reset do not touch the window: re-check
                await ev.wait()
    if scope.cancelled_caught and stream.send_window <= 0:
        raise MuxedStreamError(f"Timed out waiting for window update after {WINDOW_WAIT:g} seconds.")


async def _tuned_write(self: Any, data: bytes) -> None:
    """YamuxStream.write for TunedYamux connections: frames of up to FRAME_MAX bytes within
    the send window, the whole write under the stream's write lock."""
    view = memoryview(data).cast("B")
    total, sent = len(view), 0
    async with self.rw_lock.write_lock():
        while sent < total:
            if self.send_closed:
                raise MuxedStreamError("Stream is closed for sending")
            if self.closed:
                raise MuxedStreamError("Stream is closed")
            whole = min(FRAME_MAX, total - sent)
            if _whole_frame_soon(self, whole):  # credit is on its way: one frame, not two pieces
                with trio.move_on_after(WHOLE_FRAME_WAIT):
                    await _wait_window(self, whole)
            n = min(self.send_window, whole)
            if n <= 0:
                await _wait_window(self)
                continue
            self.send_window -= n  # no await since the check: nothing else moved it
            await self.conn._write_data(_HEADER.pack(0, _y.TYPE_DATA, 0, self.stream_id, n), view[sent : sent + n])
            sent += n


def _coalesced_write_msg(original: Any) -> Any:
    async def write_msg(self: Any, msg: bytes, prefix_encoded: bool = False) -> None:
        """Seal `msg` in Noise messages of <= MAX_PLAINTEXT_LENGTH bytes (as py-libp2p and
        go-libp2p do) and send them all with one write."""
        if prefix_encoded or len(msg) <= MAX_PLAINTEXT_LENGTH:
            return await original(self, msg, prefix_encoded)
        view, parts = memoryview(msg), []
        for at in range(0, len(view), MAX_PLAINTEXT_LENGTH):
            sealed = self.encrypt(bytes(view[at : at + MAX_PLAINTEXT_LENGTH]))
            parts += (len(sealed).to_bytes(2, "big"), sealed)
        await self.read_writer.read_write_closer.write(b"".join(parts))

    write_msg.atd_coalesced = True
    return write_msg


def install() -> None:
    """Patch py-libp2p (idempotent): the send-window property and the tuned write path on
    YamuxStream (used only by TunedYamux connections), coalesced Noise writes (all). Must
    run before any yamux stream exists; `libp2p_transport` calls it at import."""
    S = _y.YamuxStream
    if getattr(S.write, "atd_tuned", False):
        return
    if not hasattr(MuxerMultistream, "transports"):
        log.warning("py-libp2p muxer selection changed; bulk stream tuning not applied")
        return
    needed = ("send_window", "window_lock", "rw_lock", "target_recv_window", "recv_window", "send_window_update")
    probe = S.__init__.__code__.co_names + tuple(vars(S))
    if not all(n in probe for n in needed) or not hasattr(NoiseTransportReadWriter, "write_msg"):
        log.warning("py-libp2p yamux/noise internals changed; bulk stream tuning not applied")
        return
    stock = S.write

    async def write(self: Any, data: bytes) -> None:
        if getattr(self.conn, "atd_tuned", False):
            return await _tuned_write(self, data)
        return await stock(self, data)

    write.atd_tuned = True
    new_conn = MuxerMultistream.new_conn

    async def new_conn_tuned(self: Any, conn: Any, peer_id: Any) -> Any:
        """py-libp2p builds `Yamux` by name whatever class the host was given; honour a
        Yamux subclass (TunedYamux adds no state, so it can take over the fresh object)."""
        muxed = await new_conn(self, conn, peer_id)
        want = self.transports.get(_y.PROTOCOL_ID)
        if type(muxed) is _y.Yamux and isinstance(want, type) and issubclass(want, _y.Yamux):
            muxed.__class__ = want
        return muxed

    MuxerMultistream.new_conn = new_conn_tuned
    S.send_window = property(_window_get, _window_set)
    S.write = write
    if not getattr(NoiseTransportReadWriter.write_msg, "atd_coalesced", False):
        NoiseTransportReadWriter.write_msg = _coalesced_write_msg(NoiseTransportReadWriter.write_msg)


install()
