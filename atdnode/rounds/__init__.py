"""Serverless training rounds (`atd rounds`): the runner, the round rules and its fabric."""
from __future__ import annotations

from atdnode.face import lazy_face

# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"Fabric": "fabric", "RoundsError": "rules", "current_round": "rules", "round_candidates": "rules", "verify_round": "rules",
         "RoundReport": "runner", "RoundRunner": "runner", "RoundsConfig": "runner", "POLL_S": "runner",
         "active_members": "rules", "round_weights_entries": "rules"}
__all__ = [*_FACE]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
