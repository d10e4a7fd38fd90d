"""Mixed sync versions between real daemons: one daemon speaks only the previous
version's wire (`/atd/sync/1.0.0`, the whole heads map), two speak the digest-first v2 and
v1; every ledger converges, in both directions, through sync alone.

Real `NodeDaemon`s (SQLite ledgers, signatures) over real libp2p on 127.0.0.1 in one trio
run. The older daemon is the current code behind a transport that neither serves nor opens
`/atd/sync/2.0.0` (`V1OnlyTransport`): on the wire it is a daemon from before v2 (v1's
frames did not change). The entries that must cross are authored by two members that never
run a daemon and are merged into one daemon's ledger before it starts, so no daemon gossips
them: they reach the others only through sync pulls. From the older daemon to the current
ones that takes the v2 -> v1 fallback (`atdnode.replication.sync.SyncVersions`); from the current ones
to the older one it takes their v1 service. Break either and the test times out
(checked by hand: a `SyncVersions.open` without the fallback, a daemon serving only v2).

`tests/test_sync_versions.py` covers the same protocol on the in-memory transport, entry by
entry; this one the daemon wiring (handlers registered, on-connect and periodic pulls).
"""
from __future__ import annotations

from pathlib import Path

import trio

from atdnode.node import NodeDaemon, NodeIdentity
from atdnode.replication import SYNC_PROTOCOL
from atdnode.replication.sync import SYNC_PROTOCOL_V2
from atdnode.transport import Libp2pTransport, Stream, TransportError
from ledger import Ledger, Signer
from netsim.homes import make_consortium
from tests.factories import wait_for

LISTEN = ["/ip4/127.0.0.1/tcp/0"]
SYNC_PROTOCOLS = (SYNC_PROTOCOL, SYNC_PROTOCOL_V2)


class RecordingTransport(Libp2pTransport):
    """Libp2p, recording the sync protocol of every stream it serves; `v1_only`: the wire of a
    daemon from before sync v2 (v2 is neither served nor asked for)."""

    def __init__(self, *args, v1_only: bool = False, **kw) -> None:
        super().__init__(*args, **kw)
        self.v1_only = v1_only
        self.served: list[str] = []  # protocol of each sync stream served

    def set_stream_handler(self, protocol: str, handler) -> None:
        if protocol not in SYNC_PROTOCOLS:
            return super().set_stream_handler(protocol, handler)
        if self.v1_only and protocol == SYNC_PROTOCOL_V2:
            return None  # an older daemon: a v2 request finds no handler (multistream says "na")

        async def recorded(stream: Stream) -> None:
            self.served.append(protocol)
            await handler(stream)

        return super().set_stream_handler(protocol, recorded)

    async def open_stream(self, peer_id: str, protocol: str) -> Stream:
        if self.v1_only and protocol == SYNC_PROTOCOL_V2:  # an older daemon never asks for v2
            raise TransportError(f"{protocol} unknown to this (older) daemon")
        return await super().open_stream(peer_id, protocol)


def _ids(d: NodeDaemon) -> set[bytes]:
    with Ledger.open(d.home.ledger_db) as led:
        return {e.id for e in led.all_entries()}


def _offline_entries(c, author: str, holder: str, n: int) -> set[bytes]:
    """`n` entries signed by member `author` (whose daemon never runs), merged into `holder`'s
    ledger only: no daemon gossips them (none authored them)."""
    signer = Signer.from_seed(c.seeds[author])
    with Ledger.open(c.homes[author].ledger_db) as src:
        raws = [src.append(signer, "metrics", {"offline": author, "k": k}).to_bytes() for k in range(n)]
    with Ledger.open(c.homes[holder].ledger_db) as dst:
        res = dst.merge(raws)
    assert len(res.added) == n
    return {e for e in res.added}


def test_v1_only_daemon_and_v2_daemons_converge_both_ways(tmp_path: Path) -> None:
    c = make_consortium(tmp_path, ["new0", "old", "new1", "away_old", "away_new"], seed=29)
    from_old = _offline_entries(c, "away_old", "old", 3)  # must travel old -> new (v2 falls back to v1)
    from_new = _offline_entries(c, "away_new", "new0", 4)  # must travel new -> old (v1 served by new daemons)

    def make(name: str) -> NodeDaemon:
        home = c.homes[name]
        t = RecordingTransport(NodeIdentity.load(home).libp2p_keypair(), v1_only=name == "old")
        return NodeDaemon(home, transport=t, sync_interval=1.0, poll_interval=0.1, auto_fetch=False)

    ds: dict[str, NodeDaemon] = {}
    everything = from_old | from_new

    async def main() -> None:
        ds.update((name, make(name)) for name in ("new0", "old", "new1"))  # in trio: daemons hold trio events
        with trio.fail_after(90):
            await run_all()

    async def run_all() -> None:
        async with trio.open_nursery() as nursery:
            first = ds["new0"]
            await nursery.start(first.run, LISTEN, [])
            boot = [first.transport.addrs()[0]]
            for name in ("old", "new1"):
                await nursery.start(ds[name].run, LISTEN, boot)
            await wait_for(lambda: all(everything <= _ids(d) for d in ds.values()),
                           "every ledger holds the entries of both offline members", 40)
            # the one ledger all three hold (hellos and admissions included)
            await wait_for(lambda: len({frozenset(_ids(d)) for d in ds.values()}) == 1, "identical ledgers", 20)
            for d in ds.values():
                d.stop()

    trio.run(main)
    old, new0, new1 = ds["old"].transport, ds["new0"].transport, ds["new1"].transport
    assert old.served and set(old.served) == {SYNC_PROTOCOL}  # the older daemon was asked on v1 only ...
    assert SYNC_PROTOCOL in new0.served + new1.served  # ... and asked the current ones on v1
    assert SYNC_PROTOCOL_V2 in new0.served + new1.served  # the current ones spoke v2 with each other
