"""The load generator: one aiohttp ClientSession per run, closed- or open-loop levels, and the only
clock in kvexp. Every request is timed with time.perf_counter (sent, first token, every token
arrival, done); derived numbers are left to stats.py. Client-side queueing (open loop, a request that
waited for its turn) is recorded apart from server latency."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Protocol, Sequence

import aiohttp

from kvexp.backends.base import Request, StreamEvent

ERROR_KINDS = ("timeout", "http_status", "connection", "protocol")


@dataclass
class RequestRecord:
    """One request, raw. Times are seconds on the perf_counter clock, relative to the run's origin."""

    index: int
    level: float  # concurrency (closed loop) or rate in requests/s (open loop)
    repeat: int = 0
    warmup: bool = False
    scheduled_s: Optional[float] = None  # open loop: when it should have started
    sent_s: Optional[float] = None
    first_token_s: Optional[float] = None
    done_s: Optional[float] = None
    token_times_s: list[float] = field(default_factory=list)  # every token arrival
    target_prompt_tokens: Optional[int] = None
    max_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None  # the server's own count (usage)
    output_tokens: Optional[int] = None  # the server's own count (usage)
    finish_reason: Optional[str] = None
    http_status: Optional[int] = None
    error_kind: Optional[str] = None  # timeout | http_status | connection | protocol
    error: Optional[str] = None
    server_timings: Optional[dict[str, float]] = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Streamer(Protocol):
    def parse_line(self, line: bytes) -> Optional[StreamEvent]: ...


class Observer(Protocol):
    def level_started(self, level: float, total: int, repeat: int) -> None: ...
    def request_done(self, record: RequestRecord) -> None: ...
    def level_done(self, level: float, summary: dict[str, Any]) -> None: ...


class NullObserver:
    def level_started(self, level: float, total: int, repeat: int) -> None: pass
    def request_done(self, record: RequestRecord) -> None: pass
    def level_done(self, level: float, summary: dict[str, Any]) -> None: pass


def make_session(base_url: str, max_connections: int, request_timeout_s: float,
                 stall_timeout_s: float, headers: Optional[dict[str, str]] = None) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=max(1, max_connections), limit_per_host=0,
                                     force_close=False, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_read=stall_timeout_s)
    return aiohttp.ClientSession(base_url=base_url, connector=connector, timeout=timeout,
                                 headers=headers, raise_for_status=False)


class LoadGenerator:
    def __init__(self, session: aiohttp.ClientSession, streamer: Streamer,
                 observer: Optional[Observer] = None):
        self.session = session
        self.streamer = streamer
        self.observer = observer or NullObserver()
        self.origin = time.perf_counter()
        # llama-server closes the connection after every streamed response; saying so up front keeps
        # aiohttp from reusing a socket the server is closing (a false connection error)
        self.headers = {"Content-Type": "application/json"}
        if not getattr(streamer, "stream_keepalive", True):
            self.headers["Connection"] = "close"

    def now(self) -> float:
        return time.perf_counter() - self.origin

    async def send(self, req: Request, rec: RequestRecord) -> RequestRecord:
        """Send one streaming request and time it. Never raises for a failed request."""
        data = json.dumps(req.body).encode()
        headers = self.headers
        parse = self.streamer.parse_line
        perf = time.perf_counter
        origin = self.origin
        saw_done = False
        rec.sent_s = perf() - origin
        try:
            async with self.session.post(req.path, data=data, headers=headers) as resp:
                rec.http_status = resp.status
                if resp.status != 200:
                    body = (await resp.read())[:300].decode("utf-8", "replace")
                    rec.error_kind, rec.error = "http_status", f"HTTP {resp.status}: {body.strip()}"
                else:
                    async for line in resp.content:
                        t = perf() - origin
                        ev = parse(line)
                        if ev is None or saw_done:
                            continue
                        if ev.error:
                            rec.error_kind = "protocol"
                            rec.error = ev.error
                            break
                        if ev.content:
                            if rec.first_token_s is None:
                                rec.first_token_s = t
                            rec.token_times_s.append(t)
                        if ev.prompt_tokens is not None:
                            rec.prompt_tokens = ev.prompt_tokens
                        if ev.output_tokens is not None:
                            rec.output_tokens = ev.output_tokens
                        if ev.finish_reason is not None:
                            rec.finish_reason = ev.finish_reason
                        if ev.server_timings:
                            rec.server_timings = ev.server_timings
                        if ev.done:
                            saw_done = True  # read on to the end, so the connection can be reused
                    if rec.error_kind is None and not saw_done:
                        rec.error_kind, rec.error = "protocol", "stream ended before its final event"
        except asyncio.TimeoutError:
            rec.error_kind, rec.error = "timeout", "no response bytes within the stall or total timeout"
        except aiohttp.ClientPayloadError as e:
            rec.error_kind, rec.error = "protocol", f"truncated or malformed response: {e}"
        except (aiohttp.ClientError, OSError) as e:
            rec.error_kind, rec.error = "connection", f"{type(e).__name__}: {e}"
        rec.done_s = perf() - origin
        if rec.ok and rec.first_token_s is None:
            rec.error_kind, rec.error = "protocol", "the response carried no output token"
        self.observer.request_done(rec)
        return rec

    async def closed_loop(self, requests: Sequence[tuple[Request, RequestRecord]],
                          concurrency: int) -> list[RequestRecord]:
        """`concurrency` workers; each sends its next request as soon as its previous one ends."""
        queue = list(reversed(requests))

        async def worker() -> None:
            while queue:
                req, rec = queue.pop()
                await self.send(req, rec)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
        return [rec for _, rec in requests]

    async def open_loop(self, requests: Sequence[tuple[Request, RequestRecord]],
                        offsets_s: Sequence[float], max_concurrency: Optional[int] = None,
                        throttle: Any = None) -> list[RequestRecord]:
        """Start request i at offsets_s[i] after the level's start, whatever the server does; with
        max_concurrency, a request whose time has come waits for a free place (its wait is
        client-side queueing: sent_s - scheduled_s)."""
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        start = self.now()

        async def one(req: Request, rec: RequestRecord, offset: float) -> None:
            rec.scheduled_s = start + offset
            delay = rec.scheduled_s - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            if throttle is not None:
                async with throttle:
                    pass
            if sem is None:
                await self.send(req, rec)
            else:
                async with sem:
                    await self.send(req, rec)

        await asyncio.gather(*(one(r, rec, off) for (r, rec), off in zip(requests, offsets_s)))
        return [rec for _, rec in requests]


def arrival_offsets(n: int, rate: float, arrival: str, seed: int) -> list[float]:
    """Seeded arrival schedule, computed ahead of time: constant spacing or Poisson arrivals."""
    if arrival == "constant":
        return [i / rate for i in range(n)]
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += -math.log(1.0 - rng.random()) / rate
    return out


class LoopLagMonitor:
    """Measures how late the event loop wakes up; a busy client shows as lag."""

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

    def __enter__(self) -> "LoopLagMonitor":
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task:
            self._task.cancel()
