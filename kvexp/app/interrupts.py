"""Ctrl-C in a subcommand that is not a run (`report`, `install`): SIGINT, SIGTERM and SIGHUP end it as they
end a run (kvexp.backends.process.raise_on_signals): one line on stderr, no traceback, exit status
128+signal; and what an install cut short may leave half-written where kvexp looks is removed."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Callable, Optional

from kvexp.assets import install
from kvexp.backends.process import (end_by, interrupt_answered, raise_if_interrupted, raise_on_signals,
                                    restore_signals)


def quiet_on_signals(command: str, work: Callable[[], int], cleanup: Optional[Callable[[], str]] = None) -> int:
    """Run `work` so that a signal ends it in one line: `kvexp <command>: interrupted by SIGINT` plus what
    `cleanup` (run after the signal) returns. A terminal's Ctrl-C reaches every process of its foreground
    group: a process forked from this one while it works (the report's PDF layout workers) leaves at
    once and silently, and this one ends the work."""
    me = os.getpid()

    def on_signal(signum: int, frame: object) -> None:
        if os.getpid() != me:  # a forked worker: its parent has the same signal and ends the work
            os._exit(128 + signum)
        end_by(signum)

    handlers = raise_on_signals(on_signal)
    try:
        status = work()
        raise_if_interrupted()
        return status
    except KeyboardInterrupt as e:
        name = str(e) if str(e) in signal.Signals.__members__ else "SIGINT"
        return interrupted(f"kvexp {command}: interrupted by {name}{cleanup() if cleanup else ''}", name)
    finally:
        restore_signals(handlers)


def interrupted(line: str, name: str) -> int:
    """Say how a signal ended the command, in one line on stderr, and return its exit status (128+signal).
    The signal is then answered: a command around this one (resume around a run) says nothing more."""
    interrupt_answered()
    try:
        print(line, file=sys.stderr)
    except OSError:  # SIGHUP: the terminal may be gone
        pass
    return 128 + signal.Signals[name]


def half_installed(what: str, force: bool, build: str = "cpu") -> list[Path]:
    """What an install of `what` cut short may leave half-written where kvexp looks: the copy of a built
    program before it is renamed into place (`<target>.tmp`, see kvexp.assets.install), and a vLLM venv
    that held no vLLM when the install began (or that --force starts again). Downloads, build trees and
    the model's conversion live in temporary folders their own code removes on the way out, and every
    finished file is renamed into place whole."""
    if what == "llamacpp":
        return [install.cached_llama_tool(t, build).with_suffix(".tmp") for t in install.LLAMA_TOOLS]
    if what == "ollama":
        return [install.cached_ollama().with_suffix(".tmp")]
    if what == "vllm" and (force or install.vllm_python(install.vllm_venv(build)) is None):
        return [install.vllm_venv(build)]
    return []


def remove(paths: list[Path], what: str) -> str:
    """Remove paths (files or folders); the note for the interrupt's line."""
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return f"; nothing {what} is kept"


def cut_short(made: list[Path], out: Path) -> str:
    """A report a signal cut short: the folder it made is removed; one it was given (it held something
    before) may now hold part of this report beside what was there."""
    return remove(made, "half-written") if made else f"; {out} may hold a half-written report"
