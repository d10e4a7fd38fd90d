"""The split stream protocol id and the node roles that serve it: a leaf that the package,
the service, the client and the daemon import without pulling in torch."""
from __future__ import annotations

SPLIT_PROTOCOL = "/atd/split/1.0.0"
# node role -> algorithm served
SERVER_ROLES = {"festa-server": "festa", "pfesta-server": "pfesta", "msd-server": "msd"}
