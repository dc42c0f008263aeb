"""The sending event loop itself: which kind runs (asyncio, or uvloop where installed), how late it
wakes up (LoopLagMonitor: the client's own timing error), and no garbage-collector pause while a level
is measured."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from typing import Iterator, Optional

from kvexp.metrics.stats import percentile

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is optional (the `fast` extra)
    uvloop = None


def running_loop_kind() -> str:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return "asyncio"
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def loop_name(kind: Optional[str] = None) -> str:
    """The event loop with its version where it has one, e.g. "asyncio" or "uvloop 0.21.0"."""
    kind = kind or running_loop_kind()
    if kind == "uvloop" and uvloop is not None:
        return f"uvloop {uvloop.__version__}"
    return "asyncio"


def uvloop_available() -> bool:
    return uvloop is not None


def worker_loop_kind(event_loop: str) -> str:
    """The kind of event loop a worker process runs for the setting client.event_loop."""
    if event_loop == "uvloop" and not uvloop_available():
        raise RuntimeError("client.event_loop=uvloop but uvloop is not installed: pip install 'kvexp[fast]' "
                           "or set client.event_loop=asyncio")
    if event_loop == "auto":
        return "uvloop" if uvloop_available() else "asyncio"
    return event_loop


def new_runner(kind: str) -> asyncio.Runner:
    """An asyncio.Runner for a process of its own, on the kind of loop worker_loop_kind chose."""
    if kind == "uvloop":
        assert uvloop is not None
        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    return asyncio.Runner()


class LoopLagMonitor:
    """Measures how late the event loop wakes up from a short sleep. A loop busy with other callbacks
    (or a process starved of CPU) wakes late, and every token timestamp it takes is late by about as
    much: the lag is the client's own timing error."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.lags_s: list[float] = []
        self._task: Optional[asyncio.Task] = None

    async def _run(self) -> None:
        perf = time.perf_counter
        while True:
            t = perf()
            await asyncio.sleep(self.interval_s)
            self.lags_s.append(max(0.0, perf() - t - self.interval_s))

    def p99_ms(self) -> Optional[float]:
        p99 = percentile(self.lags_s, 99)
        return None if p99 is None else round(p99 * 1000, 3)

    def __enter__(self) -> "LoopLagMonitor":
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task:
            self._task.cancel()


@contextlib.contextmanager
def no_gc_pauses() -> Iterator[None]:
    """No garbage-collector pause while a level is measured: in a long-lived process (a sweep runs
    every job in one) a full collection stops the event loop for tens of milliseconds, and every
    timestamp taken behind it is late. What exists is frozen (not scanned until the level ends), and
    collection resumes when it ends. No collection is forced here: one runs finalisers and weakref
    callbacks, where an exception raised by a signal handler (Ctrl-C) would be ignored."""
    was = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        gc.unfreeze()
