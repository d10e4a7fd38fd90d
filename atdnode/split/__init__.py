"""Split learning over the network: FESTA, p-FESTA and masked sampling
distillation servers as node roles, reached by clients over a libp2p stream protocol.

The learning itself lives in `protocols` (festa, pfesta, msd: pure message-in /
message-out roles); this package moves their messages over `SPLIT_PROTOCOL` streams,
counts every byte, and ties the roles to the node (config, ledger, blob store).

* `service`  -- the server role run inside the daemon (`atd node start --role ...`);
* `client`   -- `atd split join`: a transient transport, one session, a comm record;
* `session`  -- message framing and byte accounting shared by both ends;
* `settings` -- the `[split]` table of config.toml (tasks, body, schedule);
* `report`   -- comm records and `atd split report`.

This module stays import-light (no torch): the daemon calls `role_services` for every
node, and only split-server roles pull in the heavy parts.
"""
from __future__ import annotations

from typing import Any

from atdnode.face import lazy_face

# node role -> algorithm served
SERVER_ROLES = {"festa-server": "festa", "pfesta-server": "pfesta", "msd-server": "msd"}


def role_services(home: Any, config: Any) -> list:
    """The daemon services a node of `config.role` runs: one `SplitService` for a split
    server role, none otherwise. Each has `install(daemon)` and `async run(daemon)`."""
    algorithm = SERVER_ROLES.get(config.role)
    if algorithm is None:
        return []
    from atdnode.split.service import SplitService

    return [SplitService(home, algorithm)]


# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"BASE_MODEL": "base", "BaseBuildError": "base", "build_base": "base",
         "publish_base": "base", "JoinOptions": "client", "SplitJoinError": "client", "join": "client",
         "run_join": "client", "single_error": "client", "CompareSetting": "compare", "METHODS": "compare_view",
         "run_compare": "compare", "render_compare": "compare_view:render",
         "write_compare_png": "compare_view:write_png", "finetune_from_entry": "finetune",
         "SplitReportError": "report", "load_records": "report", "records_dir": "report", "report_row": "report",
         "render_report": "report:render", "SplitSecretError": "secret", "RemoteError": "session", "SPLIT_PROTOCOL": "session",
         "ACCEPT_POLICIES": "settings", "DEFAULT_BODY": "settings", "EMBEDDER_HEADS": "settings", "SplitConfigError": "settings", "SplitSettings": "settings",
         "parse_task": "settings",
         "accept_clients": "secret", "adopt_secret": "secret"}
__all__ = [*_FACE] + ["SERVER_ROLES", "role_services"]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
