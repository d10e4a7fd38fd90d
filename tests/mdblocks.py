"""Fenced code blocks of a Markdown file, for tests that run or check documentation as written."""
from __future__ import annotations


def fenced_blocks(md: str) -> list[tuple[str, str]]:
    """[(info string, body)] of every ``` fenced block, in order (body without the fences)."""
    out: list[tuple[str, str]] = []
    info: str | None = None
    body: list[str] = []
    for line in md.splitlines():
        if info is None:
            if line.startswith("```"):
                info, body = line[3:].strip(), []
        elif line.startswith("```"):
            out.append((info, "\n".join(body) + "\n"))
            info = None
        else:
            body.append(line)
    return out
