"""Generated sections of a markdown document (INTERFACES.md): the text between a begin and an
end marker is rewritten from code, and a test checks it is current (docs that
cannot drift). Used by `atdnode.bodies` (entry bodies), `atdnode.node.config_schema` (config.toml
settings), `atdnode.report.api_doc` (public APIs) and `netsim.scenario_doc` (scenario options)."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def replace_section(text: str, begin: str, end: str, section: str, what: str) -> str:
    """`text` with the part from `begin` to `end` (markers included) replaced by `section`
    (which starts with `begin` and ends with `end`); ValueError if the markers are missing."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"the document has no generated {what} section (DOC_BEGIN ... DOC_END)")
    return text[:start] + section + text[stop + len(end):]


def rewrite_main(update: Callable[[str], str], module: str) -> None:
    """`python -m MODULE DOC.md`: rewrite DOC.md's section in place with `update`."""
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m {module} INTERFACES.md")
    doc = Path(sys.argv[1])
    doc.write_text(update(doc.read_text()))
