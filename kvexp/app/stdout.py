"""Standard output that goes away while kvexp writes to it: a pipe whose reader has left (`| head -1`),
a full device (`> /dev/full`), an I/O error. The first write that fails sends the rest to /dev/null, and
the command goes on (a run keeps measuring and saving: its results are in files); at its end the exit
status says output was lost: 141 (128 + SIGPIPE, as a shell reports a program a closed pipe ended) for
a pipe whose reader left, quietly as such programs do; else one line on stderr and 1. A standard output
already closed when kvexp starts (`>&-`) is refused at once: the first file kvexp opened would take its
place and receive what was meant for it."""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, Optional, TextIO

CLOSED_PIPE_STATUS = 128 + 13  # SIGPIPE


class Guarded:
    """sys.stdout whose writes never raise OSError; `lost` is the first error."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self.lost: Optional[OSError] = None

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                return self._stream.write(text)
            except OSError as e:
                self._lose(e)
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self._stream.flush()
            except OSError as e:
                self._lose(e)

    def _lose(self, e: OSError) -> None:
        self.lost = e
        try:  # what is still buffered, and Python's flush at exit, go nowhere instead of failing again
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer, ...
        return getattr(self._stream, name)


def guard() -> None:
    """Put the guard in place of sys.stdout; a closed one ends kvexp in one line, exit status 1."""
    if sys.stdout is None:
        sys.exit("kvexp: standard output is closed (discard it with >/dev/null instead)")
    if not isinstance(sys.stdout, Guarded):
        sys.stdout = Guarded(sys.stdout)  # type: ignore[assignment]


def status(code: int) -> int:
    """The command's exit status, once output it wrote was lost (see the module's docstring)."""
    out = sys.stdout
    if not isinstance(out, Guarded):
        return code
    out.flush()
    if out.lost is None:
        return code
    if out.lost.errno == errno.EPIPE:
        return code or CLOSED_PIPE_STATUS
    try:
        print(f"kvexp: could not write to standard output: {out.lost.strerror or out.lost}", file=sys.stderr)
    except OSError:
        pass
    return code or 1
