"""The test suite's own shape (issue 28): no test module imports another test module; shared
helpers live in the helper modules `tests/conftest.py` lists."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _test_imports(source: str) -> list[str]:
    """Test modules (``tests.test_*``) that `source` imports, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [n for n in names if n.startswith("tests.test_")]
    return found


def test_the_checker_sees_an_import_of_a_test_module() -> None:
    assert _test_imports("def f():\n    from tests.test_x import helper\n") == ["tests.test_x"]
    assert _test_imports("import tests.test_y\nfrom tests.factories import cli\n") == ["tests.test_y"]


def test_no_test_module_imports_another() -> None:
    bad = {p.name: _test_imports(p.read_text()) for p in sorted(TESTS.glob("*.py"))}
    assert {k: v for k, v in bad.items() if v} == {}
