"""The one Jinja environment of kvexp's outputs (report.md/html, the job and sweep summaries): templates
from paths.data_dir("templates"), HTML autoescaped (labels and model names are user input), Markdown
written through the shared filters: `md` (one escaped line; None is "—"), `md_code`, `md_table`;
HTML tables through `html_table`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from kvexp.core.paths import data_dir
from kvexp.metrics import registry
from kvexp.report.markdown import md_code, md_escape
from kvexp.report.tables import html_table, md_table


class ReportError(RuntimeError):
    """The report cannot be rendered; the message is one line."""


def templates_dir() -> Path:
    """The templates (paths.data_dir: the checkout's templates/, else the wheel's package data)."""
    try:
        return data_dir("templates")
    except FileNotFoundError as e:
        raise ReportError(str(e)) from None


def md(value: Any) -> str:
    """A value as one escaped Markdown line; None is "—"."""
    return registry.UNKNOWN if value is None else md_escape(value)


def environment(filters: Optional[dict[str, Callable[..., Any]]] = None,
                globals: Optional[dict[str, Any]] = None) -> Environment:
    """A Jinja environment on the templates with the shared filters, plus a caller's own filters and globals."""
    env = Environment(loader=FileSystemLoader(str(templates_dir())), undefined=StrictUndefined,
                      autoescape=lambda name: bool(name) and name.endswith((".html.j2", ".html")),
                      trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(md=md, md_code=md_code, md_table=md_table, html_table=html_table, **(filters or {}))
    env.globals.update(globals or {})
    return env
