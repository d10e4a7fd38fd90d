"""Benchmark: split learning over real libp2p (loopback) vs the in-process driver.

The same p-FESTA and FESTA settings (2 clients, 2 tasks, digits) run twice:

* ``inprocess`` -- `protocols.pfesta.run_pfesta_inprocess` / `festa.run_festa_inprocess`:
  every message encoded, counted and decoded, no network (the baseline);
* ``network``   -- a server `NodeDaemon` (split-server role, Libp2pTransport, Noise + yamux)
  and two `run_join` clients on their own Libp2pTransports, all in this process; timed
  from the first client's admission to the last round (data loading excluded, as above).

Reports wall seconds, training wire bytes per client, and the ratios network / in-process
(time: the cost of streams, threads and round barriers; bytes: what the session adds in
message metadata, expected ~1.00).

    python bench/split_net_bench.py          # ~1 min on a small CPU
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
import trio

from atdnode.node import NodeConfig, NodeDaemon, NodeHome, NodeIdentity, init_home
from atdnode.split import JoinOptions, SplitSettings, run_join
from atdnode.transport import Libp2pTransport
from ledger import Ledger
from protocols import festa, pfesta
from protocols.comm_cost import ByteCounter
from protocols.split_parts import build_plain_embedder, digits_targets, new_embedder_state

TASKS = [{"name": "digit", "kind": "classification", "num_outputs": 10},
         {"name": "ink", "kind": "segmentation", "loss_weight": 0.5}]
JOBS = (("digit", "digits?shard=1/2&limit={n}"), ("ink", "digits?shard=2/2&limit={n}"))


def consortium(root: Path, n: int) -> list[NodeHome]:
    homes = [NodeHome.at(root / f"n{i}") for i in range(n)]
    founder = init_home(homes[0], consortium="bench")
    led = Ledger.open(homes[0].ledger_db)
    genesis = led.query(kind="genesis")[0].id.hex()
    for h in homes[1:]:
        led.admit(founder.signer, init_home(h, join=genesis).public_key)
    led.close()
    return homes


async def network_run(homes: list[NodeHome], algo: str, n: int) -> tuple[float, dict]:
    server = NodeDaemon(homes[0], transport=Libp2pTransport(NodeIdentity.load(homes[0]).libp2p_keypair()),
                        sync_interval=5.0, poll_interval=0.1)
    rows: dict = {}
    async with trio.open_nursery() as nursery:
        addrs = await nursery.start(server.run, ["/ip4/127.0.0.1/tcp/0"], [])

        async def one(home: NodeHome, task: str, spec: str) -> None:
            t = Libp2pTransport(NodeIdentity.load(home).libp2p_keypair())
            async with t.run(["/ip4/127.0.0.1/tcp/0"]):
                res = await run_join(home, t, JoinOptions(server=server.transport.peer_id, task=task,
                                                          data=spec.format(n=n), server_addrs=addrs, sync=False,
                                                          evaluate=False))
            c = ByteCounter.from_dict(res.record["counter"])
            rows[task] = c.total(res.record["client"], kinds=res.record["train_kinds"])

        svc, marks = server.services[0], {}

        async def watch() -> None:  # campaign time: first admission -> last round done
            while not svc.board or not svc.board.members:
                await trio.sleep(0.005)
            marks["start"] = time.perf_counter()
            while not svc.board.done:
                await trio.sleep(0.005)
            marks["end"] = time.perf_counter()

        async with trio.open_nursery() as clients:
            clients.start_soon(watch)
            for home, (task, spec) in zip(homes[1:], JOBS):
                clients.start_soon(one, home, task, spec)
        server.stop()
    return marks["end"] - marks["start"], rows


def inprocess_run(algo: str, s: SplitSettings, n: int) -> tuple[float, dict]:
    from atdnode.data import MEAN, STD, load_dataset

    cfg, specs = s.vit_config(), {t.name: t for t in s.task_specs()}
    data = {}
    for task, spec in JOBS:
        d = load_dataset(spec.format(n=n), cfg.img_size, cfg.in_chans, "train")
        x = (d.images * STD + MEAN).clamp(0, 1)
        data[task] = (x, digits_targets(specs[task], x, d.labels, cfg.patch_size))
    kw = dict(lr=s.lr, weight_decay=s.weight_decay, seed=s.seed)
    t0 = time.perf_counter()
    if algo == "pfesta":
        emb = build_plain_embedder(cfg, state=new_embedder_state(cfg))  # the clients' secret
        res = pfesta.run_pfesta_inprocess(
            pfesta.PFestaServer(cfg, list(specs.values()), batch_size=s.batch_size, **kw),
            [pfesta.PFestaClient(t, cfg, specs[t], x, y, emb, lr=s.lr, seed=0) for t, (x, y) in data.items()],
            rounds=s.rounds, steps_per_round=s.steps_per_round, unifying_rounds=s.unifying_rounds)
    else:
        res = festa.run_festa_inprocess(
            festa.FestaServer(cfg, list(specs.values()), **kw),
            [festa.FestaClient(t, cfg, specs[t], x, y, batch_size=s.batch_size, lr=s.lr, seed=0)
             for t, (x, y) in data.items()],
            rounds=s.rounds, steps_per_round=s.steps_per_round, unifying_rounds=s.unifying_rounds)
    secs = time.perf_counter() - t0
    return secs, {t: res.counter.total(t, kinds=res.train_kinds) for t in data}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=300, help="samples per client")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    out: dict = {"setting": {"samples_per_client": args.samples, "rounds": args.rounds, "steps": args.steps,
                             "batch": 32, "img": 16, "patch": 4, "embed": 32, "depth": 2}}
    for algo in ("pfesta", "festa"):
        s = SplitSettings(tasks=tuple(TASKS), rounds=args.rounds, steps_per_round=args.steps, unifying_rounds=2,
                          batch_size=32, clients=2, start_timeout=120.0, round_timeout=120.0)
        with tempfile.TemporaryDirectory() as tmp:
            homes = consortium(Path(tmp), 3)
            cfg = NodeConfig.load(homes[0])
            cfg.role = f"{algo}-server"
            cfg.save(homes[0])
            s.save(homes[0])
            net_s, net_b = trio.run(network_run, homes, algo, args.samples)
        in_s, in_b = inprocess_run(algo, s, args.samples)
        out[algo] = {"network_seconds": round(net_s, 3), "inprocess_seconds": round(in_s, 3),
                     "ratio_time_network_vs_inprocess": round(net_s / in_s, 3),
                     "train_wire_bytes_network": net_b, "train_wire_bytes_inprocess": in_b,
                     "ratio_bytes_network_vs_inprocess": round(sum(net_b.values()) / sum(in_b.values()), 5)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
