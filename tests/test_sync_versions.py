"""Digest-first sync (protocol v2) next to the v1 wire it replaces: mixed versions
converge, peers in step exchange no heads, and peers that differ exchange only the heads of
the buckets that differ."""
from __future__ import annotations

import hashlib
import random
from pathlib import Path

import msgpack
import pytest
import trio

from atdnode.replication import SYNC_PROTOCOL, LedgerAccess, SyncProtocolError, pull, serve_sync
from atdnode.replication.sync import SYNC_PROTOCOL_V2, SyncVersions
from atdnode.replication.sync_digest import BUCKETS, VECTOR_BYTES, _Cache, bucket_of, differing, vector_of
from atdnode.transport import MemoryNetwork, MemoryTransport
from ledger import Ledger, Signer
from netsim.memnet import simulate


def _seed(i: int) -> bytes:
    return hashlib.sha256(f"sync-versions-{i}".encode()).digest()


def test_digest_cache_matches_a_fresh_vector_through_changes() -> None:
    """The cached vector, updated bucket by bucket, always equals one computed from scratch;
    one changed head changes exactly its own bucket."""
    rng = random.Random(3)
    heads = {rng.randbytes(32): rng.randrange(1, 50) for _ in range(600)}
    cache = _Cache()
    assert cache.update(dict(heads)) == vector_of(heads)
    for _ in range(40):
        a = rng.choice(list(heads))
        before = vector_of(heads)
        if rng.random() < 0.2:
            del heads[a]
        else:
            heads[a] += 1
        heads[rng.randbytes(32)] = 1 if rng.random() < 0.3 else heads.get(a, 1)
        assert cache.update(dict(heads)) == vector_of(heads)
    one = dict(heads)
    a = next(iter(one))
    one[a] += 1
    assert differing(vector_of(heads), vector_of(one)) == [bucket_of(a)]
    assert len(vector_of({})) == VECTOR_BYTES and differing(vector_of({}), vector_of({})) == []


class _Node:
    """A ledger + transport serving sync: v1 only (an older daemon) or both versions."""

    def __init__(self, net: MemoryNetwork, tmp: Path, i: int, *, old: bool) -> None:
        self.signer = Signer.from_seed(_seed(i))
        self.ledger = LedgerAccess(Ledger.open(tmp / f"n{i}.db"), own=self.signer.public_key)
        self.transport = MemoryTransport(net, _seed(100 + i), name=f"n{i}")
        self.old = old
        self.versions = SyncVersions()
        self.requests: list[tuple[str, dict]] = []  # (protocol, first frame) of each request served

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with self.transport.run([]):
            async def handler(stream) -> None:
                await serve_sync(_Recording(stream, self.requests), self.ledger)

            for proto in ((SYNC_PROTOCOL,) if self.old else (SYNC_PROTOCOL_V2, SYNC_PROTOCOL)):
                self.transport.set_stream_handler(proto, handler)
            task_status.started()
            await trio.sleep_forever()

    async def pull_from(self, other: "_Node") -> int:
        if self.old:  # an older daemon only knows v1
            stream = await self.transport.open_stream(other.transport.peer_id, SYNC_PROTOCOL)
        else:
            stream = await self.versions.open(self.transport, other.transport.peer_id)
        return (await pull(stream, self.ledger)).added

    def entry_ids(self) -> set[bytes]:
        return {e.id for e in self.ledger.ledger.all_entries()}


class _Recording:
    """A stream wrapper that records each frame the server reads (protocol and message)."""

    def __init__(self, stream, log: list) -> None:
        self._s, self._log = stream, log

    def __getattr__(self, name):
        return getattr(self._s, name)

    async def read_frame(self, max_size: int) -> bytes:
        frame = await self._s.read_frame(max_size)
        self._log.append((self._s.protocol, msgpack.unpackb(frame, raw=False, strict_map_key=False)))
        return frame


def _consortium(tmp: Path, olds: list[bool]) -> tuple[MemoryNetwork, list[_Node]]:
    net = MemoryNetwork(seed=5)
    nodes = [_Node(net, tmp, i, old=o) for i, o in enumerate(olds)]
    founder = nodes[0]
    g = founder.ledger.ledger.create_genesis(founder.signer, "c", [(n.signer.public_key, False) for n in nodes[1:]])
    for n in nodes[1:]:
        n.ledger.ledger.merge([g.to_bytes()])
    for k, n in enumerate(nodes):
        for j in range(3 + k):
            n.ledger.ledger.append(n.signer, "metrics", {"node": k, "j": j})
    return net, nodes


