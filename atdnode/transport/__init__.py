"""Transport: the interface members talk through (streams, gossip, frames, per-peer limits), its
in-memory twin and the libp2p adapter; the py-libp2p patches live in the private `_libp2p/`."""
from __future__ import annotations

from atdnode.face import lazy_face

# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"fit_mesh": "_libp2p.gossip_mesh", "GossipConfig": "_libp2p.host", "FrameError": "base", "MAX_FRAME": "base",
         "MAX_GOSSIP": "base", "Stream": "base", "StreamClosed": "base", "StreamHandler": "base", "Transport": "base",
         "TransportError": "base", "Counter": "framing", "Libp2pTransport": "libp2p_transport",
         "DecodeBudget": "limits", "PeerLimits": "limits", "lease_or_reset": "limits", "MemoryTransport": "memory",
         "LinkConditions": "memory_link", "MemoryNetwork": "memory_link"}
__all__ = [*_FACE]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
