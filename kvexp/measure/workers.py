"""Sending one level from several processes: a pool of worker processes, each with its own event loop
(optionally uvloop) and its own ClientSession, for levels one event loop would not keep up with.

Workers measure on the parent's clock: perf_counter is CLOCK_MONOTONIC on Linux, one system-wide
clock, so a worker's `perf_counter() - origin` is directly comparable with the parent's (checked when a
worker starts). Each worker receives its share of a level's requests already encoded, starts it at a
time common to all workers, reports finished requests while it runs (progress), and returns its records
when the level ends.

This module sits below the load generator: loadgen.LoadGenerator starts the pool and hands it its own
class (the Engine each worker runs), so neither module imports the other both ways."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import pickle
import queue
import sys
import threading
import time
from typing import Any, Optional, Protocol, Sequence

import aiohttp

from kvexp.backends.base import Request
from kvexp.core import machine
from kvexp.measure.client import ClientOptions, LevelRun, Observer, Streamer, make_session, pre_encode, start_throttle
from kvexp.measure.eventloop import (LoopLagMonitor, loop_name, new_runner, no_gc_pauses, running_loop_kind,
                                     worker_loop_kind)
from kvexp.metrics.levels import Level
from kvexp.metrics.records import RequestRecord

STREAMS_PER_WORKER = 64  # workers=auto: one worker process per this many concurrent streams
DEDICATED_MIN_CORES = 4  # workers=auto: from this many cores on, even one loop gets a process of its own
PROGRESS_INTERVAL_S = 0.25  # how often a worker reports finished requests to the parent
WORKER_START_TIMEOUT_S = 120.0
ABANDON_GRACE_S = 0.5  # workers of a level cut short get this long to stop before they are killed


class Engine(Protocol):
    """What a worker sends its share with (loadgen.LoadGenerator)."""

    def now(self) -> float: ...

    async def closed_loop(self, requests: Sequence[tuple[Request, RequestRecord]], concurrency: int,
                          throttle: Any = None, bodies: Optional[Sequence[bytes]] = None) -> list[RequestRecord]: ...

    async def open_loop(self, requests: Sequence[tuple[Request, RequestRecord]], offsets_s: Sequence[float],
                        max_concurrency: Optional[int] = None, throttle: Any = None,
                        bodies: Optional[Sequence[bytes]] = None,
                        start_s: Optional[float] = None) -> list[RequestRecord]: ...


class EngineClass(Protocol):
    """How a worker makes its Engine (the class itself, sent to the worker process by reference)."""

    def __call__(self, session: aiohttp.ClientSession, streamer: Streamer, observer: Optional[Observer] = None,
                 origin: Optional[float] = None) -> Engine: ...


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

    def __init__(self, n: int, options: ClientOptions, streamer: Streamer, origin: float, engine: EngineClass):
        self.n = n
        self.options = options
        self.kind = worker_loop_kind(options.event_loop)
        self.streamer = streamer
        self.origin = origin
        self.engine = engine
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.inboxes: list[_Inbox] = []

    async def start(self) -> None:
        try:
            pickle.dumps(self.streamer)
        except Exception as e:
            raise RuntimeError(f"client.workers: the stream parser cannot be sent to a worker process ({e}); "
                               "set client.workers=1") from None
        ctx = multiprocessing.get_context("spawn")
        for i in range(self.n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main,
                            args=(child, self.options, self.streamer, self.engine, self.kind, self.origin, i),
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


def close_pools(pools: list[WorkerPool], grace_s: float = 5.0) -> None:
    """Close every pool in `pools`, emptying the list (a load generator holds at most one)."""
    while pools:
        pools.pop().close(grace_s)


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
    def level_done(self, level: float, summary: Level) -> None: pass

    def request_done(self, record: RequestRecord) -> None:
        self.pending.append((self.index[id(record)], record.error_kind, record.output_tokens, record.done_s))


def _worker_main(conn: Any, options: ClientOptions, streamer: Streamer, engine: EngineClass, kind: str,
                 origin: float, i: int) -> None:
    """A worker process: its own event loop and session; runs level shards until told to stop."""
    try:
        with new_runner(kind) as runner:
            runner.run(_worker(conn, options, streamer, engine, origin))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass
    except BaseException as e:  # tell the parent why, in one line
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except (OSError, ValueError):
            pass
        sys.exit(1)


async def _worker(conn: Any, options: ClientOptions, streamer: Streamer, engine: EngineClass, origin: float) -> None:
    loop = asyncio.get_running_loop()
    inbox = _Inbox(conn)
    conn.send(("ready", time.perf_counter()))
    progress = _Progress()
    async with make_session(options.base_url, options.max_connections, options.request_timeout_s,
                            options.stall_timeout_s, options.headers) as session:
        lg = engine(session, streamer, progress, origin=origin)
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
