"""Code speaks of the project, not of its history: no tracked source, test or doc file
(.py, .md, .toml) refers to a tracker issue by number ("issue N", "issues N and M",
"#N"). Such numbers mean nothing to a reader outside the team; a comment says what the
code does and why instead."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = (".py", ".md", ".toml")
# "issue N", "Issues N and M", "issue #N"; "#N" standing alone (after a space or an
# opening bracket, so CSS colours such as `color:#222` do not count)
ISSUE_REF = re.compile(r"\bissues? #?\d+|(?:^|[\s(\[])#\d+\b", re.IGNORECASE | re.MULTILINE)


def _tracked(root: Path) -> list[Path]:
    """The repository's tracked files (every file under `root` when git cannot say)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
        files = [root / n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in root.rglob("*") if ".git" not in p.parts]
    return [p for p in files if p.suffix in SUFFIXES and p.is_file()]


def issue_references(root: Path = ROOT) -> list[str]:
    """`path:line: text` for every issue reference in the tracked files under `root`."""
    found = []
    for path in _tracked(root):
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if ISSUE_REF.search(line):
                found.append(f"{path.relative_to(root)}:{i}: {line.strip()[:120]}")
    return found


def test_the_checker_finds_issue_references_and_not_colours(tmp_path: Path) -> None:
    word = "iss" + "ue"  # spelled apart so this file does not refer to an issue itself
    (tmp_path / "a.py").write_text(f'"""Bounded ({word} 11)."""\nx = 1  # {word.title()}s 15, 29: pace\n')
    (tmp_path / "b.md").write_text("fixed in (#" + "12)\n")
    (tmp_path / "c.toml").write_text('css = "color:#222"  # the 2 issues we saw\n')
    (tmp_path / "d.txt").write_text(f"{word} 3\n")  # not a checked suffix
    assert sorted(issue_references(tmp_path)) == [
        f'a.py:1: """Bounded ({word} 11)."""', f"a.py:2: x = 1  # {word.title()}s 15, 29: pace",
        "b.md:1: fixed in (#" + "12)"]


def test_no_tracked_file_refers_to_an_issue_number() -> None:
    refs = issue_references()
    assert refs == [], "issue numbers in the source (say what and why instead):\n" + "\n".join(refs)
