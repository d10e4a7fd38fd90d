"""Server side of the bulk channel (protocol and wire: bulk.py): offer a port, accept the
connections that prove the offer's key, serve `get` requests for one blob from its file.

The channel knows nothing of the blob server: an offer gets a `ChunkReader` (the blob's file,
who may read it -- re-checked before every request --, a hook awaited before each batch, a
counter) and the `BulkConns` registry, through which `BlobServer.drop_peer` closes every
connection of a revoked peer at once.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import trio
from cryptography.exceptions import InvalidTag

from atdnode.transport import FrameError, Stream, StreamClosed, TransportError
from atdnode.blobs.wire import HEADER_MAX, chunk_request, pack, unpack
from atdnode.blobs.bulk import (
    ACCEPT_TIMEOUT,
    HELLO,
    MAX_PENDING,
    PROVE_TIMEOUT,
    TAG,
    BulkIntegrityError,
    ConnKeys,
    SealedSocket,
    _nonce,
    _run,
    derive_keys,
    new_ephemeral,
)

log = logging.getLogger(__name__)


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
    accepting: trio.CancelScope = field(default_factory=trio.CancelScope)  # cancelled once every index is claimed


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
        lsock.setblocking(False)
        async with trio.open_nursery() as nursery:
            # Accept on the trio loop (no thread, no polling): the port closes the moment the
            # last index is proven (`offer.accepting` is cancelled) or at ACCEPT_TIMEOUT.
            offer.accepting.deadline = trio.current_time() + ACCEPT_TIMEOUT
            with offer.accepting:
                while len(offer.claimed) < conns:
                    await trio.lowlevel.wait_readable(lsock)
                    try:
                        sock, _ = lsock.accept()
                    except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                        continue
                    if offer.pending >= MAX_PENDING:
                        sock.close()  # too many unproven connections: drop the newcomer, keep the rest
                        continue
                    sock.setblocking(True)
                    offer.pending += 1
                    nursery.start_soon(_prove_and_serve, reader, registry, offer, sock, idle)
            lsock.close()  # no more connections; proven ones finish in the nursery
        served = len(offer.claimed)
    finally:
        lsock.close()
    await control.write_frame(pack({"done": True, "conns": served}))


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
        if len(offer.claimed) == len(offer.keys):
            offer.accepting.cancel()  # every index proven: stop listening now
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
