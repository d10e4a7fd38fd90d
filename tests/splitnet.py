"""Split learning on the in-memory network: tiny settings (16 px digits, 4 px patches, 32
wide, 2 blocks), a node configured as a split server, a client joining it, and the check
of a client's comm record. Used by the split network, secret, ablation and MSD tests."""
from __future__ import annotations

from atdnode.node import NodeConfig, NodeHome, NodeIdentity
from atdnode.split import JoinOptions, SplitSettings, report_row, run_join, single_error
from atdnode.transport import MemoryNetwork, MemoryTransport

TASKS = [{"name": "digit", "kind": "classification", "num_outputs": 10},
         {"name": "ink", "kind": "segmentation", "loss_weight": 0.5},
         {"name": "severity", "kind": "regression", "loss_weight": 0.5}]
BODY = {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 2, "num_heads": 2}
BASE = {"tasks": TASKS, "body": BODY, "rounds": 2, "steps_per_round": 3, "unifying_rounds": 1, "batch_size": 16,
        "clients": 2, "start_timeout": 30.0, "round_timeout": 20.0, "lr": 3e-3}
TOKENS = (16, 32)  # (N patches, D) at the cut


def data(i: int, n: int = 2, limit: int = 120) -> str:
    return f"digits?shard={i}/{n}&limit={limit}"


def configure(home: NodeHome, role: str, **kw) -> None:
    cfg = NodeConfig.load(home)
    cfg.role = role
    cfg.save(home)
    SplitSettings.from_dict({**BASE, **kw}).save(home)


async def client(net: MemoryNetwork, home: NodeHome, server, task: str, spec: str, **kw):
    t = MemoryTransport(net, NodeIdentity.load(home).signer.seed)
    try:
        async with t.run([]):
            return await run_join(home, t, JoinOptions(server=server.transport.peer_id, task=task, data=spec,
                                                       server_addrs=server.transport.addrs(), **kw))
    except BaseExceptionGroup as eg:  # the transport's nursery wraps a client error
        raise single_error(eg) from None


def check_record(res, algorithm: str, tol: float = 0.05) -> dict:
    row = report_row(res.record)
    assert row["algorithm"] == algorithm and row["side"] == "client"
    assert abs(row["rel_error"]) < tol, row
    return row


def majority_rate(spec: str) -> float:
    """The most frequent class's share of ``spec``'s held-out split (what a constant scores)."""
    import numpy as np

    from atdnode.data import load_dataset

    labels = np.asarray(load_dataset(spec, 28, 1, "test", seed=0).labels)
    return float(np.bincount(labels).max() / len(labels))
