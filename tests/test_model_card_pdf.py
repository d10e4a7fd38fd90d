"""`atd report --pdf`: the card printed by a Chromium-family browser, or one clear line without one."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from atdnode.report import card_pdf as model_card_pdf
from atdnode.report import PdfError, print_pdf


def test_the_card_prints_to_a_pdf(tmp_path: Path) -> None:
    html = tmp_path / "card.html"
    html.write_text("<!doctype html><title>card</title><h1>Model card</h1>" + "<p>row</p>" * 200)
    pdf = print_pdf(html, tmp_path / "out" / "card.pdf")
    data = pdf.read_bytes()
    assert data[:5] == b"%PDF-" and data.rstrip().endswith(b"%%EOF")
    assert len(re.findall(rb"/Type\s*/Page\b", data)) >= 2  # 200 paragraphs: more than one page
    assert not list(pdf.parent.glob("*.tmp"))


def test_without_a_browser_it_says_so_and_writes_nothing(tmp_path: Path, monkeypatch) -> None:
    html = tmp_path / "card.html"
    html.write_text("<p>x</p>")
    monkeypatch.setattr(model_card_pdf.shutil, "which", lambda name: None)
    with pytest.raises(PdfError, match=r"--pdf needs Chromium or Google Chrome on PATH") as exc:
        print_pdf(html, tmp_path / "card.pdf")
    assert "\n" not in str(exc.value) and str(html) in str(exc.value)
    assert not (tmp_path / "card.pdf").exists()
