"""The blob bulk channel: AEAD-sealed frames on TCP, keyed over the authenticated libp2p stream.

Key exchange (on the Noise-authenticated, members-only `/atd/blob/1.0.0` stream):

    client -> {"op": "bulk", "blob": hex, "conns": k, "x25519": client ephemeral public key}
    server <- {"ok": true, "port": p, "x25519": server ephemeral public key}

Both sides compute X25519(ephemeral, other's ephemeral) and expand it with HKDF-SHA256
(`derive_keys`), binding the keys to the transcript: info = KEY_INFO, server peer id,
client peer id, server key, client key. Out come two 32-byte AES-256-GCM keys per
connection index 0..k-1, one per direction. A fresh ephemeral pair per offer means keys
never repeat across offers; within a connection and direction the nonce is a 96-bit
frame counter (0, 1, 2, ...), implicit on both sides, so nonces never repeat either.

Connection. The client connects to `port` on the peer's IP and sends one plaintext frame
`[index byte] + seal(HELLO)` (counter 0 of its send key for that index): this proves the
key. The server drops a connection that does not prove it within PROVE_TIMEOUT, each
waiting connection in its own task (a silent or garbage connection blocks no one; at most
MAX_PENDING wait at once), accepts each index once, and stops listening after `conns`
proven connections or ACCEPT_TIMEOUT. Then the client sends `get` requests exactly as on
a blob stream (blobwire.py) and the server answers `{"i", "n"}` + the chunk, every frame
sealed. A frame that does not decrypt under the next counter -- tampered, replayed,
reordered, truncated -- raises BulkIntegrityError and ends the connection; the fetcher
then marks the peer's bulk channel bad and falls back to libp2p streams.

Members only at every request (issue 24): the server re-checks the membership gate and the
blob's reader list (`BlobServer.may_serve`) before each `get`, and `BlobServer.drop_peer`
closes every bulk connection of a peer at once (the daemon calls it on revocation).

Wire frame: 4-byte big-endian length, then AES-GCM ciphertext + 16-byte tag.

Why threads: py-libp2p streams (and even trio sockets, at ~64 KiB per wakeup) cost far
more CPU per byte than the bytes themselves. Each connection's socket is a blocking socket
driven from worker threads (`trio.to_thread`, one call per chunk or batch), with
preallocated buffers: the server reads a chunk from the file, seals it into one buffer
and sends it; the client receives into one buffer and opens it into the chunk buffer
(`encrypt_into` / `decrypt_into`: no allocation per chunk). AES-GCM runs at several GB/s,
well above SHA-256, which the fetcher does anyway. The trio loop never blocks; a cancelled
call is abandoned and its socket shut down, which ends the thread's I/O.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import outcome
import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from atdnode.transport.base import FrameError, Stream, StreamClosed, TransportError
from atdnode.transport.blobwire import HEADER_MAX, check_chunk_header, chunk_request, pack, unpack
from atdnode.transport.framing import Counter

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
BULK_BYTES = Counter()  # every bulk connection of this process, for the daemon's /metrics (protocol "bulk")
TAG = 16
KEY_INFO = b"atd-bulk-v1"
HELLO = b"atd-bulk-hello-v1"
ACCEPT_TIMEOUT = 10.0  # server: how long an offer's port stays open
PROVE_TIMEOUT = 5.0  # server: a connection must prove the key this fast
MAX_PENDING = 16  # server: connections waiting to prove the key, per offer
MAX_CONNS = 16
SOCK_BUF = 4 << 20


class BulkIntegrityError(FrameError):
    """A bulk frame failed authentication (tampered, replayed, reordered or forged)."""


@dataclass(frozen=True)
class ConnKeys:
    client_to_server: bytes
    server_to_client: bytes


def new_ephemeral() -> tuple[X25519PrivateKey, bytes]:
    key = X25519PrivateKey.generate()
    return key, key.public_key().public_bytes_raw()


def derive_keys(private: X25519PrivateKey, other_public: bytes, *, server_peer: str, client_peer: str,
                server_pub: bytes, client_pub: bytes, conns: int) -> list[ConnKeys]:
    """Per-connection, per-direction AES-256-GCM keys (see the module docstring).

    FrameError if `other_public` is not a 32-byte X25519 key (or a low-order point)."""
    if not isinstance(other_public, bytes) or len(other_public) != 32:
        raise FrameError("bulk key exchange: the peer's X25519 key is not 32 bytes")
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(other_public))
    except ValueError as e:  # all-zero shared secret
        raise FrameError(f"bulk key exchange failed: {e}") from None
    info = b"\0".join([KEY_INFO, server_peer.encode(), client_peer.encode(), server_pub, client_pub])
    okm = HKDF(algorithm=SHA256(), length=64 * conns, salt=None, info=info).derive(shared)
    return [ConnKeys(okm[64 * i:64 * i + 32], okm[64 * i + 32:64 * i + 64]) for i in range(conns)]


async def _run(fn: Callable[..., Any], *args: Any) -> Any:
    """Run blocking socket work in a thread; on cancellation the caller closes the socket."""
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


def _nonce(n: int) -> bytes:
    return n.to_bytes(12, "big")


class SealedSocket:
    """Length-prefixed AEAD frames on a blocking socket. Thread-side only (one thread at a time)."""

    def __init__(self, sock: socket.socket, peer: str, timeout: float) -> None:
        self.sock, self.peer = sock, peer
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
            except OSError:
                pass
        self._tx: AESGCM | None = None
        self._rx: AESGCM | None = None
        self._sent = self._received = 0
        self._inbuf = bytearray(0)
        self._outbuf = bytearray(0)

    def set_keys(self, send: bytes, recv: bytes) -> None:
        self._tx, self._rx = AESGCM(send), AESGCM(recv)

    # -- raw frames ------------------------------------------------------------------

    def _exact(self, view: memoryview) -> int:
        got = 0
        try:
            while got < len(view):
                r = self.sock.recv_into(view[got:])
                if not r:
                    break
                got += r
        except socket.timeout as e:
            raise TransportError(f"bulk connection with {self.peer} stalled") from e
        except OSError as e:
            raise TransportError(f"bulk connection with {self.peer} broke: {e}") from e
        BULK_BYTES.count("bulk", received=got)
        return got

    def read_raw(self, max_size: int) -> memoryview:
        """The next frame's bytes, as a view of a reused buffer (valid until the next read)."""
        head = bytearray(_LEN.size)
        got = self._exact(memoryview(head))
        if got == 0:
            raise StreamClosed(f"bulk connection from {self.peer} closed")
        if got < _LEN.size:
            raise FrameError(f"bulk connection from {self.peer} ended inside a frame header")
        (n,) = _LEN.unpack(head)
        if n > max_size:
            raise FrameError(f"frame of {n} bytes from {self.peer} exceeds limit {max_size}")
        if len(self._inbuf) < n:
            self._inbuf = bytearray(max(n, min(max_size, 1 << 16)))
        out = memoryview(self._inbuf)[:n]
        if self._exact(out) < n:
            raise FrameError(f"bulk connection from {self.peer} ended inside a {n}-byte frame")
        return out

    def _send(self, data: bytes | bytearray | memoryview) -> None:
        try:
            self.sock.sendall(data)
            BULK_BYTES.count("bulk", sent=len(data))
        except socket.timeout as e:
            raise TransportError(f"bulk connection with {self.peer} stalled") from e
        except OSError as e:
            raise TransportError(f"bulk connection with {self.peer} broke: {e}") from e

    # -- sealed frames -----------------------------------------------------------------

    def seal(self, data: bytes | bytearray | memoryview) -> memoryview:
        """Length prefix + ciphertext of the next frame, in a reused buffer."""
        assert self._tx is not None, "keys not set"
        n = len(data) + TAG
        if len(self._outbuf) < _LEN.size + n:
            self._outbuf = bytearray(_LEN.size + n)
        out = memoryview(self._outbuf)[:_LEN.size + n]
        _LEN.pack_into(out, 0, n)
        self._tx.encrypt_into(_nonce(self._sent), data, None, out[_LEN.size:])
        self._sent += 1
        return out

    def write_frame(self, data: bytes | bytearray | memoryview) -> None:
        self._send(self.seal(data))

    def write_frames(self, head: bytes, data: bytes | bytearray | memoryview) -> None:
        """Two sealed frames (a small header, then `data`) in one buffer and one send."""
        k, n = _LEN.size + len(head) + TAG, _LEN.size + len(data) + TAG
        if len(self._outbuf) < k + n:
            self._outbuf = bytearray(k + n)
        out = memoryview(self._outbuf)[:k + n]
        for start, part in ((0, head), (k, data)):
            _LEN.pack_into(out, start, len(part) + TAG)
            self._tx.encrypt_into(_nonce(self._sent), part, None, out[start + _LEN.size:start + _LEN.size + len(part) + TAG])  # type: ignore[union-attr]
            self._sent += 1
        self._send(out)

    def read_frame(self, max_size: int, into: bytearray | None = None) -> bytearray | memoryview:
        """Open the next frame: a new bytearray, or a view of `into` (len(into) >= max_size).

        BulkIntegrityError if it does not authenticate under the next counter."""
        assert self._rx is not None, "keys not set"
        ct = self.read_raw(max_size + TAG)
        if len(ct) < TAG:
            raise BulkIntegrityError(f"bulk frame from {self.peer} is shorter than its tag")
        n = len(ct) - TAG
        out = memoryview(into)[:n] if into is not None else memoryview(bytearray(n))
        try:
            self._rx.decrypt_into(_nonce(self._received), ct, None, out)
        except InvalidTag:
            raise BulkIntegrityError(f"bulk frame {self._received} from {self.peer} failed authentication "
                                     "(tampered, replayed or reordered)") from None
        self._received += 1
        return out if into is not None else out.obj

    def close(self) -> None:
        """Shut down and close; safe from any thread, idempotent; wakes a blocked reader."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# -- client ---------------------------------------------------------------------------------


ChunkSink = Callable[[int, memoryview], None]  # (chunk index, its bytes) -> None, called in the worker thread


class BulkConn:
    """Client end of one bulk connection; same `request` / `chunk` calls as StreamChunks,
    plus `fetch_batch` (a whole request in one worker thread)."""

    def __init__(self, frames: SealedSocket) -> None:
        self.f = frames

    @classmethod
    async def open(cls, host: str, port: int, index: int, keys: ConnKeys, peer: str,
                   timeout: float = 30.0) -> "BulkConn":
        """Connect, prove the key for connection `index`; TransportError if it cannot."""

        def connect() -> SealedSocket:
            try:
                s = socket.create_connection((host, port), timeout=min(timeout, ACCEPT_TIMEOUT))
            except OSError as e:
                raise TransportError(f"bulk connect to {host}:{port} failed: {e}") from e
            f = SealedSocket(s, peer, timeout)
            f.set_keys(keys.client_to_server, keys.server_to_client)
            f._send(_LEN.pack(1 + len(HELLO) + TAG) + bytes([index]) + bytes(f.seal(HELLO)[_LEN.size:]))
            return f

        return cls(await _run(connect))

    async def request(self, header: bytes) -> None:
        await self._call(self.f.write_frame, header)

    def _recv_chunk(self, i: int, n: int, buf: bytearray | None) -> bytearray | memoryview:
        check_chunk_header(unpack(self.f.read_frame(HEADER_MAX)), i, n)
        data = self.f.read_frame(n, buf)  # longer than n: FrameError; shorter: checked here
        if len(data) != n:
            raise FrameError(f"sent {len(data)} bytes for chunk {i}, expected {n}")
        return data

    async def chunk(self, i: int, n: int, buf: bytearray | None = None) -> bytearray | memoryview:
        """Chunk i (exactly n bytes), opened into `buf` when given (no allocation per chunk)."""
        return await self._call(self._recv_chunk, i, n, buf)

    async def fetch_batch(self, header: bytes, chunks: list[tuple[int, int]], buf: bytearray,
                          sink: ChunkSink) -> None:
        """Send one `get` request (`header`) and receive its chunks -- (index, length) each --
        in ONE worker thread: each is opened into `buf` and handed to `sink(i, view)` in
        that thread before the next is read (so `sink` may hash and write it). One thread
        hop per batch, not per frame; the socket's buffers keep the sender busy meanwhile.
        Errors from the channel or from `sink` end the batch and propagate; on cancellation
        the socket is shut down and the thread is waited for (it never outlives the call,
        so `sink` never runs after it returns)."""

        def run() -> None:
            self.f.write_frame(header)
            for i, n in chunks:
                sink(i, memoryview(self._recv_chunk(i, n, buf)))

        await _run_closing(run, self.f.close)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await _run(fn, *args)
        except BaseException:
            self.f.close()  # a cancelled (abandoned) thread must not keep using the socket
            raise

    async def close(self) -> None:
        self.f.close()
        await trio.lowlevel.checkpoint()

    async def reset(self) -> None:
        await self.close()


async def _run_closing(fn: Callable[[], Any], close: Callable[[], None]) -> Any:
    """Run `fn` in a worker thread and wait for it even when cancelled: a cancellation calls
    `close()` (which must make `fn` return soon, e.g. by shutting its socket down) and then
    waits for the thread, so nothing `fn` touches is used after this returns."""
    finished = False

    async def closer() -> None:
        try:
            await trio.sleep_forever()
        finally:
            if not finished:
                close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(closer)
        result = await outcome.acapture(trio.to_thread.run_sync, fn)  # not abandoned: closer() unblocks it
        finished = True
        nursery.cancel_scope.cancel()
    return result.unwrap()  # raised out here, not wrapped in the nursery's ExceptionGroup


# -- server ----------------------------------------------------------------------------------


@dataclass
class ChunkReader:
    """The blob one offer serves, as the bulk channel sees it (the blob server builds one):
    its file (read in worker threads, by byte ranges of the client's chunk size), who may
    read it (re-checked before every request), a hook awaited before each batch, and a
    counter callback (chunks, bytes) after each."""

    blob: str
    path: Path
    allowed: Callable[[str], bool]
    before_batch: Callable[[str, list[int]], Awaitable[None]] | None = None
    served: Callable[[int, int], None] = lambda chunks, nbytes: None


class BulkConns:
    """The proven bulk connections being served, by peer: `drop(peer)` closes them at once."""

    def __init__(self) -> None:
        self._by_peer: dict[str, set[SealedSocket]] = {}

    def add(self, frames: SealedSocket) -> None:
        self._by_peer.setdefault(frames.peer, set()).add(frames)

    def discard(self, frames: SealedSocket) -> None:
        conns = self._by_peer.get(frames.peer, set())
        conns.discard(frames)
        if not conns:
            self._by_peer.pop(frames.peer, None)

    def peers(self) -> list[str]:
        return list(self._by_peer)

    def drop(self, peer: str) -> int:
        """Close every connection of `peer`; safe from the trio thread (closing wakes the
        worker thread blocked on the socket). Returns how many."""
        conns = self._by_peer.pop(peer, set())
        for frames in conns:
            frames.close()
        return len(conns)


@dataclass
class _Offer:
    keys: list[ConnKeys]
    peer: str
    claimed: set[int] = field(default_factory=set)
    pending: int = 0


async def serve_bulk(reader: ChunkReader, registry: BulkConns, control: Stream, conns: int, client_pub: bytes, *,
                     local_peer: str, bind: str, port: int, idle: float) -> None:
    """Offer a port on `control` (key exchange), serve `reader`'s blob to up to `conns`
    key-proving connections; each is in `registry` while it is served."""
    private, server_pub = new_ephemeral()
    keys = derive_keys(private, client_pub, server_peer=local_peer, client_peer=control.remote_peer,
                       server_pub=server_pub, client_pub=client_pub, conns=conns)
    offer = _Offer(keys, control.remote_peer)
    try:
        lsock = socket.create_server((bind, port))
    except OSError as e:
        log.warning("bulk channel: cannot listen on %s:%d: %s", bind, port, e)
        await control.write_frame(pack({"ok": False, "error": "bulk channel unavailable"}))
        return
    served = 0
    try:
        await control.write_frame(pack({"ok": True, "port": lsock.getsockname()[1], "x25519": server_pub}))
        async with trio.open_nursery() as nursery:
            deadline = trio.current_time() + ACCEPT_TIMEOUT
            while len(offer.claimed) < conns and (left := deadline - trio.current_time()) > 0:
                try:
                    sock = await _run(_accept, lsock, min(left, 0.5))
                except TimeoutError:
                    continue
                if offer.pending >= MAX_PENDING:
                    sock.close()  # too many unproven connections: drop the newcomer, keep the rest
                    continue
                offer.pending += 1
                nursery.start_soon(_prove_and_serve, reader, registry, offer, sock, idle)
            lsock.close()  # no more connections; proven ones finish in the nursery
        served = len(offer.claimed)
    finally:
        lsock.close()
    await control.write_frame(pack({"done": True, "conns": served}))


def _accept(lsock: socket.socket, wait: float) -> socket.socket:
    lsock.settimeout(wait)
    sock, _ = lsock.accept()  # TimeoutError when nobody came
    return sock


def _read_hello(frames: SealedSocket, offer: _Offer) -> int:
    raw = frames.read_raw(1 + len(HELLO) + TAG)
    if len(raw) != 1 + len(HELLO) + TAG:
        raise BulkIntegrityError(f"bulk hello of {len(raw)} bytes")
    index = raw[0]
    if index >= len(offer.keys):
        raise BulkIntegrityError(f"bulk connection index {index} out of range")
    keys = offer.keys[index]
    frames.set_keys(keys.server_to_client, keys.client_to_server)
    try:
        hello = frames._rx.decrypt(_nonce(0), bytes(raw[1:]), None)  # type: ignore[union-attr]
    except InvalidTag:
        raise BulkIntegrityError("bulk connection did not prove the session key") from None
    if hello != HELLO:
        raise BulkIntegrityError("bulk connection sent a wrong hello")
    frames._received = 1
    return index


async def _prove_and_serve(reader: ChunkReader, registry: BulkConns, offer: _Offer, sock: socket.socket,
                           idle: float) -> None:
    frames = SealedSocket(sock, offer.peer, PROVE_TIMEOUT)
    try:
        try:
            with trio.fail_after(PROVE_TIMEOUT + 1):
                index = await _run(_read_hello, frames, offer)
        except (TransportError, trio.TooSlowError) as e:
            log.warning("bulk connection (offered to %s) dropped before proving its key: %s", offer.peer, e)
            frames.close()
            return
        finally:
            offer.pending -= 1
        if index in offer.claimed:
            log.warning("bulk connection index %d for %s used twice (replay?); refused", index, offer.peer)
            frames.close()
            return
        offer.claimed.add(index)
        frames.sock.settimeout(idle)
        registry.add(frames)  # BlobServer.drop_peer closes it
        try:
            await _serve_conn(reader, frames)
        finally:
            registry.discard(frames)
    finally:
        frames.close()


async def _serve_conn(reader: ChunkReader, frames: SealedSocket) -> None:
    blob = reader.blob
    try:
        while True:
            try:
                raw = await _run(frames.read_frame, HEADER_MAX)
            except StreamClosed:
                return
            req = unpack(raw)
            if req.get("op") != "get" or req.get("blob") != blob:
                raise FrameError(f"bulk connection may only get blob {blob[:12]}")
            if not reader.allowed(frames.peer):  # every request: revoked since the offer?
                log.warning("bulk connection from %s closed: no longer allowed to read %s", frames.peer, blob[:12])
                return
            cs, idx = chunk_request(req)
            if reader.before_batch is not None:
                await reader.before_batch(frames.peer, idx)
            reader.served(*await _run(_send_ranges, frames, reader.path, cs, idx))
    except FrameError as e:
        log.warning("bulk connection from %s closed: %s", frames.peer, e)
    except TransportError as e:
        log.debug("bulk connection from %s ended: %s", frames.peer, e)
    finally:
        frames.close()


def _send_ranges(frames: SealedSocket, path: os.PathLike, cs: int, idx: list[int]) -> tuple[int, int]:
    sent = nbytes = 0
    buf = bytearray(cs)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        for i in idx:
            off = i * cs
            if off >= size:
                frames.write_frame(pack({"i": i, "error": "chunk index out of range"}))
                continue
            n = min(cs, size - off)
            view = memoryview(buf)[:n]
            f.seek(off)
            if f.readinto(view) != n:
                raise TransportError(f"blob file shrank while sending to {frames.peer}")
            frames.write_frames(pack({"i": i, "n": n}), view)
            sent, nbytes = sent + 1, nbytes + n
    return sent, nbytes
