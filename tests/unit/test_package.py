"""The package as source: no name used that is not defined (pyflakes), e.g. an exception class raised
without being imported, which turns the error it reports into a NameError."""

from __future__ import annotations

from pyflakes import api, messages, reporter

from conftest import ROOT

PKG = ROOT / "kvexp"


class _Collect(reporter.Reporter):
    def __init__(self) -> None:
        self.found: list[str] = []

    def flake(self, message) -> None:  # noqa: D401 - pyflakes' interface
        if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
            self.found.append(str(message))

    def unexpectedError(self, filename, msg) -> None:
        self.found.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:
        self.found.append(f"{filename}:{lineno}: {msg}")


def test_no_undefined_names_in_the_package():
    r = _Collect()
    api.checkRecursive([str(PKG)], r)
    assert r.found == []
