"""INTERFACES.md's entry-body table is generated from `atdnode.bodies.SPECS` and current."""
from __future__ import annotations

from pathlib import Path

import pytest

from atdnode import bodies

DOC = Path(__file__).resolve().parent.parent / "INTERFACES.md"


def test_interfaces_entry_body_table_is_current():
    text = DOC.read_text()
    assert bodies.update_doc(text) == text, "run: python -m atdnode.bodies INTERFACES.md"


def test_the_table_names_every_kind_and_field(monkeypatch):
    table = bodies.spec_markdown()
    for kind, spec in bodies.SPECS.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{kind}` |"))
        for name in [*spec.required, *spec.optional]:
            assert f"`{name}`:" in row
    # a field added to a spec makes the document stale
    monkeypatch.setitem(bodies.SPECS, "metrics", bodies._spec({"run": (str,)}))
    assert bodies.update_doc(DOC.read_text()) != DOC.read_text()
    assert "`run`: str" in bodies.spec_markdown()


def test_update_doc_needs_the_markers():
    with pytest.raises(ValueError, match="no generated entry-body section"):
        bodies.update_doc("# a document without the section\n")
