"""Prometheus text exposition (format 0.0.4) of a node's counters, without a client library.

    # HELP atd_peers_connected Peers with an open libp2p connection.
    # TYPE atd_peers_connected gauge
    atd_peers_connected 2
    atd_transport_bytes_total{protocol="/atd/blob/1",direction="received"} 1048576

Label values are escaped as the format requires (backslash, double quote, newline).
Families with no samples are still declared, so a scrape always lists every metric name.
"""
from __future__ import annotations

from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if isinstance(v, bool):
        v = int(v)
    if isinstance(v, int):
        return str(v)
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


@dataclass
class Family:
    name: str
    kind: str  # "gauge" | "counter"
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> "Family":
        self.samples.append(({k: str(v) for k, v in labels.items()}, value))
        return self

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for labels, value in self.samples:
            lab = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            lines.append(f"{self.name}{{{lab}}} {_number(value)}" if lab else f"{self.name} {_number(value)}")
        return "\n".join(lines)


def render(families: list[Family]) -> str:
    return "\n".join(f.render() for f in families) + "\n"


def node_families(snap: dict) -> list[Family]:
    """The families for one daemon snapshot (see `DashboardServer.metrics_snapshot`)."""
    f = [
        Family("atd_up", "gauge", "1 while the daemon runs.").add(1),
        Family("atd_info", "gauge", "The node's peer id and consortium.").add(
            1, peer_id=snap["peer_id"], consortium=snap.get("consortium") or ""),
        Family("atd_peers_connected", "gauge", "Peers with an open libp2p connection.").add(len(snap["peers"])),
    ]
    members = Family("atd_members", "gauge", "Consortium members by state, as this node's ledger knows them.")
    for state, n in sorted(snap["members"].items()):
        members.add(n, state=state)
    entries = Family("atd_ledger_entries", "gauge", "Stored ledger entries by placement (log, held, evidence).")
    for state, n in sorted(snap["ledger_states"].items()):
        entries.add(n, state=state)
    kinds = Family("atd_ledger_log_entries", "gauge", "Entries in the log by kind.")
    for kind, n in sorted(snap["kinds"].items()):
        kinds.add(n, kind=kind)
    nbytes = Family("atd_transport_bytes_total", "counter",
                    "Bytes on the wire by protocol (gossip, stream protocols, bulk) and direction.")
    for proto, (sent, received) in sorted(snap["bytes_by_protocol"].items()):
        nbytes.add(sent, protocol=proto, direction="sent")
        nbytes.add(received, protocol=proto, direction="received")
    fetch_done = Family("atd_fetch_bytes", "gauge", "Bytes received so far by each running blob fetch.")
    fetch_size = Family("atd_fetch_size_bytes", "gauge", "Size of each running blob fetch's blob (0: unknown).")
    for fr in snap["fetches"]:
        fetch_done.add(fr["bytes"], blob=fr["blob"][:16])
        fetch_size.add(fr["size"] or 0, blob=fr["blob"][:16])
    wanted = Family("atd_blobs_wanted", "gauge", "Announced blobs this node still has to fetch.").add(snap["wanted"])
    stored = Family("atd_blobs_stored", "gauge", "Blobs in the local store.").add(snap["blobs"])
    refusals = Family("atd_refusals_total", "counter", "Requests or entries this node refused, by reason.")
    events = Family("atd_daemon_events_total", "counter", "Daemon event counters (gossip, sync, overflow).")
    for key, n in sorted(snap["stats"].items()):
        if not isinstance(n, (int, float)):
            continue
        if "reject" in key or "refus" in key:
            refusals.add(n, reason=key)
        else:
            events.add(n, event=key)
    verify = Family("atd_aggregates", "gauge", "Aggregate entries by the dashboard's verify status.")
    for status, n in sorted(snap["aggregates"].items()):
        verify.add(n, status=status)
    return f + [members, entries, kinds, nbytes, fetch_done, fetch_size, wanted, stored, refusals, events, verify]
