"""The load generator: closed- or open-loop levels from one aiohttp ClientSession per sending process,
and the only clock in kvexp.

Every request is timed with time.perf_counter (sent, first token, every token arrival, done), relative
to one origin, into a RequestRecord (kvexp/metrics/records.py); derived numbers are left to stats.py. A
request is sent when it starts to go out on its connection (client.TimedRequest); the time before that
since it was due (scheduled_s: its open-loop time, or the moment its closed-loop stream was free) is
client-side queueing, recorded apart from server latency: waiting for a free place or the start-rate
cap, opening a connection, a busy event loop.

A level runs either on the job's own event loop or, when one loop would not keep up, sharded over
worker processes (workers.py: one event loop and one session each, on the same clock). Records come
back to the parent when the level ends; progress comes back while it runs.

The hot path reads whatever bytes have arrived (`readany`), takes one timestamp per read, and splits
the bytes into lines for the adapter's parser: every line of one read arrived at the same moment, so it
carries the same time."""

from __future__ import annotations

import asyncio
import math
import random
import time
import weakref
from typing import Any, Optional, Protocol, Sequence

import aiohttp

from kvexp.backends.base import Request
from kvexp.measure.client import (SENT_AT, ClientOptions, LevelRun, NullObserver, Observer, Streamer, pre_encode,
                                  connection_error, start_throttle)
from kvexp.measure.eventloop import LoopLagMonitor, loop_name, no_gc_pauses
from kvexp.measure.workers import ABANDON_GRACE_S, WorkerPool, close_pools, resolve_workers, runs_in_process
from kvexp.metrics.records import RequestRecord

SPIN_S = 0.002  # a scheduled start's last stretch, waited by yielding rather than by a timer
SPIN_SHARE = 0.25  # at most this share of each second goes to such waits (beyond it: the timer alone)


class Conversation(Protocol):
    """A multi-turn conversation the load generator plays (kvexp/measure/traffic.py builds them): `turn(t,
    previous)` builds turn t's request from the turns before it (previous: turn t-1's record, with its
    generated text); `think_s[t]` is the pause after turn t-1 ends before turn t is due."""

    turns: int
    think_s: list[float]

    async def turn(self, t: int, previous: Optional[RequestRecord]) -> tuple[Request, RequestRecord]: ...


