"""Sampling the server's own gauges (KV usage, running and waiting requests) fast enough to see their
peaks, without slowing the load generator.

A gauge polled every 0.2 s gives 2-3 samples in a short level and misses the peak (a vLLM level with
preemptions, whose cache was therefore full, read "peak KV usage 13 %"). The sampler runs in a process of
its own (its own event loop and HTTP session, so neither the GIL nor the loop of the sending process is
shared with it), polls every `interval_s` (tens of ms), and keeps per-window aggregates: the parent asks
for a window's peaks at the end of each level. The adapter's `poll` is what it calls, so every backend
is sampled the same way."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

from kvexp.backends.base import connector

DEFAULT_INTERVAL_S = 0.02


@dataclass
class Window:
    """What the sampler saw since the previous window (None: not exposed or never sampled)."""

    samples: int = 0  # polls that returned a KV usage
    polls: int = 0
    failures: int = 0
    peak_kv_usage: Optional[float] = None
    max_running: Optional[int] = None
    max_waiting: Optional[int] = None
    interval_s: float = DEFAULT_INTERVAL_S
    poll_p50_ms: Optional[float] = None  # how long one poll took (the server's answer time)
    errors: list[str] = field(default_factory=list)

    def add(self, kv: Optional[float], running: Optional[int], waiting: Optional[int]) -> None:
        self.polls += 1
        if kv is not None:
            self.samples += 1
            self.peak_kv_usage = kv if self.peak_kv_usage is None else max(self.peak_kv_usage, kv)
        if running is not None:
            self.max_running = running if self.max_running is None else max(self.max_running, running)
        if waiting is not None:
            self.max_waiting = waiting if self.max_waiting is None else max(self.max_waiting, waiting)


async def _sample_loop(conn: Any, adapter: Any, base_url: str, headers: Optional[dict[str, str]],
                       interval_s: float) -> None:
    adapter.base_url = base_url
    timeout = aiohttp.ClientTimeout(total=max(1.0, 20 * interval_s))
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector()) as session:
        window = Window(interval_s=interval_s)
        durations: list[float] = []
        due = time.perf_counter()
        while True:
            while conn.poll():  # a request from the parent: hand over this window and start a new one
                msg = conn.recv()
                if msg == "stop":
                    return
                if durations:
                    durations.sort()
                    window.poll_p50_ms = round(durations[len(durations) // 2] * 1000, 2)
                conn.send((msg[1], window))  # answered with the request's number
                window, durations = Window(interval_s=interval_s), []
            t = time.perf_counter()
            try:
                s = await adapter.poll(session)
                window.add(s.kv_usage, s.running, s.waiting)
            except Exception as e:  # a poll that fails is counted, never fatal
                window.failures += 1
                if len(window.errors) < 3:
                    window.errors.append(f"{type(e).__name__}: {e}"[:200])
            now = time.perf_counter()
            durations.append(now - t)
            due = max(due + interval_s, now)  # a fixed rate: a slow poll is not followed by a full sleep
            await asyncio.sleep(due - now)


def _main(conn: Any, adapter: Any, base_url: str, headers: Optional[dict[str, str]], interval_s: float) -> None:
    try:  # a sampler that wakes late misses peaks: ask for a little priority where allowed (root)
        os.nice(-5)
    except OSError:
        pass
    try:
        asyncio.run(_sample_loop(conn, adapter, base_url, headers, interval_s))
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass


class TelemetrySampler:
    """The sampling process for one job's server: start(), window() at each level's start and end,
    stop(). Without a process (start failed), windows are empty and say so."""

    def __init__(self, adapter: Any, base_url: str, headers: Optional[dict[str, str]] = None,
                 interval_s: float = DEFAULT_INTERVAL_S):
        self.adapter, self.base_url, self.headers, self.interval_s = adapter, base_url, headers, interval_s
        self._conn: Any = None
        self._proc: Any = None
        self._asked = 0  # the number of the last window asked for
        self.start_error: Optional[str] = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # the parent holds threads (memory sampler)
        parent, child = ctx.Pipe()
        try:
            self._proc = ctx.Process(target=_main, args=(child, self.adapter, self.base_url, self.headers,
                                                         self.interval_s), daemon=True, name="kvexp-telemetry")
            self._proc.start()
        except Exception as e:
            self.start_error = f"{type(e).__name__}: {e}"
            self._proc = None
            return
        self._conn = parent

    def window(self, timeout_s: float = 10.0) -> Window:
        """The aggregates since the previous call (call once at a level's start to open its window).
        Each request is numbered: an answer that comes after its request timed out is dropped when it
        arrives, never handed to the next level as its own (which would shift every later window)."""
        if self._conn is None or self._proc is None or not self._proc.is_alive():
            return Window(interval_s=self.interval_s, errors=[self.start_error or "the sampling process is not running"])
        self._asked += 1
        deadline = time.monotonic() + timeout_s
        try:
            self._conn.send(("window", self._asked))
            while self._conn.poll(max(0.0, deadline - time.monotonic())):
                number, window = self._conn.recv()
                if number == self._asked:
                    return window
        except (OSError, EOFError):
            pass
        return Window(interval_s=self.interval_s, errors=["the sampling process did not answer"])

    def stop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send("stop")
            except (OSError, EOFError):
                pass
        if self._proc is not None:
            self._proc.join(3)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(1)
        self._conn = self._proc = None
