"""Markdown escaping for every user-supplied string kvexp writes into a .md file (labels, model names
and paths, server versions, reasons, host names): a value can neither break a table nor inject
markup or raw HTML, whichever renderer reads the file."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_MD_SPECIAL = re.compile(r"([\\`*|<>\[\]#&])|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def md_escape(value: Any) -> str:
    """Text safe inside a Markdown table cell or paragraph: one line, `|` and markup characters escaped
    (a backslash before `<`, `>` and `&` makes them literal text in CommonMark, never HTML)."""
    return _escaped(value) if isinstance(value, str) else _escape(str(value))


def _escape(s: str) -> str:
    s = " ".join(s.split())
    return _MD_SPECIAL.sub(lambda m: "\\" + m.group(0), s)


_escaped = lru_cache(maxsize=1 << 16)(_escape)  # a report's cells repeat ("—", labels, figures)


def md_code(text: str, lang: str = "") -> str:
    """A fenced block whose fence is longer than any backtick run inside."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"
