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

Members only at every request: the server re-checks the membership gate and the
blob's reader list (`ChunkReader.allowed`, from `BlobServer.may_serve`) before each `get`,
and `BlobServer.drop_peer` closes every bulk connection of a peer at once (`BulkConns.drop`;
the daemon calls it on revocation). The server side lives in bulk_server.py and knows
nothing of the blob server: an offer gets a `ChunkReader` and the `BulkConns` registry.

Wire frame: 4-byte big-endian length, then AES-GCM ciphertext + 16-byte tag.

Why threads: py-libp2p streams (and even trio sockets, at ~64 KiB per wakeup) cost far
more CPU per byte than the bytes themselves. Each connection's socket is a blocking socket
driven from worker threads with preallocated buffers, one thread hop per batch of chunks
(up to 256), not per frame: the server reads each chunk from the file and seals its header
and data into one buffer and one send; the client (`BulkConn.fetch_batch`) receives into one
buffer, opens it into the chunk buffer (`encrypt_into` / `decrypt_into`: no allocation per
chunk) and hands it to the fetcher's sink in the same thread, which writes it; the
whole-blob SHA-256 runs in the partial blob's hasher thread, from the page cache (blobfetch.py:
each byte hashed once). The trio loop never blocks. A
cancelled server call is abandoned and its socket shut down, which ends the thread's I/O; a
cancelled client batch shuts its socket down and waits for its thread, so the sink never
runs after the fetch moved on. Where each millisecond of a frame goes:
bench/transfer_profile.py (stages alone), bench/transfer_timeline.py (a real fetch); throughput against raw TCP + SHA-256: bench/transfer_bench.py.
"""
from __future__ import annotations

import logging
import socket
import struct
from dataclasses import dataclass
from typing import Any, Callable

import outcome
import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from atdnode.transport import Counter, FrameError, StreamClosed, TransportError
from atdnode.blobs.wire import HEADER_MAX, check_chunk_header, unpack

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

    async def fetch_batch(self, header: bytes | None, chunks: list[tuple[int, int]], buf: bytearray,
                          sink: ChunkSink, more: Callable[[], bytes | None] | None = None) -> None:
        """Send one `get` request (`header`; None: sent already) and receive its chunks --
        (index, length) each -- in ONE worker thread: each is opened into `buf` and handed
        to `sink(i, view)` in that thread before the next is read (so `sink` may hash and
        write it). One thread hop per batch, not per frame; the socket's buffers keep the
        sender busy meanwhile. Once the first chunk is in, `more()` runs on the trio thread
        (`trio.from_thread`) and the request it returns, if any, is sent at once: the
        server then never waits for the next request (and a holder that never sends the
        first chunk is never asked for more). Errors from the channel or from `sink` end
        the batch and propagate; on cancellation the socket is shut down and the thread is
        waited for (it never outlives the call, so `sink` never runs after it returns)."""

        def run() -> None:
            if header is not None:
                self.f.write_frame(header)
            for k, (i, n) in enumerate(chunks):
                sink(i, memoryview(self._recv_chunk(i, n, buf)))
                if k == 0 and more is not None and (nxt := trio.from_thread.run_sync(more)) is not None:
                    self.f.write_frame(nxt)

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
