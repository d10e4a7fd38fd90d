"""The daemon's answers to its local control socket (`atdnode.node.control`) and its status.

`DaemonControl(daemon).handle(req)` answers one request of `atd node status`, `peers`,
`fetch`, `connect`, `verify_peers`, `sync`, `stop` (a `DaemonError` for an unknown op or a
malformed one: the control server sends it back as one line); `status()` is the dict
`atd node status --json` prints. It reads the daemon through its public attributes only.
"""
from __future__ import annotations

from typing import Any

from atdnode.errors import DaemonError
from ledger import Ledger
from ledger.keys import peer_id_from_public_key


class DaemonControl:
    """Control requests of one `NodeDaemon`."""

    def __init__(self, daemon: Any) -> None:
        """`daemon`: the `atdnode.node.daemon.NodeDaemon` it answers for (not imported: no import circle)."""
        self.d = daemon

    async def handle(self, req: dict) -> dict:
        d = self.d
        op = req["op"]
        if op == "ping":
            return {"peer_id": d.transport.peer_id}
        if op == "status":
            return await self.status()
        if op == "peers":
            return {"peers": d.transport.peers()}
        if op == "fetch":
            blob = req.get("blob")
            if not isinstance(blob, str):
                raise DaemonError("fetch needs a blob hash")
            await d.fetch(blob, timeout=float(req.get("timeout_s", 600)))
            return {"blob": blob, "size": d.store.size(blob), "report": d.fetch_report(blob)}
        if op == "connect":
            return {"peer": await d.transport.connect(str(req.get("addr")))}
        if op == "verify_peers":
            return await d.verify_peers()
        if op == "sync":
            added = 0
            for peer in d.transport.peers():
                added += await d.sync_with(peer)
            return {"added": added}
        if op == "stop":
            d.stop()
            return {}
        raise DaemonError(f"unknown control op {op!r}")

    async def status(self) -> dict:
        d = self.d

        def ledger_state(led: Ledger) -> dict:
            heads = {peer_id_from_public_key(a): s for a, s in led.heads().items()}
            return {"heads": heads, "entries": sum(heads.values())}

        state = await d.ledger.run(ledger_state)
        return {
            "peer_id": d.transport.peer_id,
            "addrs": d.addrs(),  # what others dial (never 0.0.0.0)
            "peers": d.transport.peers(),
            "refused": sorted(d.gate.refused),  # non-members refused so far
            "members": len(d.replica.member_peer_ids()),  # other members (the dashboard's "connected N of M")
            **d.dialer.status(),  # unreachable members (peer -> seconds), revoked, refusals received
            "ledger": state,
            "blobs": len(d.store.list()),
            "wanted": sorted(d.fetcher.wanted),
            "bytes": d.transport.bytes_counters(),
            "stats": dict(d.stats),
            "peer_set": {"target": d.peerset.cfg.target, "max": d.peerset.cfg.max,
                         "dialled": d.peerset.dialled, "pruned": d.peerset.pruned},
            "dashboard": d.web_url,
        }
