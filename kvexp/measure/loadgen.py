"""The load generator: closed- or open-loop levels, one aiohttp ClientSession per process that sends
requests, and the only clock in kvexp.

Every request is timed with time.perf_counter (sent, first token, every token arrival, done), relative
to one origin; derived numbers are left to stats.py. A request is sent when it starts to go out on
its connection (TimedRequest); the time before that since it was due (scheduled_s: its open-loop time,
or the moment its closed-loop stream was free) is client-side queueing, recorded apart from server
latency: waiting for a free place or the start-rate cap, opening a connection, a busy event loop.

A level runs either on the job's own event loop or, when one loop would not keep up, sharded over
worker processes (one event loop each, optionally uvloop, one ClientSession each). Workers measure on
the same clock: perf_counter is CLOCK_MONOTONIC on Linux, one system-wide clock, so a worker's
`perf_counter() - origin` is directly comparable with the parent's (checked when a worker starts).
Records come back to the parent when the level ends; progress comes back while it runs.

The hot path reads whatever bytes have arrived (`readany`), takes one timestamp per read, and splits
the bytes into lines for the adapter's parser: every line of one read arrived at the same moment, so it
carries the same time."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import json
import math
import multiprocessing
import queue
import random
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional, Protocol, Sequence

import aiohttp

from kvexp.core import machine
from kvexp.backends.base import Request, StreamEvent, connector

ERROR_KINDS = ("timeout", "http_status", "connection", "protocol")
STREAMS_PER_WORKER = 64  # workers=auto: one worker process per this many concurrent streams
PROGRESS_INTERVAL_S = 0.25  # how often a worker reports finished requests to the parent
WORKER_START_TIMEOUT_S = 120.0
ABANDON_GRACE_S = 0.5  # workers of a level cut short get this long to stop before they are killed
SPIN_S = 0.002  # a scheduled start's last stretch, waited by yielding rather than by a timer
SPIN_SHARE = 0.25  # at most this share of each second goes to such waits (beyond it: the timer alone)


@dataclass
class RequestRecord:
    """One request, raw. Times are seconds on the perf_counter clock, relative to the run's origin."""

    index: int
    level: float  # concurrency (closed loop) or rate in requests/s (open loop)
    repeat: int = 0
    warmup: bool = False
    scheduled_s: Optional[float] = None  # when it was due: its open-loop time, or when its stream was free
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
    # where the request came from in the workload (kvexp/workload/spec.py; None: not applicable)
    prefix_group: Optional[int] = None  # which shared prefix it starts with
    conversation: Optional[int] = None  # multi-turn: its conversation and turn (0-based)
    turn: Optional[int] = None
    source_line: Optional[int] = None  # the dataset or trace line it was built from
    # the generated text, kept only when a later turn sends it back as history (never written out)
    text: Optional[list[str]] = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["text"]
        return out


class Streamer(Protocol):
    """What the load generator needs of an adapter (backends.base.Adapter implements it)."""

    stream_keepalive: bool  # False: the server closes the connection after each streamed response

    def parse_line(self, line: bytes) -> Optional[StreamEvent]: ...


class Observer(Protocol):
    """Progress hooks. request_done is called once per finished request, on the event loop that
    measures: keep it O(1) and never block or print from it."""

    def level_started(self, level: float, total: int, repeat: int) -> None: ...
    def request_done(self, record: RequestRecord) -> None: ...
    def level_done(self, level: float, summary: dict[str, Any]) -> None: ...


class Conversation(Protocol):
    """A multi-turn conversation the load generator plays (kvexp/measure/traffic.py builds them): `turn(t,
    previous)` builds turn t's request from the turns before it (previous: turn t-1's record, with its
    generated text); `think_s[t]` is the pause after turn t-1 ends before turn t is due."""

    turns: int
    think_s: list[float]

    async def turn(self, t: int, previous: Optional[RequestRecord]) -> tuple[Request, RequestRecord]: ...


class NullObserver:
    def level_started(self, level: float, total: int, repeat: int) -> None: pass
    def request_done(self, record: RequestRecord) -> None: pass
    def level_done(self, level: float, summary: dict[str, Any]) -> None: pass


_SENT: contextvars.ContextVar[Optional[list[float]]] = contextvars.ContextVar("kvexp_sent", default=None)


