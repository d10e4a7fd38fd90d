"""Ledger replication: gossip in and out, sync, anti-entropy, the own chain and the membership gate."""
from __future__ import annotations

from atdnode.face import lazy_face

# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"wait_for_entries": "arrival", "MembershipGate": "access", "ledger_guard": "access", "Announcer": "announce", "IDLE_POLL_S": "announce", "LEDGER_RECHECK_S": "announce", "ledger_stamp": "announce", "write_announced": "announce",
         "LedgerAccess": "ledger_access", "NodeStopping": "ledger_access", "quota_from_config": "ledger_access", "Replicator": "replicator",
         "SYNC_FANOUT": "replicator", "CachedGenesis": "sync", "SYNC_PROTOCOL": "sync", "SYNC_PROTOCOLS": "sync",
         "SyncProtocolError": "sync", "pull": "sync", "serve_sync": "sync"}
__all__ = [*_FACE]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
