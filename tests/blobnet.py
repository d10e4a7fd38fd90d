"""A small cluster of nodes running the blob protocol (no daemon): one store and one
`BlobService` per node, on either transport. Used by the blob transfer tests and the
dashboard's byte counters."""
from __future__ import annotations

import hashlib
import random
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import trio

from atdnode.blobs import BlobService, BlobStore
from atdnode.transport import MemoryNetwork, MemoryTransport, Transport
from atdnode.blobs.fetch import FetchConfig

CHUNK = 64 << 10
NCHUNKS = 24


def seed(i: int) -> bytes:
    return hashlib.sha256(f"blob-node-{i}".encode()).digest()


def blob_bytes() -> bytes:
    return random.Random(5).randbytes(NCHUNKS * CHUNK - 1234)  # last chunk is short


class Node:
    def __init__(self, t: Transport, store: BlobStore, svc: BlobService) -> None:
        self.t, self.store, self.svc = t, store, svc
        self.stop = trio.Event()


@asynccontextmanager
async def cluster(kind: str, n: int, tmp: Path, *, bulk: bool = True, cfg: FetchConfig | None = None,
                  muxers: list[type] | None = None, chunk: int = CHUNK) -> AsyncIterator[list[Node]]:
    """n running nodes, each with its own store and BlobService, all connected to node 0.
    A node whose `stop` event is set shuts its transport down (like a killed peer).
    `muxers`: libp2p only, node i's yamux class (default: the transport's TunedYamux)."""
    net = MemoryNetwork(seed=11)
    nodes: list[Node] = []
    for i in range(n):
        if kind == "memory":
            t: Transport = MemoryTransport(net, seed(i))
        else:
            from atdnode.transport import Libp2pTransport

            t = Libp2pTransport(seed(i))
            if muxers:
                t.muxer = muxers[i]
        store = BlobStore(tmp / f"n{i}", chunk_size=chunk)
        svc = BlobService(t, store, bulk=bulk, config=cfg or FetchConfig(bulk=bulk, batch_bytes=4 * chunk))
        svc.install()
        nodes.append(Node(t, store, svc))

    async def run_node(node: Node, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with node.t.run(["/ip4/127.0.0.1/tcp/0"]):
            task_status.started()
            await node.stop.wait()

    async with trio.open_nursery() as nursery:
        for node in nodes:
            await nursery.start(run_node, node)
        for node in nodes[1:]:
            await node.t.connect(nodes[0].t.addrs()[0])
        yield nodes
        for node in nodes:
            node.stop.set()
