"""The model card as PDF, printed by a Chromium-family browser installed on this machine.

No Python PDF library is a dependency of atd: WeasyPrint needs Pango/cairo system
libraries, and the pure-Python ones (xhtml2pdf, ReportLab) render only part of the card's
CSS. A headless Chromium (or Google Chrome) prints the card exactly as a browser shows it
(`--print-to-pdf`); when none is installed, `print_pdf` says so in one line and the HTML
card (printable from any browser) is still written.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from atdnode.errors import AtdError

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class PdfError(AtdError):
    """The card could not be printed to PDF."""


def find_browser() -> str | None:
    """The first Chromium-family browser on PATH (None if there is none)."""
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


def print_pdf(html: Path, pdf: Path, *, timeout: float = 120.0) -> Path:
    """Print the self-contained HTML file `html` to `pdf` (written atomically); returns `pdf`."""
    browser = find_browser()
    if browser is None:
        raise PdfError(f"--pdf needs Chromium or Google Chrome on PATH (none of {', '.join(BROWSERS)}); "
                       f"the HTML card {html} prints from any browser")
    pdf = Path(pdf).resolve()
    pdf.parent.mkdir(parents=True, exist_ok=True)
    tmp = pdf.with_name(pdf.name + ".tmp")
    with tempfile.TemporaryDirectory(prefix="atd-pdf-") as profile:  # no shared profile lock, nothing kept
        argv = [browser, "--headless", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                f"--user-data-dir={profile}", "--no-pdf-header-footer", f"--print-to-pdf={tmp}"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            argv.append("--no-sandbox")  # Chromium refuses to start as root otherwise
        try:
            proc = subprocess.run([*argv, Path(html).resolve().as_uri()], capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PdfError(f"{browser} did not print the card within {timeout:.0f} s") from None
    if proc.returncode != 0 or not tmp.is_file() or tmp.read_bytes()[:5] != b"%PDF-":
        tmp.unlink(missing_ok=True)
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1][-200:]
        raise PdfError(f"{browser} could not print the card to PDF (status {proc.returncode}): {last}")
    tmp.replace(pdf)
    return pdf
