"""INTERFACES.md's public-API section is generated from the source (`atdnode.report.api_doc`) and current."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from atdnode.report import api_doc
ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "INTERFACES.md"


def test_interfaces_public_api_section_is_current():
    text = DOC.read_text()
    assert api_doc.update_doc(text) == text, "run: python -m atdnode.report.api_doc INTERFACES.md"


def _copy_tree(tmp_path: Path) -> Path:
    for pkg in ("ledger", "protocols", "atdnode", "netsim"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_a_changed_signature_or_contract_makes_the_document_stale(tmp_path):
    root = _copy_tree(tmp_path)
    text = DOC.read_text()
    f = root / "ledger" / "ledger.py"
    src = f.read_text()
    old = "def get(self, entry_id: bytes | str, *, include_held: bool = False) -> Entry | None:"
    assert old in src
    f.write_text(src.replace(old, "def get(self, entry_id: bytes | str, *, include_held: bool = False, "
                                  "timeout: float = 1.0) -> Entry | None:"))
    changed = api_doc.update_doc(text, root)
    assert changed != text
    assert "Ledger.get(entry_id: bytes | str, *, include_held: bool=False, timeout: float=1.0)" in changed

    f.write_text(src.replace('"""The entry with this id (32 bytes', '"""The entry with this id (promised anew) (32 bytes'))
    assert "(promised anew)" in api_doc.update_doc(text, root)


def test_every_listed_name_must_exist_and_state_its_contract(tmp_path, monkeypatch):
    (tmp_path / "atdnode").mkdir()
    (tmp_path / "atdnode" / "toy.py").write_text(
        'LIMIT = 3  # at most three\n\n'
        'def documented(a: int, *, b: str = "x") -> int:\n    """Returns a, untouched.\n\n    More detail."""\n    return a\n\n'
        'def bare(a):\n    return a\n\n'
        'class Thing:\n    """A thing."""\n\n    def __init__(self, n: int) -> None:\n        self.n = n\n\n'
        '    def grow(self, by: int = 1) -> int:\n        """n + by."""\n        return self.n + by\n')
    monkeypatch.setattr(api_doc, "API", [("atdnode", "atdnode.toy", ("LIMIT", "documented", "Thing", "Thing.grow"))])
    md = api_doc.api_markdown(tmp_path)
    assert "- `atdnode.toy.LIMIT = 3` — at most three" in md
    assert "- `atdnode.toy.documented(a: int, *, b: str='x') -> int` — Returns a, untouched." in md
    assert "More detail" not in md  # the first paragraph only
    assert "- `atdnode.toy.Thing(n: int)` — A thing." in md
    assert "- `atdnode.toy.Thing.grow(by: int=1) -> int` — n + by." in md

    monkeypatch.setattr(api_doc, "API", [("atdnode", "atdnode.toy", ("bare",))])
    with pytest.raises(api_doc.ApiDocError, match="atdnode.toy.bare: no docstring"):
        api_doc.api_markdown(tmp_path)
    monkeypatch.setattr(api_doc, "API", [("atdnode", "atdnode.toy", ("gone",))])
    with pytest.raises(api_doc.ApiDocError, match="atdnode.toy.gone: not defined"):
        api_doc.api_markdown(tmp_path)


def test_update_doc_needs_the_markers():
    with pytest.raises(ValueError, match="no generated public-API section"):
        api_doc.update_doc("# a document without the section\n")
