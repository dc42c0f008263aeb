"""The client's parts that every sending process shares: the one aiohttp session (whose request notes
the moment it goes out), the contracts with the adapter (Streamer) and the progress display
(Observer), how a level is sent (ClientOptions) and what sending it yields (LevelRun), and the client
as a result's environment records it. The load generator (loadgen.py) and its worker processes
(workers.py) both build on these."""

from __future__ import annotations

import contextvars
import json
import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import aiohttp
from asyncio_throttle import Throttler

from kvexp.backends.base import Request, StreamEvent, connector
from kvexp.core import __version__, machine
from kvexp.metrics.levels import Level
from kvexp.metrics.records import RequestRecord

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is optional (the `fast` extra)
    orjson = None


class Streamer(Protocol):
    """What the load generator needs of an adapter (backends.base.Adapter implements it)."""

    stream_keepalive: bool  # False: the server closes the connection after each streamed response

    def parse_line(self, line: bytes) -> Optional[StreamEvent]: ...

    def unfinished_stream(self, repeats: int) -> Optional[str]:
        """Why a stream that ended without its final event ended, where the server's own rules say
        (repeats: how many times in a row the last output token's text came again); None: unknown."""
        ...


class Observer(Protocol):
    """Progress hooks. request_done is called once per finished request, on the event loop that
    measures: keep it O(1) and never block or print from it."""

    def level_started(self, level: float, total: int, repeat: int) -> None: ...
    def request_done(self, record: RequestRecord) -> None: ...
    def level_done(self, level: float, summary: Level) -> None: ...


def connection_error(e: BaseException) -> str:
    """A failed connection or request in a few words (aiohttp's own text for a refused connection names
    TLS it never used: "ssl:default")."""
    if isinstance(e, aiohttp.ClientConnectorError):
        if isinstance(e.os_error, ConnectionRefusedError):
            return f"connection refused by {e.host}:{e.port}"
        return f"cannot connect to {e.host}:{e.port}: {e.os_error.strerror or e.os_error}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class NullObserver:
    def level_started(self, level: float, total: int, repeat: int) -> None: pass
    def request_done(self, record: RequestRecord) -> None: pass
    def level_done(self, level: float, summary: Level) -> None: pass


# the request being sent on this task: TimedRequest appends the perf_counter time it went out
SENT_AT: contextvars.ContextVar[Optional[list[float]]] = contextvars.ContextVar("kvexp_sent", default=None)


class TimedRequest(aiohttp.ClientRequest):
    """aiohttp's request, noting on the perf_counter clock when it starts to go out on its connection
    (the connection is open, the headers are ready, the body is being written): the moment a request
    is sent. What came before (waiting for a connection, opening it, building the request on a busy
    event loop) is the client's own time, recorded as client-side queueing."""

    async def write_bytes(self, *args: Any, **kwargs: Any) -> None:
        holder = SENT_AT.get()
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
    workers: int | str = 1  # worker processes, or "auto" (see workers.resolve_workers and runs_in_process)
    event_loop: str = "auto"  # auto | asyncio | uvloop (auto: uvloop in workers when installed)


@dataclass
class LevelRun:
    """A measured level's records and what the client itself saw while sending them."""

    records: list[RequestRecord]
    workers: int  # event loops (processes) that sent the level's requests
    in_process: bool  # True: the job's own event loop sent them
    event_loop: str  # e.g. "asyncio" or "uvloop 0.21.0"
    loop_lag_p99_ms: Optional[float]  # the worst loop's wake-up lag p99 (see eventloop.LoopLagMonitor)
    cpu_util: list[float]  # CPU time / wall time of each sending process (1.0 = one core busy)
    cpu_s: float  # CPU seconds of all sending processes over the level


def pre_encode(req: Request) -> bytes:
    return json.dumps(req.body).encode()


def start_throttle(max_start_rate: Optional[float]) -> Optional[Throttler]:
    """asyncio-throttle's Throttler as a cap of `max_start_rate` request starts per second (a sliding
    window of one second, or of 1/rate seconds for rates below one per second)."""
    if not max_start_rate:
        return None
    period = 1.0 if max_start_rate >= 1 else 1.0 / max_start_rate
    return Throttler(rate_limit=max(1, int(round(max_start_rate * period))), period=period)


def client_environment(run: LevelRun, workers_setting: Any, event_loop_setting: str,
                       previous: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The client as a result's environment records it: kvexp's load generator, its HTTP and JSON
    libraries, the event loop, the most event loops any level used so far and whether they were worker
    processes (rather than the job's own loop)."""
    decoder = "json" if orjson is None else f"orjson {orjson.__version__}"
    previous = previous or {}
    return {"name": "kvexp.loadgen", "version": __version__, "aiohttp": aiohttp.__version__, "json": decoder,
            "event_loop": run.event_loop, "workers": max(run.workers, previous.get("workers") or 0),
            "worker_processes": bool(previous.get("worker_processes")) or not run.in_process,
            "workers_setting": workers_setting, "event_loop_setting": event_loop_setting, "cores": machine.usable_cpus()}