def test_mixed_versions_converge(tmp_path: Path) -> None:
    """Two current daemons and one older (v1-only) one pull from each other in every
    direction: all three end with the same log; the current ones fell back to v1 for the
    old one (and remember it) and spoke v2 with each other."""
    net, nodes = _consortium(tmp_path, [False, True, False])
    new_a, old, new_b = nodes

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for n in nodes:
                await nursery.start(n.serve)
            for n in (new_a, new_b):
                await n.transport.connect(old.transport.addrs()[0])
            await new_a.transport.connect(new_b.transport.addrs()[0])
            for _ in range(2):
                for a in nodes:
                    for b in nodes:
                        if a is not b:
                            await a.pull_from(b)
            remembered.extend(n.versions.speaks_v1_only(p.transport.peer_id) for n in (new_a, new_b)
                              for p in nodes if p is not n)
            nursery.cancel_scope.cancel()

    remembered: list[bool] = []
    simulate(main, seed=1)
    assert new_a.entry_ids() == old.entry_ids() == new_b.entry_ids()
    assert len(new_a.entry_ids()) == 1 + 3 + 4 + 5
    assert remembered == [True, False, False, True]  # new_a: old, new_b; new_b: new_a, old
    protos_at_old = {p for p, _ in old.requests}
    assert protos_at_old == {SYNC_PROTOCOL}  # the old one was only ever asked on v1
    v2_at_b = [m for p, m in new_b.requests if p == SYNC_PROTOCOL_V2]
    v1_at_b = [m for p, m in new_b.requests if p == SYNC_PROTOCOL]
    assert v2_at_b and all(m["t"] in ("digest", "heads") for m in v2_at_b)  # new_a asked new_b on v2
    assert v1_at_b and all(m["t"] == "heads" for m in v1_at_b)  # the old one's requests, on v1


def test_v2_in_step_sends_no_heads_and_a_difference_only_its_buckets(tmp_path: Path) -> None:
    """Peers in step: one digest frame, answered by the end marker (no heads map at all).
    One new entry on one side: the puller sends the heads of that entry's bucket only, and
    receives exactly that entry."""
    net, nodes = _consortium(tmp_path, [False, False])
    a, b = nodes
    out: dict = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for n in nodes:
                await nursery.start(n.serve)
            await a.transport.connect(b.transport.addrs()[0])
            await a.pull_from(b)
            await b.pull_from(a)
            b.requests.clear()
            out["in_step"] = await a.pull_from(b)
            out["in_step_requests"] = list(b.requests)
            b.requests.clear()
            b.ledger.ledger.append(b.signer, "metrics", {"late": 1})
            out["added"] = await a.pull_from(b)
            out["diff_requests"] = list(b.requests)
            nursery.cancel_scope.cancel()

    simulate(main, seed=2)
    assert out["in_step"] == 0
    assert [m["t"] for _, m in out["in_step_requests"]] == ["digest"]
    assert out["added"] == 1
    kinds = [m["t"] for _, m in out["diff_requests"]]
    assert kinds == ["digest", "heads"]
    sent = out["diff_requests"][1][1]["heads"]
    assert set(map(bucket_of, sent)) == {bucket_of(b.signer.public_key)}
    assert len(sent) < len(a.ledger.ledger.heads())  # not the whole map
    assert a.entry_ids() == b.entry_ids()


def test_v2_server_refuses_malformed_requests(tmp_path: Path) -> None:
    """A digest of the wrong size, or heads outside the buckets asked for, end the stream
    (reset) and the puller sees a protocol error, not a crash or a partial answer."""
    net, nodes = _consortium(tmp_path, [False, False])
    a, b = nodes
    outcomes: list = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for n in nodes:
                await nursery.start(n.serve)
            await a.transport.connect(b.transport.addrs()[0])
            for first in ({"t": "digest", "b": b"short"}, {"t": "heads", "heads": {}}):
                s = await a.transport.open_stream(b.transport.peer_id, SYNC_PROTOCOL_V2)
                await s.write_frame(msgpack.packb(first))
                try:
                    outcomes.append(await s.read_frame(1 << 20))
                except Exception as exc:
                    outcomes.append(type(exc).__name__)
            s = await a.transport.open_stream(b.transport.peer_id, SYNC_PROTOCOL_V2)
            await s.write_frame(msgpack.packb({"t": "digest", "b": bytes(VECTOR_BYTES)}))
            want = msgpack.unpackb(await s.read_frame(1 << 20))
            outside = next(k for k in range(BUCKETS) if k not in want["b"])
            await s.write_frame(msgpack.packb({"t": "heads", "heads": {bytes([outside]) + bytes(31): 1}}))
            try:
                outcomes.append(await s.read_frame(1 << 20))
            except Exception as exc:
                outcomes.append(type(exc).__name__)
            nursery.cancel_scope.cancel()

    simulate(main, seed=3)
    assert len(outcomes) == 3 and not any(isinstance(o, bytes) for o in outcomes), outcomes


def test_puller_rejects_a_malformed_want() -> None:
    """A server answering the digest with something other than end / want is a protocol error."""
    from atdnode.transport.framing import FramedStream

    class _Pipe:
        def __init__(self) -> None:
            self.out = bytearray()
            self.inp = bytearray()

        async def send_all(self, data) -> None:
            self.out += data

        async def receive_some(self, n: int) -> bytes:
            await trio.lowlevel.checkpoint()
            chunk = bytes(self.inp[:n])
            del self.inp[:n]
            return chunk

        async def close(self) -> None:
            pass

        async def abort(self) -> None:
            pass

    class _Ledger:
        async def run(self, fn):
            class L:
                def heads(self):
                    return {}
            return fn(L())

    pipe = _Pipe()
    body = msgpack.packb({"t": "want", "b": "not-bytes"})
    pipe.inp += len(body).to_bytes(4, "big") + body
    stream = FramedStream(pipe, "p", protocol=SYNC_PROTOCOL_V2)

    with pytest.raises(SyncProtocolError):
        trio.run(pull, stream, _Ledger())
