"""A data spec as it may be shown to others (model cards, figure titles, the dashboard):
its source kind and options, never its path. Imports nothing: anyone may use it."""
from __future__ import annotations


def source_kind(spec: object) -> str:
    """The kind of a data spec without its path or options: `folder:/data/x?limit=5` -> `folder`."""
    s = str(spec or "")
    if not s:
        return "unknown"
    return s.split(":", 1)[0].split("?", 1)[0] if ":" in s else s.split("?", 1)[0]


def public_spec(spec: object) -> str:
    """`folder:/data/x?limit=5` -> `folder?limit=5`; `digits?classes=0,1` unchanged."""
    s = str(spec or "")
    kind = source_kind(s)
    opts = s.split("?", 1)[1] if "?" in s else ""
    return kind + (f"?{opts}" if opts else "")
