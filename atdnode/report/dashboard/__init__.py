"""The daemon's read-only web dashboard, /metrics and /healthz (see server.py)."""
from atdnode.report.dashboard.server import Dashboard, check_free, parse_bind

__all__ = ["Dashboard", "check_free", "parse_bind"]
