"""The churn-and-partition scenario of the in-memory benchmark (bench/memsim_bench.py).

`churn_scenario(n, kind, entries, seed=...)`: N nodes (seeded bootstrap, degree 3, at most
`max_peers` dialled connections), 20 publishers appending 256-byte `metrics` entries 1 s
apart, the network cut in two halves from t=2 s to t=8 s, and 10% of the nodes killed at
t=1..3 s and restarted at t=5..9 s. Every choice in a run follows `seed` (keys, links,
trio's scheduling, each daemon's dialer and sync order: `netsim.memnet`).
"""
from __future__ import annotations

from netsim.scenario import scenario_from_dict
from netsim.scenario_spec import Scenario

SYNC_S = 10.0  # the daemon's default periodic sync
POLL_S = 0.5  # ledger poll (own entries written by CLI commands); appends of running nodes gossip at once


def churn_scenario(n: int, kind: str, entries: int, max_peers: int = 8, seed: int = 1) -> tuple[Scenario, int]:
    """(the scenario, how many nodes it churns); `kind`: \"daemon\" or \"lite\" peers (module doc)."""
    names = [f"n{i}" for i in range(n)]
    churn = names[1::10][: max(1, n // 10)]  # 10% of the nodes (never n0, the founder)
    faults: list[dict] = [{"kind": "partition", "groups": [names[: n // 2], names[n // 2:]], "at_s": 2.0},
                          {"kind": "heal", "at_s": 8.0}]
    for k, name in enumerate(churn):
        faults.append({"kind": "kill", "node": name, "at_s": 1.0 + 2.0 * k / len(churn)})
        faults.append({"kind": "restart", "node": name, "at_s": 5.0 + 4.0 * k / len(churn)})
    publishers = [x for x in names[::max(1, n // 20)] if x not in churn][:20]
    return scenario_from_dict({
        "scenario": {"name": f"memsim-{kind}-{n}", "seed": seed},
        "network": {"latency_ms": 20, "bandwidth_mbps": 100},
        "topology": {"nodes": n, "degree": 3, "max_peers": max_peers, "peers": kind, "sync_interval_s": SYNC_S,
                     "poll_interval_s": POLL_S},
        "workload": {"entries": entries, "entry_bytes": 256, "interval_s": 1.0, "deadline_s": 300,
                     "publishers": publishers},
        "faults": faults,
    }), len(churn)
