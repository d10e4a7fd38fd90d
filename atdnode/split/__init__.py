"""Split learning over the network: FESTA, p-FESTA and masked sampling
distillation servers as node roles, reached by clients over a libp2p stream protocol.

The learning itself lives in `protocols` (festa, pfesta, msd: pure message-in /
message-out roles); this package moves their messages over `SPLIT_PROTOCOL` streams,
counts every byte, and ties the roles to the node (config, ledger, blob store).

* `service`  -- the server role run inside the daemon (`atd node start --role ...`);
* `client`   -- `atd split join`: a transient transport, one session, a comm record;
* `session`  -- message framing and byte accounting shared by both ends;
* `settings` -- the `[split]` table of config.toml (tasks, body, schedule);
* `names`    -- the stream protocol id and the server roles (a leaf: no torch);
* `report`   -- comm records and `atd split report`.

This module stays import-light (no torch): the daemon calls `role_services` for every
node, and only split-server roles pull in the heavy parts.
"""
from __future__ import annotations

from typing import Any

from atdnode.split.names import SERVER_ROLES, SPLIT_PROTOCOL  # noqa: F401 - the package's names


def role_services(home: Any, config: Any) -> list:
    """The daemon services a node of `config.role` runs: one `SplitService` for a split
    server role, none otherwise. Each has `install(daemon)` and `async run(daemon)`."""
    algorithm = SERVER_ROLES.get(config.role)
    if algorithm is None:
        return []
    from atdnode.split.service import SplitService

    return [SplitService(home, algorithm)]
