"""The daemon's read-only web dashboard, /metrics and /healthz (see server.py)."""
from atdnode.dashboard.server import Dashboard, parse_bind

__all__ = ["Dashboard", "parse_bind"]
