"""Hostile peers below the application, for tests and benchmarks: dials a node refuses,
members that come and go, and a writer that ignores the yamux receive window.

Each speaks the real wire (TCP, multistream-select, Noise, yamux) with py-libp2p's own
pieces, so what the node sees is what a hostile peer would send:

* `dial_cycles`: `n` dials, each a full Noise + yamux upgrade, then either waiting for the
  node to close the connection (an outsider its membership gate refuses) or, as a member
  that leaves, closing it once the node has opened its first stream to us;
* `flood_stream`: a py-libp2p host (stock yamux) that waits for the stream the node opens
  to it for a protocol (GossipSub's: the pubsub stream a node opens to every member and only
  writes on) and writes DATA frames on it, past the window the node granted or within it.

Measure the node's memory with `track_peak_rss` when it runs in this process.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE, Transport as NoiseTransport
from libp2p.stream_muxer.yamux import yamux as _y
from libp2p.transport.tcp.tcp import TCP
from libp2p.transport.upgrader import TransportUpgrader

MiB = 1 << 20
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _security(seed: bytes) -> tuple[object, dict]:
    kp = create_new_key_pair(seed)
    return kp, {NOISE: NoiseTransport(kp, noise_privkey=create_x25519_key_pair().private_key)}


@dataclass
class DialStats:
    dials: int = 0
    upgraded: int = 0  # Noise and yamux negotiated: the node accepted the connection
    closed_by_node: int = 0  # ... and then closed it (refused) while we waited
    left: int = 0  # ... and opened a stream to us, and we closed it (a member leaving)
    held: int = 0  # ... and kept it open for the whole wait
    failed: int = 0  # TCP, Noise or yamux negotiation failed (refused before the upgrade)


async def dial_cycles(addr: str, seed: bytes, n: int, *, concurrency: int = 4, leave: bool = False,
                      wait: float = 10.0) -> DialStats:
    """Dial the node at `addr` (a multiaddr ending in /p2p/<id>) `n` times, `concurrency`
    at a time, with the Ed25519 key of `seed`; each dial upgrades to Noise + yamux, then waits
    up to `wait` s for the node to close it, or (`leave`) for the node's first stream, and
    then closes it (a member's connections come one at a time: the node opens its streams to a
    peer once, on its first connection, so use `concurrency=1` with `leave`). Returns what
    happened to the dials."""
    info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
    target = info.addrs[0]
    _, sec = _security(seed)
    upgrader = TransportUpgrader(sec, {_y.PROTOCOL_ID: _y.Yamux})
    stats = DialStats()
    limit = trio.CapacityLimiter(concurrency)

    async def one() -> None:
        async with limit:
            stats.dials += 1
            try:
                raw = await TCP().dial(target)
            except Exception:
                stats.failed += 1
                return
            try:
                await _upgraded(raw, upgrader, info.peer_id, stats, leave, wait)
            finally:
                try:
                    await raw.close()
                except Exception:  # already closed by the node
                    pass

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return stats


async def _upgraded(raw: object, upgrader: TransportUpgrader, peer: ID, stats: DialStats, leave: bool,
                    wait: float) -> None:
    try:
        muxed = await upgrader.upgrade_connection(await upgrader.upgrade_security(raw, True, peer), peer)
    except Exception:
        stats.failed += 1
        return
    stats.upgraded += 1
    got_stream = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(muxed.start)
        with trio.move_on_after(wait):
            if leave:
                try:
                    await muxed.accept_stream()
                    got_stream = True
                except Exception:  # the node closed the connection before any stream
                    pass
            if not got_stream:
                await muxed.event_closed.wait()
        nursery.cancel_scope.cancel()  # the caller closes the socket: we leave, or it is gone
    if got_stream:
        stats.left += 1
    elif muxed.event_closed.is_set():
        stats.closed_by_node += 1
    else:
        stats.held += 1


@dataclass
class FloodStats:
    sent: int = 0  # payload bytes written (some may still sit in socket buffers when refused)
    frames: int = 0
    granted: int = 0  # the stream's send window when the first frame went out
    closed_by_node: bool = False  # the node closed the connection during the flood
    seconds: float = 0.0
    rss_growth: int = 0  # peak RSS of this process during the flood, less its RSS before


async def flood_stream(addr: str, seed: bytes, *, total: int, frame: int = MiB, within_window: bool = False,
                       protocol: str = PROTOCOL_ID_V11, stall: float = 1.0, timeout: float = 120.0) -> FloodStats:
    """Connect to the node at `addr` as a py-libp2p host with the key of `seed` (stock yamux),
    wait for the stream the node opens to us for `protocol`, and write up to `total` bytes on
    it in DATA frames of `frame` bytes: past the window the node granted (raw frames), or
    (`within_window`) never past it, giving up once the window stayed shut for `stall` s.
    Stops early when the node closes the connection; within `timeout` s in any case.
    `rss_growth` is this process's: the node's when it runs here."""
    kp, sec = _security(seed)
    host = new_host(key_pair=kp, sec_opt=sec, muxer_opt={_y.PROTOCOL_ID: _y.Yamux})
    opened: list[object] = []
    ready, done = trio.Event(), trio.Event()

    async def handler(stream: object) -> None:
        opened.append(stream)
        ready.set()
        await done.wait()  # keep the node's stream open while we write on it

    host.set_stream_handler(protocol, handler)
    stats = FloodStats()
    payload = os.urandom(frame)
    async with host.run([multiaddr.Multiaddr(LOOPBACK)]):
        try:
            with trio.move_on_after(timeout):
                await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                await ready.wait()
                ys = opened[0].muxed_stream
                stats.granted = ys.send_window
                peak = [rss_bytes()]
                before = peak[0]
                start = trio.current_time()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(track_peak_rss, peak)
                    stats.closed_by_node = await _write_frames(ys, payload, total, within_window, stall, stats)
                    nursery.cancel_scope.cancel()
                stats.seconds = trio.current_time() - start
                stats.rss_growth = max(peak[0], rss_bytes()) - before
        finally:
            done.set()
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await host.get_network().close()  # the host's own shutdown leaves sockets open
    return stats


async def _write_frames(ys: object, payload: bytes, total: int, within_window: bool, stall: float,
                        stats: FloodStats) -> bool:
    """Write the flood's DATA frames; True when the node closed the connection."""
    conn = ys.conn
    while stats.sent < total:
        if conn.event_closed.is_set():
            return True
        n = min(len(payload), total - stats.sent)
        if within_window:
            with trio.move_on_after(stall):
                while ys.send_window <= 0 and not conn.event_closed.is_set():
                    await trio.sleep(0.005)
            n = min(n, ys.send_window)
            if n <= 0:
                return conn.event_closed.is_set()  # the node returns no credit on this stream
            ys.send_window -= n
        header = struct.pack(_y.YAMUX_HEADER_FORMAT, 0, _y.TYPE_DATA, 0, ys.stream_id, n)
        try:
            await conn._write_frame(header + payload[:n])
        except Exception:  # the node closed the connection
            return True
        stats.sent += n
        stats.frames += 1
    return conn.event_closed.is_set()


def members_only(seed: bytes, members: list[bytes], *, muxer: type | None = None) -> object:
    """A (not yet running) `Libp2pTransport` with the key of `seed` whose peer gate admits the
    keys of `members` only, as a daemon's membership gate does; `muxer`: its yamux class."""
    from atdnode.transport import Libp2pTransport

    node = Libp2pTransport(seed)
    if muxer is not None:
        node.muxer = muxer
    allowed = {Libp2pTransport(m).peer_id for m in members}
    node.set_peer_gate(lambda peer: peer in allowed)
    return node


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def track_peak_rss(peak: list[int], every: float = 0.005) -> None:
    """Keep `peak[0]` at the highest RSS of this process seen every `every` s (until cancelled)."""
    while True:
        peak[0] = max(peak[0], rss_bytes())
        await trio.sleep(every)
