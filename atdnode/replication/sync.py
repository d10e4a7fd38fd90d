"""Ledger sync protocol: a node that was away pulls what it is missing from a peer.

Two versions, one request per stream, msgpack frames. A node serves both; it pulls with
v2 and falls back to v1 for a peer that does not speak v2 (`SyncVersions`), so a
consortium upgrades one daemon at a time.

Version 2, `/atd/sync/2.0.0`, digest first (`atdnode.replication.sync_digest`):

    client -> server   {"t": "digest", "b": digest vector of the client's heads (2,048 bytes)}
    server -> client   {"t": "end", "n": 0, "yours": ...}             when the vectors are equal, else
    server -> client   {"t": "want", "b": bytes: indices of the buckets whose digests differ}
    client -> server   {"t": "heads", "heads": {author: seq} for the authors in those buckets only}
    then as in v1: "entries" frames for those buckets' authors, and "end".

A pull between peers in step is one small frame each way with no per-author work; when
they differ, only the differing buckets' heads cross the wire (with 1,000 authors a
v1 heads map is ~40 KB on every pull, and decoding and comparing it was most of a no-op
pull's ~1.2 ms of CPU).

Version 1, `/atd/sync/1.0.0`:

    client -> server   {"t": "heads", "heads": {author(bytes32): seq, ...}}
    server -> client   {"t": "entries", "e": [raw entry bytes, ...]}   (zero or more, each <= ~512 KiB)
    server -> client   {"t": "end", "n": total entries sent, "yours": highest seq of the
                        requester's own key in the server's log (`atdnode.replication.own_chain`)}

The server sends, per author it knows, every entry after the client's contiguous head
(all of them for authors the client has never seen), in log order so that admissions come
before the entries of the keys they admit.

Members only (atdnode.replication.access): a server answers a requester that is not a member of its
consortium, before reading its request, with one refusal frame
`{"t": "refused", "error": str, "genesis": raw genesis entry}` -- the genesis entry is
the one thing an outsider may have, so that a joiner can bootstrap. `pull` merges that
genesis entry (the same bytes again cost no ledger job: `LedgerAccess.merge_genesis`) and
raises AccessRefused (its `added`: entries the refusal added). The client merges each batch as it
arrives; merging is idempotent and order-independent, so overlapping pulls, gossip
arriving meanwhile, or an interrupted pull (retried later) are all harmless.
Database work runs in worker threads so the trio loop never blocks.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import msgpack
import trio

from atdnode.replication.access import AccessRefused, is_refusal
from atdnode.replication.ledger_access import LedgerAccess
from atdnode.replication.own_chain import fork_evidence, held_by, held_for
from atdnode.replication.sync_connect import ahead_of
from atdnode.replication.sync_digest import VECTOR_BYTES, differing, digest_vector, in_buckets
from atdnode.transport import (DecodeBudget, FrameError, PeerLimits, Stream, StreamClosed, Transport, TransportError,
                               lease_or_reset)

SYNC_PROTOCOL = "/atd/sync/1.0.0"
SYNC_PROTOCOL_V2 = "/atd/sync/2.0.0"
SYNC_PROTOCOLS = (SYNC_PROTOCOL_V2, SYNC_PROTOCOL)  # served, newest first
RETRY_V2_S = 600.0  # a peer that spoke only v1 is asked on v2 again after this long
MAX_REMEMBERED = 4096  # peers whose version SyncVersions remembers
BATCH_BYTES = 512 << 10
MAX_SYNC_FRAME = 2 << 20
MAX_AUTHORS = 100_000
MAX_BATCH_ENTRIES = 16_384  # entries per "entries" frame (a server also stops at BATCH_BYTES)
IDLE_TIMEOUT = 30.0  # server: a stream silent (or not reading) this long is reset
PER_PEER_STREAMS = 4  # server: concurrent sync streams one peer may hold ...
TOTAL_STREAMS = 64  # ... and all peers together (see atdnode.transport.limits)

log = logging.getLogger(__name__)


class SyncProtocolError(TransportError):
    """A peer sent a sync message that does not follow the protocol."""


@dataclass
class SyncResult:
    received: int = 0
    added: int = 0
    rejected: int = 0
    added_ids: list[bytes] = field(default_factory=list)  # entries the peer held and we lacked
    yours: object = None  # the peer's head for our own key (its end marker; None from older peers)


def _decode(frame: bytes) -> dict:
    """Decode one sync frame: a map holding at most one nested map (heads) or array (entries)."""
    budget = DecodeBudget(maps=2, lists=1)
    try:
        msg = msgpack.unpackb(
            frame, raw=False, strict_map_key=False, object_hook=budget.map, list_hook=budget.list,
            max_map_len=MAX_AUTHORS, max_array_len=MAX_BATCH_ENTRIES, max_str_len=4096,
            max_bin_len=MAX_SYNC_FRAME, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise SyncProtocolError(f"undecodable sync frame: {str(exc)[:200]}") from exc
    if not isinstance(msg, dict) or "t" not in msg:
        raise SyncProtocolError("sync frame is not a typed map")
    return msg


async def serve_sync(stream: Stream, ledger: LedgerAccess, limits: PeerLimits | None = None,
                     observe: Callable[[str, bool], None] | None = None) -> None:
    """Answer one request on `stream` (v1 or v2, by the stream's protocol) with the entries
    the requester lacks.

    `observe(peer, ahead)` is told, once the request was compared with our ledger, whether
    the requester holds anything we lack (`atdnode.replication.sync_connect`: the dialled end of a new
    connection skips its own pull on that evidence).

    With `limits`, a peer over its share of concurrent sync streams is reset before any
    read. Every read and write has an idle deadline (IDLE_TIMEOUT), so a silent or
    non-reading peer holds a stream (and its buffers) for a bounded time.
    """
    lease = await lease_or_reset(limits, stream, "sync") if limits is not None else None
    if limits is not None and lease is None:
        return
    try:
        if stream.protocol == SYNC_PROTOCOL_V2:
            await _serve_v2(stream, ledger, observe or _ignore)
        else:
            await _serve_v1(stream, ledger, observe or _ignore)
    except (SyncProtocolError, FrameError) as exc:
        log.warning("sync request from %s refused: %s", stream.remote_peer, exc)
        await stream.reset()
        return
    except trio.TooSlowError:
        log.info("sync stream from %s idle for %.0f s; reset", stream.remote_peer, IDLE_TIMEOUT)
        await stream.reset()
        return
    except TransportError as exc:
        log.info("sync stream to %s ended early: %s", stream.remote_peer, exc)
    finally:
        if lease is not None:
            lease.release()
        await stream.close()


async def _read(stream: Stream) -> dict:
    with trio.fail_after(IDLE_TIMEOUT):
        return _decode(await stream.read_frame(MAX_SYNC_FRAME))


async def _write(stream: Stream, msg: dict) -> None:
    with trio.fail_after(IDLE_TIMEOUT):
        await stream.write_frame(msgpack.packb(msg))


def _heads_of(msg: dict) -> dict:
    heads = msg.get("heads")
    if msg["t"] != "heads" or not isinstance(heads, dict) or len(heads) > MAX_AUTHORS:
        raise SyncProtocolError("expected a heads map")
    return heads


def _ignore(_peer: str, _ahead: bool) -> None:
    pass


async def _serve_v1(stream: Stream, ledger: LedgerAccess, observe: Callable[[str, bool], None]) -> None:
    heads = _heads_of(await _read(stream))

    def answer(led) -> tuple[list[bytes], int, bool]:
        missing = _missing_raw(led, heads)  # validates `heads` first
        return missing, held_for(led, stream.remote_peer), ahead_of(led.heads(copy=False), heads)

    missing, yours, ahead = await ledger.run(answer)
    observe(stream.remote_peer, ahead)
    await _send_entries(stream, missing, yours)


async def _serve_v2(stream: Stream, ledger: LedgerAccess, observe: Callable[[str, bool], None]) -> None:
    msg = await _read(stream)
    theirs = msg.get("b")
    if msg["t"] != "digest" or not isinstance(theirs, bytes) or len(theirs) != VECTOR_BYTES:
        raise SyncProtocolError("expected a digest vector")
    mine, heads_here = await ledger.run(digest_vector)
    yours = held_by(heads_here, stream.remote_peer)
    wanted = differing(mine, theirs)
    if not wanted:
        observe(stream.remote_peer, False)  # in step
        await _write(stream, {"t": "end", "n": 0, "yours": yours})
        return
    await _write(stream, {"t": "want", "b": bytes(wanted)})
    heads = _heads_of(await _read(stream))
    buckets = frozenset(wanted)
    if any(isinstance(a, bytes) and a[:1] and a[0] not in buckets for a in heads):
        raise SyncProtocolError("heads of a bucket that was not asked for")
    missing, yours = await ledger.run(lambda led: (_missing_raw(led, heads, buckets), held_for(led, stream.remote_peer)))
    observe(stream.remote_peer, ahead_of(heads_here, heads))  # (validated by _missing_raw)
    await _send_entries(stream, missing, yours)


async def _send_entries(stream: Stream, missing: list[bytes], yours: int) -> None:
    """"entries" frames of at most BATCH_BYTES / MAX_BATCH_ENTRIES, then the end marker."""
    sent = 0
    batch: list[bytes] = []
    size = 0
    for raw in missing:
        batch.append(raw)
        size += len(raw)
        if size >= BATCH_BYTES or len(batch) >= MAX_BATCH_ENTRIES:
            await _write(stream, {"t": "entries", "e": batch})
            sent += len(batch)
            batch, size = [], 0
    if batch:
        await _write(stream, {"t": "entries", "e": batch})
        sent += len(batch)
    await _write(stream, {"t": "end", "n": sent, "yours": yours})


def _missing_raw(led, heads: dict, buckets: frozenset[int] | None = None) -> list[bytes]:
    """Raw entries the requester with `heads` lacks, in log order; SyncProtocolError on a
    malformed heads map. Heads equal to ours (the common case once in step: every periodic
    v1 pull between converged peers) answer at once, with no per-author work. `buckets`
    (v2): only authors in these digest buckets (`sync_digest.bucket_of`) are looked at."""
    mine = led.heads(copy=False)  # read only (the cached map)
    if heads == mine:  # equal to our (well-formed) heads, so well-formed too
        return []
    if buckets is not None:
        mine = in_buckets(mine, buckets)
    theirs: dict[bytes, int] = {}
    for author, seq in heads.items():
        if not isinstance(author, bytes) or len(author) != 32 or not isinstance(seq, int):
            raise SyncProtocolError("malformed heads entry")
        theirs[author] = seq
    out = []
    for author, seq in mine.items():
        have = theirs.get(author, 0)
        if have < seq:
            out.extend(led.entries_after(author, have))
    out.extend(fork_evidence(led, theirs))  # a requester on one side of a fork we know of learns it
    out.sort(key=lambda e: (e.lamport, e.author, e.seq))  # log order: admissions first
    return [e.to_bytes() for e in out]


async def genesis_extra(ledger: LedgerAccess) -> dict:
    """The refusal's payload for a non-member: the genesis entry, if we have it."""

    def genesis(led) -> bytes | None:
        g = led.query(kind="genesis")
        return g[0].to_bytes() if g else None

    raw = await ledger.run(genesis)
    return {} if raw is None else {"genesis": raw}


class CachedGenesis:
    """`genesis_extra` read from the ledger once: the genesis entry never changes, so serving a
    refusal costs no ledger-thread job (a refused peer retrying in a loop had queued
    95 s of ledger work on a member). Awaitable like `genesis_extra(ledger)`."""

    def __init__(self, ledger: LedgerAccess) -> None:
        self.ledger = ledger
        self._extra: dict | None = None

    async def __call__(self) -> dict:
        if self._extra is None:
            extra = await genesis_extra(self.ledger)
            if not extra:  # no genesis yet (a home still joining): ask again next time
                return extra
            self._extra = extra
        await trio.lowlevel.checkpoint()
        return self._extra


async def pull(stream: Stream, ledger: LedgerAccess) -> SyncResult:
    """Ask the peer on `stream` for what we lack (v2: digest first; v1: our whole heads map,
    by the stream's protocol) and merge everything it returns, batch by batch."""
    result = SyncResult()
    try:
        if stream.protocol == SYNC_PROTOCOL_V2:
            vector, heads = await ledger.run(digest_vector)
            await stream.write_frame(msgpack.packb({"t": "digest", "b": vector}))
            msg = await _answer(stream, ledger, result)
            if msg["t"] == "end":
                result.yours = msg.get("yours")
                return result
            want = msg.get("b")
            if msg["t"] != "want" or not isinstance(want, bytes) or not want:
                raise SyncProtocolError(f"unexpected sync message {msg['t']!r}")
            buckets = frozenset(want)
            heads = in_buckets(heads, buckets)
        else:
            heads = await ledger.run(lambda led: led.heads())
        await stream.write_frame(msgpack.packb({"t": "heads", "heads": heads}))
        while True:
            msg = await _answer(stream, ledger, result)
            if msg["t"] == "end":
                result.yours = msg.get("yours")  # own entries the peer holds (own_chain.confirms)
                break
            entries = msg.get("e")
            if msg["t"] != "entries" or not isinstance(entries, list):
                raise SyncProtocolError(f"unexpected sync message {msg['t']!r}")
            if not all(isinstance(e, bytes) for e in entries):
                raise SyncProtocolError("entries must be raw bytes")
            result.received += len(entries)
            merged = await ledger.merge(entries)  # one transaction per batch
            result.added += len(merged.added)
            result.added_ids.extend(merged.added)
            result.rejected += len(merged.rejected)
    except StreamClosed as exc:
        raise SyncProtocolError("peer closed the sync stream before its end marker") from exc
    finally:
        await stream.close()
    return result


async def _answer(stream: Stream, ledger: LedgerAccess, result: SyncResult) -> dict:
    """The server's next frame; a refusal (members only) merges its genesis entry and raises
    AccessRefused (its `added`: entries the refusal added)."""
    msg = _decode(await stream.read_frame(MAX_SYNC_FRAME))
    if is_refusal(msg):
        if isinstance(msg.get("genesis"), bytes):
            result.added += await ledger.merge_genesis(msg["genesis"])
        refused = AccessRefused(f"{stream.remote_peer} refused sync: {msg.get('error')!r:.80}")
        refused.added = result.added  # genesis entries new to us (0: nothing to refresh)
        raise refused
    return msg


class SyncVersions:
    """The sync version to pull each peer with: v2, unless opening a v2 stream to that peer
    failed lately while v1 worked (an older daemon): then v1 for RETRY_V2_S before v2 is
    tried again (the peer may have been upgraded). Bounded: at most MAX_REMEMBERED peers."""

    def __init__(self) -> None:
        self._v1_until: dict[str, float] = {}

    def speaks_v1_only(self, peer_id: str) -> bool:
        return self._v1_until.get(peer_id, -math.inf) > trio.current_time()

    async def open(self, transport: Transport, peer_id: str) -> Stream:
        """A sync stream to `peer_id` (v2 where it works); TransportError when neither opens."""
        if not self.speaks_v1_only(peer_id):
            try:
                return await transport.open_stream(peer_id, SYNC_PROTOCOL_V2)
            except TransportError as exc:
                v2_error = exc
            stream = await transport.open_stream(peer_id, SYNC_PROTOCOL)  # raises when the peer is away
            log.info("peer %s does not speak sync v2 (%s); pulling with v1", peer_id, str(v2_error)[:120])
            if len(self._v1_until) >= MAX_REMEMBERED:
                self._v1_until.pop(next(iter(self._v1_until)))
            self._v1_until[peer_id] = trio.current_time() + RETRY_V2_S
            return stream
        return await transport.open_stream(peer_id, SYNC_PROTOCOL)
