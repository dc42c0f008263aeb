"""kvexp: which LLM server, KV-cache dtype and concurrency for your GPU, measured.

The public API: `results_frame` (levels of any mix of result files as a pandas DataFrame) and
`__version__`. The command line is `python -m kvexp`; everything else is internal (docs/ARCHITECTURE.md)."""

import os as _os
import signal as _signal
import sys as _sys

# The signals that end kvexp in one line (kvexp.backends.process.HANDLED, kvexp/__main__.py): from the
# first line of the package, not only once __main__ runs, when kvexp is started as `python -m kvexp`.
_ENDING = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT, _signal.SIGUSR1, _signal.SIGUSR2)


def _as_main() -> bool:
    """Whether this process is kvexp's command: `python -m kvexp` or the `kvexp` script."""
    argv = getattr(_sys, "orig_argv", [])
    for i, a in enumerate(argv[1:], 1):
        if a.startswith("-m"):
            return (a[2:] or (argv[i + 1] if i + 1 < len(argv) else "")) == "kvexp"
        if not a.startswith("-"):
            return _os.path.basename(a) == "kvexp"
    return False


def _ending(signum: int, frame: object) -> None:
    """A signal while the package itself loads: nothing has started, so nothing is stopped; one line."""
    _os.write(2, f"kvexp: interrupted by {_signal.Signals(signum).name}\n".encode())
    _os._exit(128 + signum)


if _as_main():  # __main__ puts its own in place as soon as it runs
    for _sig in _ENDING:
        _signal.signal(_sig, _ending)

from kvexp.core import __version__  # noqa: E402

__all__ = ["__version__", "results_frame"]


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name == "results_frame":
        # lazy: importing kvexp (every server sampler and worker process does) must not load the report stack
        from kvexp.report.frame import results_frame

        return results_frame
    raise AttributeError(f"module 'kvexp' has no attribute {name!r}")
