"""Ledger sync protocol: a node that was away pulls what it is missing from a peer.

Protocol `/atd/sync/1.0.0`, one request per stream, msgpack frames:

    client -> server   {"t": "heads", "heads": {author(bytes32): seq, ...}}
    server -> client   {"t": "entries", "e": [raw entry bytes, ...]}   (zero or more, each <= ~512 KiB)
    server -> client   {"t": "end", "n": total entries sent, "yours": highest seq of the
                        requester's own key in the server's log (`atdnode.own_chain`)}

The server sends, per author it knows, every entry after the client's contiguous head
(all of them for authors the client has never seen), in log order so that admissions come
before the entries of the keys they admit.

Members only (atdnode.access): a server answers a requester that is not a member of its
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
from dataclasses import dataclass, field

import msgpack
import trio

from atdnode.access import AccessRefused, is_refusal
from atdnode.ledger_access import LedgerAccess
from atdnode.own_chain import fork_evidence, held_for
from atdnode.transport.base import Stream, StreamClosed, TransportError, FrameError
from atdnode.transport.limits import DecodeBudget, PeerLimits, lease_or_reset

SYNC_PROTOCOL = "/atd/sync/1.0.0"
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


async def serve_sync(stream: Stream, ledger: LedgerAccess, limits: PeerLimits | None = None) -> None:
    """Answer one heads request on `stream` with the entries the requester lacks.

    With `limits`, a peer over its share of concurrent sync streams is reset before any
    read. Every read and write has an idle deadline (IDLE_TIMEOUT), so a silent or
    non-reading peer holds a stream (and its buffers) for a bounded time.
    """
    lease = await lease_or_reset(limits, stream, "sync") if limits is not None else None
    if limits is not None and lease is None:
        return
    try:
        with trio.fail_after(IDLE_TIMEOUT):
            msg = _decode(await stream.read_frame(MAX_SYNC_FRAME))
        heads = msg.get("heads")
        if msg["t"] != "heads" or not isinstance(heads, dict) or len(heads) > MAX_AUTHORS:
            raise SyncProtocolError("expected a heads map")
        missing, yours = await ledger.run(lambda led: (_missing_raw(led, heads), held_for(led, stream.remote_peer)))
        sent = 0
        batch: list[bytes] = []
        size = 0
        for raw in missing:
            batch.append(raw)
            size += len(raw)
            if size >= BATCH_BYTES or len(batch) >= MAX_BATCH_ENTRIES:
                with trio.fail_after(IDLE_TIMEOUT):
                    await stream.write_frame(msgpack.packb({"t": "entries", "e": batch}))
                sent += len(batch)
                batch, size = [], 0
        with trio.fail_after(IDLE_TIMEOUT):
            if batch:
                await stream.write_frame(msgpack.packb({"t": "entries", "e": batch}))
                sent += len(batch)
            await stream.write_frame(msgpack.packb({"t": "end", "n": sent, "yours": yours}))
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


def _missing_raw(led, heads: dict) -> list[bytes]:
    """Raw entries the requester with `heads` lacks, in log order; SyncProtocolError on a
    malformed heads map. Heads equal to ours (the common case once in step: every periodic
    pull between converged peers) answer at once, with no per-author work."""
    mine = led.heads()
    if heads == mine:  # equal to our (well-formed) heads, so well-formed too
        return []
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
    refusal costs no ledger-thread job (issue 24: a refused peer retrying in a loop had queued
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
    """Send our heads on `stream` and merge everything the peer returns."""
    result = SyncResult()
    heads = await ledger.run(lambda led: led.heads())
    try:
        await stream.write_frame(msgpack.packb({"t": "heads", "heads": heads}))
        while True:
            msg = _decode(await stream.read_frame(MAX_SYNC_FRAME))
            if msg["t"] == "end":
                result.yours = msg.get("yours")  # own entries the peer holds (own_chain.confirms)
                break
            if is_refusal(msg):
                if isinstance(msg.get("genesis"), bytes):
                    result.added += await ledger.merge_genesis(msg["genesis"])
                refused = AccessRefused(f"{stream.remote_peer} refused sync: {msg.get('error')!r:.80}")
                refused.added = result.added  # genesis entries new to us (0: nothing to refresh)
                raise refused
            entries = msg.get("e")
            if msg["t"] != "entries" or not isinstance(entries, list):
                raise SyncProtocolError(f"unexpected sync message {msg['t']!r}")
            if not all(isinstance(e, bytes) for e in entries):
                raise SyncProtocolError("entries must be raw bytes")
            result.received += len(entries)
            merged = await ledger.merge(entries)
            result.added += len(merged.added)
            result.added_ids.extend(merged.added)
            result.rejected += len(merged.rejected)
    except StreamClosed as exc:
        raise SyncProtocolError("peer closed the sync stream before its end marker") from exc
    finally:
        await stream.close()
    return result
