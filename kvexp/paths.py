"""Where kvexp's own data folders are: the repository's top level in a source checkout, or
kvexp/_data/ in an installed wheel (pyproject ships conf/, templates/ and schema/ there)."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    for cand in (_PKG.parent / name, _PKG / "_data" / name):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(f"kvexp's {name}/ folder is missing from this installation")