class LoadGenerator:
    """Sends a level's requests on this event loop and times each one; run_level shards a level over
    worker processes (workers.WorkerPool, which runs this class in each) when the options ask for it."""

    def __init__(self, session: aiohttp.ClientSession, streamer: Streamer,
                 observer: Optional[Observer] = None, origin: Optional[float] = None):
        self.session = session
        self.streamer = streamer
        self.observer = observer or NullObserver()
        self.origin = time.perf_counter() if origin is None else origin
        # llama-server closes the connection after every streamed response; saying so up front keeps
        # aiohttp from reusing a socket the server is closing (a false connection error)
        self.headers = {"Content-Type": "application/json"}
        if not streamer.stream_keepalive:
            self.headers["Connection"] = "close"
        self._pools: list[WorkerPool] = []  # at most one, kept across levels
        self.reads = 0  # response reads so far on this event loop
        self.from_workers = False  # the level running now sends from worker processes (their reads are not in reads)
        # the first connection the server's port refused, this level: nothing listens there, so the level
        # sends nothing more (the runner asks the port again; a worker process does the same on its own)
        self.refused: Optional[str] = None
        self.spin_window_s, self.spun_s = 0.0, 0.0  # this second of the run, and time spent yielding in it
        weakref.finalize(self, close_pools, self._pools)

    def now(self) -> float:
        return time.perf_counter() - self.origin

    async def until(self, t: float) -> None:
        """Wait until time t on this run's clock. The event loop's timers wake up to a millisecond late
        (epoll and libuv count milliseconds), so the last SPIN_S are waited by yielding to the loop
        (other requests' streams go on meanwhile) instead of by a timer; yielding keeps a core busy, so
        it takes at most SPIN_SHARE of each second (at high rates starts are then up to a millisecond
        late, the timer's own error, rather than the client's CPU figures being inflated)."""
        delay = t - self.now()
        if delay > SPIN_S:
            await asyncio.sleep(delay - SPIN_S)
        now = self.now()
        if now - self.spin_window_s >= 1.0:
            self.spin_window_s, self.spun_s = now, 0.0
        if self.spun_s >= SPIN_SHARE:
            if t > now:
                await asyncio.sleep(t - now)
            return
        while self.now() < t:
            await asyncio.sleep(0)
        self.spun_s += self.now() - now

    async def send(self, req: Request, rec: RequestRecord, data: Optional[bytes] = None) -> RequestRecord:
        """Send one streaming request and time it. Never raises for a failed request. `data` is the
        request body already encoded (pre_encode), so that encoding stays off the measured path."""
        if self.refused is not None:  # nothing listens on the server's port: no request goes to it
            rec.error_kind, rec.error = "connection", f"not sent: {self.refused}"
            self.observer.request_done(rec)
            return rec
        if data is None:
            data = pre_encode(req)
        headers = self.headers
        parse = self.streamer.parse_line
        perf = time.perf_counter
        origin = self.origin
        saw_done = False
        times = rec.token_times_s
        keep = rec.text
        repeats, last = 0, None  # how often the last output token's text came again in a row
        wrote: list[float] = []  # TimedRequest notes when the request went out
        token = SENT_AT.set(wrote)
        rec.sent_s = perf() - origin
        if rec.scheduled_s is None:  # a closed loop: it was due the moment its stream was free
            rec.scheduled_s = rec.sent_s
        try:
            async with self.session.post(req.path, data=data, headers=headers) as resp:
                SENT_AT.reset(token)
                if wrote:
                    rec.sent_s = wrote[0] - origin
                rec.http_status = resp.status
                if resp.status != 200:
                    body = (await resp.read())[:300].decode("utf-8", "replace")
                    rec.error_kind, rec.error = "http_status", f"HTTP {resp.status}: {body.strip()}"
                else:
                    read = resp.content.readany
                    rest = b""
                    while True:
                        chunk = await read()
                        if not chunk:
                            lines = [rest] if rest else []
                        else:
                            self.reads += 1  # the server watch's sign of life (a closed stream is none)
                            t = perf() - origin  # every line of this read arrived now
                            lines = (rest + chunk if rest else chunk).split(b"\n")
                            rest = lines.pop()  # an unfinished line waits for the next read
                        for line in lines:
                            if not line:
                                continue
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
                                times.append(t)
                                piece = ev.text.strip()
                                repeats, last = (repeats + 1, last) if piece == last else (0, piece)
                                if keep is not None:
                                    keep.append(ev.text)
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
                        if rec.error_kind is not None or not chunk:
                            break
                    if rec.error_kind is None and not saw_done:
                        why = self.streamer.unfinished_stream(repeats)
                        rec.error_kind, rec.error = "protocol", "stream ended before its final event" + (
                            f": {why}" if why else "")
        except asyncio.TimeoutError:
            rec.error_kind, rec.error = "timeout", "no response bytes within the stall or total timeout"
        except aiohttp.ClientPayloadError as e:
            rec.error_kind, rec.error = "protocol", f"truncated or malformed response: {e}"
        except (aiohttp.ClientError, OSError) as e:
            rec.error_kind, rec.error = "connection", connection_error(e)
            if isinstance(e, aiohttp.ClientConnectorError) and isinstance(e.os_error, ConnectionRefusedError):
                self.refused = self.refused or rec.error
        rec.done_s = perf() - origin
        if wrote:  # also when the request failed after it went out
            rec.sent_s = wrote[0] - origin
        if SENT_AT.get() is wrote:
            SENT_AT.reset(token)
        if rec.ok and rec.first_token_s is None:
            rec.error_kind, rec.error = "protocol", "the response carried no output token"
        self.observer.request_done(rec)
        return rec

    async def closed_loop(self, requests: Sequence[tuple[Request, RequestRecord]], concurrency: int,
                          throttle: Any = None, bodies: Optional[Sequence[bytes]] = None) -> list[RequestRecord]:
        """`concurrency` streams; each sends its next request as soon as its previous one ends (after
        the start-rate cap, when one is given: the wait is client-side queueing)."""
        if bodies is None:
            bodies = [pre_encode(r) for r, _ in requests]
        self.refused = None
        queue = list(reversed(range(len(requests))))

        async def stream() -> None:
            while queue:
                i = queue.pop()
                req, rec = requests[i]
                if throttle is not None:
                    rec.scheduled_s = self.now()  # the wait for the start-rate cap is client-side queueing
                    async with throttle:
                        pass
                await self.send(req, rec, bodies[i])

        await asyncio.gather(*(stream() for _ in range(min(concurrency, len(requests)))))
        return [rec for _, rec in requests]

    async def conversation_loop(self, conversations: Sequence[Conversation], concurrency: int) -> list[RequestRecord]:
        """`concurrency` streams; each plays its next conversation turn by turn: turn t is built once
        turn t-1 has ended (during the think time) and is due think_s[t] after that end, so time spent
        building it beyond the think time is client-side queueing. A failed turn ends its
        conversation (the turns after it are not sent)."""
        self.refused = None
        queue = list(reversed(range(len(conversations))))
        records: list[RequestRecord] = []

        async def stream() -> None:
            while queue:
                conv = conversations[queue.pop()]
                previous: Optional[RequestRecord] = None
                for t in range(conv.turns):
                    due = None if previous is None else previous.done_s + conv.think_s[t]
                    req, rec = await conv.turn(t, previous)
                    if due is not None:
                        await self.until(due)
                        rec.scheduled_s = due
                    records.append(await self.send(req, rec))
                    if not rec.ok:
                        break
                    previous = rec

        await asyncio.gather(*(stream() for _ in range(min(concurrency, len(conversations)))))
        return records

    async def open_loop(self, requests: Sequence[tuple[Request, RequestRecord]],
                        offsets_s: Sequence[float], max_concurrency: Optional[int] = None,
                        throttle: Any = None, bodies: Optional[Sequence[bytes]] = None,
                        start_s: Optional[float] = None) -> list[RequestRecord]:
        """Start request i at offsets_s[i] after the level's start (start_s on this run's clock, or
        now), whatever the server does; with max_concurrency, a request whose time has come waits for
        a free place, and with a throttle for its turn under the start-rate cap (both waits are
        client-side queueing: sent_s - scheduled_s)."""
        if bodies is None:
            bodies = [pre_encode(r) for r, _ in requests]
        self.refused = None
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        start = self.now() if start_s is None else start_s

        async def one(i: int, offset: float) -> None:
            req, rec = requests[i]
            rec.scheduled_s = start + offset
            await self.until(rec.scheduled_s)
            if throttle is not None:
                async with throttle:
                    pass
            if sem is None:
                await self.send(req, rec, bodies[i])
            else:
                async with sem:
                    await self.send(req, rec, bodies[i])

        await asyncio.gather(*(one(i, off) for i, off in enumerate(offsets_s[:len(requests)])))
        return [rec for _, rec in requests]

    async def run_level(self, requests: Sequence[tuple[Request, RequestRecord]], *,
                        concurrency: Optional[int] = None, offsets_s: Optional[Sequence[float]] = None,
                        max_concurrency: Optional[int] = None, max_start_rate: Optional[float] = None,
                        options: Optional[ClientOptions] = None) -> LevelRun:
        """One measured level: closed loop (`concurrency`) or open loop (`offsets_s`), on this event
        loop or sharded over worker processes as `options` says. Measures the client's own loop lag
        and CPU while it runs."""
        if (concurrency is None) == (offsets_s is None):
            raise ValueError("give either concurrency (closed loop) or offsets_s (open loop)")
        streams = concurrency if concurrency is not None else (max_concurrency or len(requests))
        setting = options.workers if options else 1
        workers = resolve_workers(setting, streams)
        self.from_workers = not runs_in_process(setting, workers, options.event_loop if options else "auto")
        if not self.from_workers:
            return await self._run_here(requests, concurrency, offsets_s, max_concurrency, max_start_rate)
        assert options is not None
        pool = self._pools[0] if self._pools else None
        if pool is None or pool.n != workers or pool.options != options:
            self.close()
            pool = WorkerPool(workers, options, self.streamer, self.origin, type(self))
            self._pools.append(pool)
        try:
            if not pool.procs:
                await pool.start()
            return await pool.run(requests, concurrency, offsets_s, max_concurrency, max_start_rate, self.observer)
        except BaseException:
            # a failed, interrupted or abandoned (hung server) level leaves no worker behind, at once:
            # its workers may be stuck in requests and never read "stop"
            close_pools(self._pools, ABANDON_GRACE_S)
            raise

    async def _run_here(self, requests: Sequence[tuple[Request, RequestRecord]], concurrency: Optional[int],
                        offsets_s: Optional[Sequence[float]], max_concurrency: Optional[int],
                        max_start_rate: Optional[float]) -> LevelRun:
        bodies = [pre_encode(r) for r, _ in requests]
        throttle = start_throttle(max_start_rate)
        if concurrency is not None:
            return await self.measured(self.closed_loop(requests, concurrency, throttle, bodies))
        assert offsets_s is not None
        return await self.measured(self.open_loop(requests, offsets_s, max_concurrency, throttle, bodies))

    async def run_conversations(self, conversations: Sequence[Conversation], concurrency: int) -> LevelRun:
        """A multi-turn level, on this event loop (each turn is built from the server's answer to the
        one before, through the adapter: it cannot be sharded over worker processes)."""
        return await self.measured(self.conversation_loop(conversations, concurrency))

    async def measured(self, sending: Any) -> LevelRun:
        """Await `sending` (a coroutine returning the level's records) on this event loop, measuring
        the loop's wake-up lag and the process's CPU while it runs."""
        cpu0, t0 = time.process_time(), time.perf_counter()
        with LoopLagMonitor() as lag, no_gc_pauses():
            records = await sending
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        return LevelRun(records=records, workers=1, in_process=True, event_loop=loop_name(),
                        loop_lag_p99_ms=lag.p99_ms(), cpu_util=[round(cpu / wall, 3) if wall > 0 else 0.0],
                        cpu_s=cpu)

    def close(self) -> None:
        """Stop worker processes, if any were started (they also stop when this process exits)."""
        close_pools(self._pools)


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