class TimedRequest(aiohttp.ClientRequest):
    """aiohttp's request, noting on the perf_counter clock when it starts to go out on its connection
    (the connection is open, the headers are ready, the body is being written): the moment a request
    is sent. What came before (waiting for a connection, opening it, building the request on a busy
    event loop) is the client's own time, recorded as client-side queueing."""

    async def write_bytes(self, *args: Any, **kwargs: Any) -> None:
        holder = _SENT.get()
        if holder is not None and not holder:
            holder.append(time.perf_counter())
        return await super().write_bytes(*args, **kwargs)


def make_session(base_url: str, max_connections: Optional[int], request_timeout_s: float,
                 stall_timeout_s: float, headers: Optional[dict[str, str]] = None) -> aiohttp.ClientSession:
    """The sending process's one session. max_connections None: no limit (an open loop's schedule is
    never held back by the pool)."""
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_read=stall_timeout_s)
    return aiohttp.ClientSession(base_url=base_url, connector=connector(max_connections), timeout=timeout,
                                 headers=headers, raise_for_status=False, request_class=TimedRequest)


@dataclass
class ClientOptions:
    """How a level's requests are sent: on the job's event loop, or over worker processes (each with
    its own loop and session, made from these settings)."""

    base_url: str
    max_connections: Optional[int]  # None: no limit
    request_timeout_s: float
    stall_timeout_s: float
    headers: Optional[dict[str, str]] = None
    workers: int | str = 1  # worker processes, or "auto" (see resolve_workers and runs_in_process)
    event_loop: str = "auto"  # auto | asyncio | uvloop (auto: uvloop in workers when installed)


@dataclass
class LevelRun:
    """A measured level's records and what the client itself saw while sending them."""

    records: list[RequestRecord]
    workers: int  # event loops (processes) that sent the level's requests
    in_process: bool  # True: the job's own event loop sent them
    event_loop: str  # e.g. "asyncio" or "uvloop 0.21.0"
    loop_lag_p99_ms: Optional[float]  # the worst loop's wake-up lag p99 (see LoopLagMonitor)
    cpu_util: list[float]  # CPU time / wall time of each sending process (1.0 = one core busy)
    cpu_s: float  # CPU seconds of all sending processes over the level


def pre_encode(req: Request) -> bytes:
    return json.dumps(req.body).encode()


class LoadGenerator:
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
        self.spin_window_s, self.spun_s = 0.0, 0.0  # this second of the run, and time spent yielding in it
        weakref.finalize(self, _close_pools, self._pools)

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
        if data is None:
            data = pre_encode(req)
        headers = self.headers
        parse = self.streamer.parse_line
        perf = time.perf_counter
        origin = self.origin
        saw_done = False
        times = rec.token_times_s
        keep = rec.text
        wrote: list[float] = []  # TimedRequest notes when the request went out
        token = _SENT.set(wrote)
        rec.sent_s = perf() - origin
        if rec.scheduled_s is None:  # a closed loop: it was due the moment its stream was free
            rec.scheduled_s = rec.sent_s
        try:
            async with self.session.post(req.path, data=data, headers=headers) as resp:
                _SENT.reset(token)
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
                        self.reads += 1  # the server watch's sign of life (kvexp/measure/watch.py)
                        if not chunk:
                            lines = [rest] if rest else []
                        else:
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
                        rec.error_kind, rec.error = "protocol", "stream ended before its final event"
        except asyncio.TimeoutError:
            rec.error_kind, rec.error = "timeout", "no response bytes within the stall or total timeout"
        except aiohttp.ClientPayloadError as e:
            rec.error_kind, rec.error = "protocol", f"truncated or malformed response: {e}"
        except (aiohttp.ClientError, OSError) as e:
            rec.error_kind, rec.error = "connection", f"{type(e).__name__}: {e}"
        rec.done_s = perf() - origin
        if wrote:  # also when the request failed after it went out
            rec.sent_s = wrote[0] - origin
        if _SENT.get() is wrote:
            _SENT.reset(token)
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
        if runs_in_process(setting, workers, options.event_loop if options else "auto"):
            return await self._run_here(requests, concurrency, offsets_s, max_concurrency, max_start_rate)
        assert options is not None
        pool = self._pools[0] if self._pools else None
        if pool is None or pool.n != workers or pool.options != options:
            self.close()
            pool = WorkerPool(workers, options, self.streamer, self.origin)
            self._pools.append(pool)
        try:
            if not pool.procs:
                await pool.start()
            return await pool.run(requests, concurrency, offsets_s, max_concurrency, max_start_rate, self.observer)
        except BaseException:
            # a failed, interrupted or abandoned (hung server) level leaves no worker behind, at once:
            # its workers may be stuck in requests and never read "stop"
            _close_pools(self._pools, ABANDON_GRACE_S)
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
        _close_pools(self._pools)


