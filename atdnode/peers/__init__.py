"""Peers: whom a daemon stays connected to, at which addresses, and how it dials them."""
from __future__ import annotations

from atdnode.face import lazy_face

# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"PeerDialer": "dialer", "PeerSet": "peerset", "PeerSetConfig": "peerset", "gossip_degrees": "peerset",
         "plan_sync": "peerset",
         "MAX_ADDRS_PER_MEMBER": "dialpolicy"}
__all__ = [*_FACE]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
