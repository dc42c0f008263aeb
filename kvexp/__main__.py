import os
import signal
import sys

from kvexp import _ENDING as _HANDLED  # SIGINT, TERM, HUP, QUIT, USR1, USR2


def _loading(signum: int, frame: object) -> None:
    for sig in _HANDLED:  # the first signal decides the line and the exit status
        signal.signal(sig, _later)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _later(signum: int, frame: object) -> None:
    """A signal after the one that ends kvexp: nothing."""


if __name__ == "__main__":  # a spawned worker process imports this module too
    # a signal while kvexp is still loading ends it in one line, like anywhere else (each command puts
    # its own handlers in place of these)
    for _sig in _HANDLED:
        signal.signal(_sig, _loading)
    try:
        from kvexp.app.cli import entry
    except KeyboardInterrupt as e:
        name = str(e) or "SIGINT"
        print(f"kvexp: interrupted by {name}", file=sys.stderr, flush=True)
        os._exit(128 + signal.Signals[name])  # not sys.exit: Python's own exit may end by SIGINT instead
    entry()
