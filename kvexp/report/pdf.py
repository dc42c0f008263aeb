"""HTML to PDF with WeasyPrint.

    write(html, path, base_url=None, workers=None) -> path

WeasyPrint lays a document out on one core, at roughly a millisecond per table cell, and a 100-run
sweep has thousands. A large report is therefore laid out in parts, one per CPU, and joined with pypdf.
The template marks where a part may begin (PART_MARK, before each section that starts on a new page),
so the parts paginate exactly as the whole would. The parts are laid out without their page footers;
the footers ("title ... page / pages") are then laid out once, for the joined page count, from the same
stylesheet, and stamped onto the pages. A small report, one CPU, or a failed worker takes the plain
one-process path."""

from __future__ import annotations

import io
import logging
import multiprocessing
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from kvexp.core import machine
from kvexp.core.paths import atomic_write

log = logging.getLogger(__name__)

PANGO_HINT = "apt-get install libpango-1.0-0 libpangoft2-1.0-0"
PART_MARK = "<!-- kvexp:part -->"
# Below this many tags a second process saves nothing (a one-run report, ~1,500 tags: 0.65 s either way).
PARALLEL_MIN_TAGS = 2_000
MAX_WORKERS = 4
_NO_FOOTER = "<style>@page { @bottom-left { content: none } @bottom-right { content: none } }</style>"
_FOOTER_ONLY = "<style>body > * { visibility: hidden }</style>"


class PDFUnavailable(RuntimeError):
    """WeasyPrint (or the system libraries it loads) is missing; the message says what to install."""


def weasyprint() -> Any:
    """The weasyprint module, or PDFUnavailable with the one line saying what to install."""
    try:
        with library_log(None):  # importing it parses its own stylesheets, with a progress line each
            import weasyprint as wp  # noqa: PLC0415 (loads Pango through cffi: may fail with OSError)
    except (OSError, ImportError) as e:
        why = " ".join(str(e).split())[:160]
        raise PDFUnavailable(f"PDF not written: WeasyPrint cannot load ({why}); install its system libraries "
                             f"with `{PANGO_HINT}` and the package with `pip install weasyprint`") from e
    return wp


NOISY_LOGGERS = ("weasyprint", "weasyprint.progress", "fontTools")
LOG_NAME = "report.log"


@contextmanager
def library_log(path: Optional[Path]) -> Iterator[None]:
    """While a PDF is laid out, WeasyPrint's and fontTools' messages (progress, ignored CSS, font
    subsetting) go to `path` (the report's log file), never to the terminal; with no path, nowhere."""
    handler: logging.Handler = logging.NullHandler()
    if path is not None:
        try:
            handler = logging.FileHandler(path, encoding="utf-8", delay=True)  # made at the first message
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        except OSError:
            pass
    saved = []
    for name in NOISY_LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, lg.propagate, lg.level))
        lg.addHandler(handler)
        lg.propagate = False
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, propagate, level in saved:
            lg.removeHandler(handler)
            lg.propagate, lg.level = propagate, level
        handler.close()


def support() -> Optional[str]:
    """None when WeasyPrint can run here; else the one line saying what to install."""
    try:
        weasyprint()
    except PDFUnavailable as e:
        return str(e)
    return None


def _start_method() -> str:
    """fork (quick: WeasyPrint is already imported) when this process holds no other thread; else spawn."""
    return "fork" if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods() else "spawn"


def render(html: str, base_url: Optional[str], log_path: Optional[Path] = None) -> bytes:
    """One HTML document to PDF bytes (also the worker's task: a top-level function pickles)."""
    wp = weasyprint()
    with library_log(log_path):
        return wp.HTML(string=html, base_url=base_url).write_pdf()


