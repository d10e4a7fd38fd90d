"""What hostile peers cost a node: connection acceptance after refused dials and member churn,
and memory under a stream flooded past its yamux receive window. Real py-libp2p hosts on
127.0.0.1 in one process (`netsim.hostile`).

    python bench/hostile_net_bench.py [--dials 1000] [--churn 200] [--flood-mb 512]

Prints one JSON object:

* `accept`: a member's connect time to a fresh node (`fresh_s`, median of `--repeat`
  connects), then after `--dials` dials by an outsider key that the membership gate refused
  (`after_refused_s`) and after `--churn` connections of a member that came and went
  (`after_churn_s`), each as a ratio to the fresh time; the inbound slots the node holds after
  each (py-libp2p admits 250 inbound connections at a time) and what the dials cost.
* `memory`, per muxer (py-libp2p's stock yamux and atd's tuned one): the node's RSS growth
  while a member writes `--flood-mb` MiB in 1 MiB DATA frames past the window on the pubsub
  stream the node never reads (`hostile_mb`), against a control member that fills the same
  window and no more (`control_mb`), their ratio, the bytes the hostile member got written
  before the node cut it off and whether it did.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libp2p.stream_muxer.yamux.yamux import Yamux  # noqa: E402

from atdnode.transport._libp2p.yamux import TunedYamux  # noqa: E402
from atdnode.transport import Libp2pTransport, TransportError  # noqa: E402
from netsim.hostile import MiB, dial_cycles, flood_stream, members_only  # noqa: E402

LISTEN = ["/ip4/127.0.0.1/tcp/0"]
NODE, MEMBER, OUTSIDER = bytes([91]) * 32, bytes([92]) * 32, bytes([93]) * 32


async def _connect_time(node: Libp2pTransport, repeat: int) -> float:
    """Median seconds for a member to connect to `node` (each connect on a fresh member host),
    or -1 when a connect fails within 10 s."""
    times = []
    for _ in range(repeat):
        member = Libp2pTransport(MEMBER)
        async with member.run(LISTEN):
            start = time.perf_counter()
            try:
                with trio.fail_after(10):
                    await member.connect(node.addrs()[0])
            except (TransportError, trio.TooSlowError):  # locked out
                return -1.0
            times.append(time.perf_counter() - start)
            await member.disconnect(node.peer_id)
        with trio.move_on_after(10):
            while node.peers():
                await trio.sleep(0.01)
    return statistics.median(times)


async def _settled_slots(node: Libp2pTransport) -> int:
    """The node's inbound slots once no connection is left (at most 10 s later)."""
    with trio.move_on_after(10):
        while node.peers() or node.inbound_slots():
            await trio.sleep(0.02)
    return node.inbound_slots()


async def accept(dials: int, churn: int, concurrency: int, repeat: int) -> dict:
    node = members_only(NODE, [MEMBER])
    async with node.run(LISTEN):
        fresh = await _connect_time(node, repeat)
        cpu, wall = time.process_time(), time.perf_counter()
        refused = await dial_cycles(node.addrs()[0], OUTSIDER, dials, concurrency=concurrency)
        refused_cost = {"cpu_s": round(time.process_time() - cpu, 2), "wall_s": round(time.perf_counter() - wall, 2)}
        slots_refused = await _settled_slots(node)
        after_refused = await _connect_time(node, repeat)
        cpu, wall = time.process_time(), time.perf_counter()
        churned = await dial_cycles(node.addrs()[0], MEMBER, churn, concurrency=1, leave=True)
        churn_cost = {"cpu_s": round(time.process_time() - cpu, 2), "wall_s": round(time.perf_counter() - wall, 2)}
        slots_churn = await _settled_slots(node)
        after_churn = await _connect_time(node, repeat)
    return {
        "fresh_s": round(fresh, 4),
        "after_refused_s": round(after_refused, 4),
        "after_refused_ratio": round(after_refused / fresh, 2) if fresh > 0 and after_refused > 0 else None,
        "after_churn_s": round(after_churn, 4),
        "after_churn_ratio": round(after_churn / fresh, 2) if fresh > 0 and after_churn > 0 else None,
        "refused_dials": vars(refused), "refused_cost": refused_cost, "slots_after_refused": slots_refused,
        "gated_connections": node.gated_connections,
        "churn": vars(churned), "churn_cost": churn_cost, "slots_after_churn": slots_churn,
    }


async def memory(muxer: type, flood: int) -> dict:
    node = members_only(NODE, [MEMBER], muxer=muxer)
    async with node.run(LISTEN):
        addr = node.addrs()[0]
        control = await flood_stream(addr, MEMBER, total=flood, within_window=True, stall=0.5)
        with trio.move_on_after(10):
            while node.peers():
                await trio.sleep(0.01)
        hostile = await flood_stream(addr, MEMBER, total=flood)
    mb = 1e6
    return {
        "window_bytes": control.granted,
        "control_mb": round(control.rss_growth / mb, 2), "control_sent_mb": round(control.sent / mb, 2),
        "hostile_mb": round(hostile.rss_growth / mb, 2), "hostile_sent_mb": round(hostile.sent / mb, 2),
        "hostile_cut_off": hostile.closed_by_node, "hostile_s": round(hostile.seconds, 3),
        "hostile_over_control": round(hostile.rss_growth / control.rss_growth, 2) if control.rss_growth > 0 else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dials", type=int, default=1000, help="refused dials by an outsider key")
    ap.add_argument("--churn", type=int, default=200, help="member connections that come and go")
    ap.add_argument("--concurrency", type=int, default=8, help="dials at a time")
    ap.add_argument("--repeat", type=int, default=3, help="member connects per timing (median)")
    ap.add_argument("--flood-mb", type=int, default=512, help="MiB the hostile member writes past the window")
    args = ap.parse_args()

    async def run() -> dict:
        out = {"accept": await accept(args.dials, args.churn, args.concurrency, args.repeat), "memory": {}}
        for name, muxer in (("stock", Yamux), ("tuned", TunedYamux)):
            out["memory"][name] = await memory(muxer, args.flood_mb * MiB)
        return out

    print(json.dumps(trio.run(run)))


if __name__ == "__main__":
    main()
