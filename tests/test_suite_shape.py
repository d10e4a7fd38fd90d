"""The test suite's own shape: no test module imports another test module; shared
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


def test_the_files_conftest_runs_first_exist_and_hold_slow_tests() -> None:
    """`conftest.LONGEST_FIRST` orders the run (the longest files start at once); a file
    renamed or deleted there would silently fall back to the end of the queue."""
    names = _conftest_tuple("LONGEST_FIRST")
    fast = [n for n in names if "mark.slow" not in (TESTS / n).read_text()]
    assert fast == [], f"LONGEST_FIRST names files without a slow test: {fast}"


def test_the_files_conftest_runs_first_in_the_fast_tier_exist() -> None:
    _conftest_tuple("FAST_LONGEST_FIRST")


def _conftest_tuple(var: str) -> tuple[str, ...]:
    """`conftest.<var>`: test file names, none twice, each an existing file."""
    tree = ast.parse((TESTS / "conftest.py").read_text())
    (names,) = [ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == [var]]
    assert names and len(set(names)) == len(names), names
    missing = [n for n in names if not (TESTS / n).is_file()]
    assert missing == [], f"{var} names files that are gone: {missing}"
    return names