def _close_pools(pools: list["WorkerPool"], grace_s: float = 5.0) -> None:
    while pools:
        pools.pop().close(grace_s)


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


def start_throttle(max_start_rate: Optional[float]) -> Any:
    """asyncio-throttle's Throttler as a cap of `max_start_rate` request starts per second (a sliding
    window of one second, or of 1/rate seconds for rates below one per second)."""
    if not max_start_rate:
        return None
    from asyncio_throttle import Throttler

    period = 1.0 if max_start_rate >= 1 else 1.0 / max_start_rate
    return Throttler(rate_limit=max(1, int(round(max_start_rate * period))), period=period)


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
        from kvexp.metrics.stats import percentile

        p99 = percentile(self.lags_s, 99)
        return None if p99 is None else round(p99 * 1000, 3)

    def __enter__(self) -> "LoopLagMonitor":
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task:
            self._task.cancel()


def client_environment(run: LevelRun, workers_setting: Any, event_loop_setting: str,
                       previous: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The client as a result's environment records it: kvexp's load generator, its HTTP and JSON
    libraries, the event loop, the most event loops any level used so far and whether they were worker
    processes (rather than the job's own loop)."""
    from kvexp.core import __version__

    try:
        import orjson

        decoder = f"orjson {orjson.__version__}"
    except ImportError:
        decoder = "json"
    previous = previous or {}
    return {"name": "kvexp.loadgen", "version": __version__, "aiohttp": aiohttp.__version__, "json": decoder,
            "event_loop": run.event_loop, "workers": max(run.workers, previous.get("workers") or 0),
            "worker_processes": bool(previous.get("worker_processes")) or not run.in_process,
            "workers_setting": workers_setting, "event_loop_setting": event_loop_setting, "cores": machine.usable_cpus()}


# ----------------------------------------------------------------------------- event loops, workers
def running_loop_kind() -> str:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return "asyncio"
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def loop_name(kind: Optional[str] = None) -> str:
    """The event loop with its version where it has one, e.g. "asyncio" or "uvloop 0.21.0"."""
    kind = kind or running_loop_kind()
    if kind == "uvloop":
        import uvloop

        return f"uvloop {uvloop.__version__}"
    return "asyncio"


def uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def worker_loop_kind(event_loop: str) -> str:
    if event_loop == "uvloop" and not uvloop_available():
        raise RuntimeError("client.event_loop=uvloop but uvloop is not installed: pip install 'kvexp[fast]' "
                           "or set client.event_loop=asyncio")
    if event_loop == "auto":
        return "uvloop" if uvloop_available() else "asyncio"
    return event_loop


DEDICATED_MIN_CORES = 4  # workers=auto: from this many cores on, even one loop gets a process of its own


def resolve_workers(setting: int | str, streams: int) -> int:
    """The worker count for a level: a number as given, or for "auto" one per STREAMS_PER_WORKER
    concurrent streams, leaving two cores (the server's CPU side, the job's own process)."""
    if setting == "auto":
        return max(1, min(machine.usable_cpus() - 2, math.ceil(max(1, streams) / STREAMS_PER_WORKER)))
    return max(1, int(setting))


def runs_in_process(setting: int | str, workers: int, event_loop: str) -> bool:
    """Whether a level's requests go out from the job's own event loop rather than worker processes:
    one loop is enough, the job's loop is the kind asked for, and (auto) the machine has no core to
    spare for a dedicated measuring process."""
    if workers != 1 or event_loop not in ("auto", running_loop_kind()):
        return False
    return setting != "auto" or machine.usable_cpus() < DEDICATED_MIN_CORES


def split_closed(n_requests: int, concurrency: int, workers: int) -> list[tuple[int, list[int]]]:
    """Closed loop over workers: (streams, request indexes) per worker, streams as even as they go
    and requests dealt in proportion to them (in order, so every worker starts at once)."""
    w = max(1, min(workers, concurrency, n_requests))
    streams = [concurrency // w + (1 if i < concurrency % w else 0) for i in range(w)]
    out: list[tuple[int, list[int]]] = [(streams[i], []) for i in range(w)]
    for r in range(n_requests):
        i = min(range(w), key=lambda j: (len(out[j][1]) / streams[j], j))
        out[i][1].append(r)
    return out


class WorkerPool:
    """N worker processes, each with its own event loop and one ClientSession, kept for the load
    generator's lifetime (started on the first sharded level). Each receives its share of a level's
    requests, runs it at a common start time, and returns its records when the level ends."""

    def __init__(self, n: int, options: ClientOptions, streamer: Streamer, origin: float):
        self.n = n
        self.options = options
        self.kind = worker_loop_kind(options.event_loop)
        self.streamer = streamer
        self.origin = origin
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.inboxes: list[_Inbox] = []

    async def start(self) -> None:
        import pickle

        try:
            pickle.dumps(self.streamer)
        except Exception as e:
            raise RuntimeError(f"client.workers: the stream parser cannot be sent to a worker process ({e}); "
                               "set client.workers=1") from None
        ctx = multiprocessing.get_context("spawn")
        for i in range(self.n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(child, self.options, self.streamer, self.kind, self.origin, i),
                            name=f"kvexp-client-{i}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
            self.inboxes.append(_Inbox(parent))
        before = time.perf_counter()
        for i in range(self.n):
            msg = await self._recv(i, WORKER_START_TIMEOUT_S)
            if msg[0] != "ready":
                raise RuntimeError(f"client worker {i} could not start: {msg[1]}")
            # perf_counter must be one system-wide clock: a worker's reading taken after this
            # process's `before` and before now proves the two processes share it
            if not before <= msg[1] <= time.perf_counter():
                self.close()
                raise RuntimeError("perf_counter is not comparable across processes on this platform: "
                                   "set client.workers=1")

    async def _recv(self, i: int, timeout_s: Optional[float]) -> Any:
        msg = await self.inboxes[i].get(timeout_s, f"client worker {i}")
        if msg[0] == "eof":
            self.procs[i].join(1)
            raise RuntimeError(f"client worker {i} exited unexpectedly ({msg[1]}, exit code {self.procs[i].exitcode})")
        return msg

    async def run(self, requests: Sequence[tuple[Request, RequestRecord]], concurrency: Optional[int],
                  offsets_s: Optional[Sequence[float]], max_concurrency: Optional[int],
                  max_start_rate: Optional[float], observer: Observer) -> LevelRun:
        n = self.n
        if concurrency is not None:
            shares = split_closed(len(requests), concurrency, n)
        else:
            assert offsets_s is not None
            used = min(n, len(requests)) or 1
            shares = [(0, list(range(i, len(requests), used))) for i in range(used)]
        used = len(shares)
        recs = [rec for _, rec in requests]
        for w, (streams, idx) in enumerate(shares):
            spec = {
                "requests": [(requests[i][0].path, pre_encode(requests[i][0]), requests[i][1]) for i in idx],
                "concurrency": streams if concurrency is not None else None,
                "offsets": [offsets_s[i] for i in idx] if offsets_s is not None else None,
                "max_concurrency": (None if not max_concurrency else
                                    max(1, max_concurrency // used + (1 if w < max_concurrency % used else 0))),
                "max_start_rate": max_start_rate / used if max_start_rate else None,
            }
            self.conns[w].send(("level", spec))
        for w in range(used):
            msg = await self._recv(w, WORKER_START_TIMEOUT_S)
            if msg[0] != "armed":
                raise RuntimeError(f"client worker {w}: {msg[1]}")
        start_at = time.perf_counter() + 0.05  # a common start, on the shared clock
        for w in range(used):
            self.conns[w].send(("go", start_at - self.origin))
        results: list[Any] = [None] * used

        async def collect(w: int) -> None:
            idx = shares[w][1]
            while True:
                msg = await self._recv(w, None)
                if msg[0] == "progress":
                    for k, error_kind, output_tokens, done_s in msg[1]:
                        rec = recs[idx[k]]
                        rec.error_kind, rec.output_tokens, rec.done_s = error_kind, output_tokens, done_s
                        observer.request_done(rec)
                elif msg[0] == "done":
                    results[w] = msg
                    return
                else:
                    raise RuntimeError(f"client worker {w}: {msg[1]}")

        await asyncio.gather(*(collect(w) for w in range(used)))
        lags, utils, cpu = [], [], 0.0
        for w, (_, records, lag_ms, cpu_s, wall_s) in enumerate(results):
            for k, rec in zip(shares[w][1], records):
                requests[k][1].__dict__.update(rec.__dict__)
            if lag_ms is not None:
                lags.append(lag_ms)
            utils.append(round(cpu_s / wall_s, 3) if wall_s > 0 else 0.0)
            cpu += cpu_s
        return LevelRun(records=recs, workers=used, in_process=False, event_loop=loop_name(self.kind),
                        loop_lag_p99_ms=max(lags) if lags else None, cpu_util=utils, cpu_s=cpu)

    def close(self, grace_s: float = 5.0) -> None:
        """Ask every worker to stop, give them grace_s together, then kill the ones still running."""
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns, self.inboxes = [], [], []


class _Inbox:
    """Messages from a multiprocessing connection, for an event loop: a thread blocks in recv (no
    event-loop reader: uvloop would make the pipe non-blocking, and a large message would then come
    apart) and wakes the waiting coroutine. End of file arrives as ("eof", why)."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.waiter: Optional[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = None
        threading.Thread(target=self._read, name="kvexp-inbox", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError) as e:
                msg = ("eof", type(e).__name__)
            except Exception as e:  # an unreadable message
                msg = ("error", f"unreadable message ({type(e).__name__}: {e})")
            self.queue.put(msg)
            waiter = self.waiter
            if waiter is not None:
                loop, fut = waiter
                try:
                    loop.call_soon_threadsafe(_wake, fut)
                except RuntimeError:  # that loop is closed
                    pass
            if msg[0] == "eof":
                return

    async def get(self, timeout_s: Optional[float] = None, who: str = "peer") -> Any:
        loop = asyncio.get_running_loop()
        while True:
            try:
                return self.queue.get_nowait()
            except queue.Empty:
                pass
            fut = loop.create_future()
            self.waiter = (loop, fut)
            if not self.queue.empty():  # arrived while the waiter was being set
                self.waiter = None
                continue
            try:
                await asyncio.wait_for(fut, timeout_s)
            except asyncio.TimeoutError:
                raise RuntimeError(f"{who} did not answer within {timeout_s:g} s") from None
            finally:
                self.waiter = None


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _Progress:
    """A worker's observer: finished requests, batched for the parent every PROGRESS_INTERVAL_S."""

    def __init__(self) -> None:
        self.index: dict[int, int] = {}
        self.pending: list[tuple[int, Optional[str], Optional[int], Optional[float]]] = []

    def level_started(self, level: float, total: int, repeat: int) -> None: pass
    def level_done(self, level: float, summary: dict[str, Any]) -> None: pass

    def request_done(self, record: RequestRecord) -> None:
        self.pending.append((self.index[id(record)], record.error_kind, record.output_tokens, record.done_s))


def _worker_main(conn: Any, options: ClientOptions, streamer: Streamer, kind: str, origin: float, i: int) -> None:
    """A worker process: its own event loop and session; runs level shards until told to stop."""
    try:
        if kind == "uvloop":
            import uvloop

            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        else:
            runner = asyncio.Runner()
        with runner:
            runner.run(_worker(conn, options, streamer, origin))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass
    except BaseException as e:  # tell the parent why, in one line
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except (OSError, ValueError):
            pass
        sys.exit(1)


async def _worker(conn: Any, options: ClientOptions, streamer: Streamer, origin: float) -> None:
    loop = asyncio.get_running_loop()
    inbox = _Inbox(conn)
    conn.send(("ready", time.perf_counter()))
    progress = _Progress()
    async with make_session(options.base_url, options.max_connections, options.request_timeout_s,
                            options.stall_timeout_s, options.headers) as session:
        lg = LoadGenerator(session, streamer, progress, origin=origin)
        while True:
            cmd, spec = await inbox.get()
            if cmd in ("stop", "eof"):
                return
            reqs = [(Request(path, {}), rec) for path, _, rec in spec["requests"]]
            bodies = [data for _, data, _ in spec["requests"]]
            progress.index = {id(rec): k for k, (_, rec) in enumerate(reqs)}
            conn.send(("armed", None))
            cmd, start_s = await inbox.get()
            if cmd != "go":
                return
            throttle = start_throttle(spec["max_start_rate"])

            async def report() -> None:
                while True:
                    await asyncio.sleep(PROGRESS_INTERVAL_S)
                    if progress.pending:
                        batch, progress.pending = progress.pending, []
                        conn.send(("progress", batch))

            delay = start_s - lg.now()
            if delay > 0:
                await asyncio.sleep(delay)
            cpu0, t0 = time.process_time(), time.perf_counter()
            reporter = loop.create_task(report())
            with LoopLagMonitor() as lag, no_gc_pauses():
                if spec["concurrency"] is not None:
                    records = await lg.closed_loop(reqs, spec["concurrency"], throttle, bodies)
                else:
                    records = await lg.open_loop(reqs, spec["offsets"], spec["max_concurrency"], throttle, bodies,
                                                 start_s=start_s)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
            reporter.cancel()
            if progress.pending:
                conn.send(("progress", progress.pending))
                progress.pending = []
            conn.send(("done", records, lag.p99_ms(), cpu, wall))
