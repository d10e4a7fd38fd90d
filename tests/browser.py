"""A real headless Chromium for the tests that read a page as a person would."""
from __future__ import annotations

import re
import shutil
import subprocess


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError("no Chromium on PATH: install the system package (apt-get install -y chromium)")


def browser(*args: str, timeout: float = 120) -> str:
    """Run headless Chromium with `args` (e.g. --dump-dom URL); return its stdout."""
    proc = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--no-first-run", "--hide-scrollbars", *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def text_of(dom: str) -> str:
    """What a reader sees: the DOM's text without tags and with collapsed whitespace."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", re.sub(r"<style.*?</style>", "", dom, flags=re.S)))
