"""HTML to PDF: a report laid out in parts, in parallel, must be the same document as one laid out whole:
the same pages, the same text on each page (footers' "page / pages" included), the same outline."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvexp.report import pdf
from kvexp.report import render as R
from kvexp.results.runs import Aggregate

PDFTOTEXT = shutil.which("pdftotext")
pytestmark = [pytest.mark.skipif(pdf.support() is not None, reason="WeasyPrint cannot load here"),
              pytest.mark.skipif(PDFTOTEXT is None, reason="pdftotext (poppler-utils) is not installed")]


@pytest.fixture(scope="module")
def html(reference_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("pdf-html")
    R.render_report(Aggregate.from_json(json.loads(reference_path.read_text())), out, formats=("html",))
    return (out / "report.html").read_text(), out


@pytest.fixture(scope="module")
def whole(html) -> Path:
    text, out = html
    return pdf.write(text, out / "whole.pdf", out, workers=1)


def pages_text(path: Path) -> list[str]:
    done = subprocess.run([PDFTOTEXT, "-layout", str(path), "-"], check=True, capture_output=True, text=True,
                          timeout=60)
    return done.stdout.split("\f")[:-1]


def outline(path: Path) -> list[tuple[int, str, int]]:
    import pypdf

    reader = pypdf.PdfReader(path)
    rows: list[tuple[int, str, int]] = []

    def walk(items: list, depth: int) -> None:
        for it in items:
            if isinstance(it, list):
                walk(it, depth + 1)
            else:
                rows.append((depth, it.title, reader.get_destination_page_number(it)))

    walk(reader.outline, 0)
    return rows


def test_parts_follow_the_page_breaks(html):
    text, _ = html
    head, bodies, tail = pdf.split(text, 2)
    assert len(bodies) == 2 and head + "".join(bodies) + tail == text.replace(pdf.PART_MARK, "")
    assert text.count(pdf.PART_MARK) == 3  # before each of the two scenarios and the planner
    for b in bodies[1:]:
        assert b.lstrip().startswith(("<section class=\"scenario\"", "<section id=\"planner\""))
    # never more groups than asked for or than there are pieces
    assert len(pdf.split(text, 1)[1]) == 1 and len(pdf.split(text, 99)[1]) == 4


@pytest.mark.parametrize(("workers", "method"), [(2, "fork"), (3, "spawn")])
def test_parallel_layout_is_the_same_document(html, whole, workers, method, monkeypatch):
    text, out = html
    monkeypatch.setattr(pdf, "_start_method", lambda: method)
    parts = pdf.write(text, out / f"parts-{workers}.pdf", out, workers=workers)
    a, b = pages_text(whole), pages_text(parts)
    assert len(a) == len(b) >= 5
    assert a == b  # every page's text, its footer's title and "n/N" too
    # the footer is "n / N"; text extraction keeps or drops the thin spaces depending on the digits
    assert f"{len(a)}/{len(a)}" in re.sub(r"\s*/\s*", "/", b[-1]).split()
    assert outline(parts) == outline(whole) and outline(whole)[0][0] == 0
    assert [d for d, *_ in outline(whole)].count(0) == 1  # one root: the title, every section under it
    import pypdf

    assert pypdf.PdfReader(parts).metadata.title == pypdf.PdfReader(whole).metadata.title


def test_without_pypdf_it_is_laid_out_in_one_process(html, whole, monkeypatch, caplog):
    text, out = html
    monkeypatch.setitem(sys.modules, "pypdf", None)  # `import pypdf` now raises ImportError
    with caplog.at_level(logging.WARNING, logger="kvexp.report.pdf"):
        path = pdf.write(text, out / "fallback.pdf", out, workers=2)
    assert "laying it out in one process" in caplog.text
    assert pages_text(path) == pages_text(whole)


def test_small_documents_stay_in_one_process(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(pdf, "_render_parallel", lambda *a: calls.append(a) or b"")
    html = f"<html><head></head><body><p>one</p>{pdf.PART_MARK}<p>two</p></body></html>"
    pdf.write(html, tmp_path / "small.pdf")
    assert calls == [] and (tmp_path / "small.pdf").read_bytes().startswith(b"%PDF")