def split(html: str, parts: int) -> tuple[str, list[str], str]:
    """(head, bodies, tail): the body cut at PART_MARKs into at most `parts` consecutive groups of about
    equal layout cost (counted in tags, which tracks WeasyPrint's time closely enough)."""
    start = html.index(">", html.index("<body")) + 1
    end = html.rindex("</body>")
    pieces = html[start:end].split(PART_MARK)
    total = sum(p.count("<") for p in pieces)
    groups: list[list[str]] = [[]]
    done = 0
    for p in pieces:
        cost = p.count("<")
        # start a new group once this piece's midpoint lies past the current group's share
        if groups[-1] and len(groups) < parts and done + cost / 2 > total * len(groups) / parts:
            groups.append([])
        groups[-1].append(p)
        done += cost
    return html[:start], ["".join(g) for g in groups], html[end:]


def write(html: str, path: Path, base_url: Optional[Path] = None, workers: Optional[int] = None) -> Path:
    """Write the PDF of `html` to `path` atomically. workers: processes to lay it out with (default: one
    per CPU, up to MAX_WORKERS, for a document of at least PARALLEL_MIN_TAGS tags; 1: one process)."""
    weasyprint()
    base = str(base_url or path.parent)
    log_path = path.parent / LOG_NAME
    if workers is None:
        workers = min(machine.usable_cpus(), MAX_WORKERS) if html.count("<") >= PARALLEL_MIN_TAGS else 1
    data = None
    if workers > 1 and PART_MARK in html:
        try:
            data = _render_parallel(html, base, workers, log_path)
        except Exception as e:  # noqa: BLE001 (a worker died or pypdf failed: the plain path still works)
            log.warning("parallel PDF layout failed (%s); laying it out in one process", " ".join(str(e).split()))
    if data is None:
        data = render(html, base, log_path)
    return atomic_write(path, data)


def _render_parallel(html: str, base: str, workers: int, log_path: Optional[Path] = None) -> bytes:
    import pypdf  # noqa: PLC0415 (only large reports need it)

    head, bodies, tail = split(html, workers)
    if len(bodies) < 2:
        return render(html, base, log_path)
    docs = [head.replace("</head>", f"{_NO_FOOTER}</head>", 1) + b + tail for b in bodies]
    # this process lays out the first part while the others start and lay out the rest
    ctx = multiprocessing.get_context(_start_method())
    with ProcessPoolExecutor(max_workers=len(docs) - 1, mp_context=ctx) as pool:
        futures = [pool.submit(render, d, base, log_path) for d in docs[1:]]
        parts = [render(docs[0], base, log_path)] + [f.result() for f in futures]
    writer = pypdf.PdfWriter()
    readers = [pypdf.PdfReader(io.BytesIO(p)) for p in parts]
    root = None
    for r in readers:
        first = len(writer.pages)
        writer.append(r, import_outline=False)
        # a later part's headings belong under the document's title, as in the whole document's outline
        added = _copy_outline(writer, r, r.outline, first, root)
        if root is None:
            root = added
    n = len(writer.pages)
    # the footers alone: the document's first heading (it sets the footer's title string), hidden, then
    # one empty page per page of the joined document
    title = re.search(r"<h1\b.*?</h1>", html, re.S)
    footers = render(head.replace("</head>", f"{_FOOTER_ONLY}</head>", 1) + (title.group(0) if title else "")
                     + '<div style="break-before: page"></div>' * (n - 1) + tail, base, log_path)
    stamps = pypdf.PdfReader(io.BytesIO(footers)).pages
    if len(stamps) != n:
        raise RuntimeError(f"footer pages {len(stamps)} != document pages {n}")
    for page, stamp in zip(writer.pages, stamps):
        page.merge_page(stamp)
        page.compress_content_streams()
    metadata = readers[0].metadata
    if metadata:
        writer.add_metadata(dict(metadata))
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def _copy_outline(writer: Any, reader: Any, items: list, first_page: int, parent: Any) -> Any:
    """Copy reader's outline (pypdf's nested list: an item, then a list of its children) into writer,
    its pages shifted by first_page, under parent; returns the first top-level item added."""
    first = last = None
    for item in items:
        if isinstance(item, list):
            _copy_outline(writer, reader, item, first_page, last)
            continue
        page = reader.get_destination_page_number(item)
        last = writer.add_outline_item(title=item.title, page_number=first_page + page, parent=parent)
        if first is None:
            first = last
    return first
