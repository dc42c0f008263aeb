"""A watch over the whole server while a level runs: a hung server ends the level in seconds.

Each request has its own stall timeout, but a level of 48 requests at concurrency 16 against a server
that stopped answering (SIGSTOP, a deadlock, a wedged GPU) waits that timeout three times over. The
watch looks at the server as a whole instead: when no bytes have arrived on any stream for
`stall_timeout_s` (counted by the load generator's reads when the level sends from this process; when it
sends from worker processes, whose reads this process cannot see, by what the server's process tree
writes through write(2), its log lines: socket sends are not counted there, and a server logs the
requests a client gives up on, so that sign is kept to where there is no better one) and the probe
does not answer either, the server is hung: the level is cut short and ServerHung raised.
A server that is slow but answers its probe is left alone. The probe is the adapter's watch_path where
it has one (llama-server's /slots, which its engine loop answers: its /health is answered by the HTTP
threads even while that loop is deadlocked), else its health path.

A server told to stop (SIGTERM to llama-server) closes its listener at once but may sit in its shutdown
for minutes with every stream open and silent. So once the streams have been quiet for QUIET_PROBE_S,
the health probe runs every QUIET_PROBE_S: a refused connection (nothing listens on the port) ends the
level at once. Only a refusal counts there; a probe that is slow to answer waits for the stall timeout."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Optional, TypeVar

import aiohttp
import psutil

from kvexp.backends.base import BackendError, Request
from kvexp.measure.client import LevelRun
from kvexp.measure.eventloop import loop_name
from kvexp.metrics.levels import Level
from kvexp.metrics.records import RequestRecord

T = TypeVar("T")
CHECK_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 2.0
QUIET_PROBE_S = 2.0  # streams quiet this long: is the server still listening? (asked at most this often)
CANCEL_WAIT_S = 5.0  # how long the cut-short level may take to unwind


class ServerHung(BackendError):
    """The server stopped answering: no bytes on any stream and no answer to its health probe (or its
    port refuses connections)."""

    PREFIXES = ("server hung", "server stopped listening")
    error_kind = "timeout"  # what the requests it cut short are


class ServerStopped(ServerHung):
    """The server's port refuses connections while its streams are silent: it is shutting down."""

    error_kind = "connection"


def process_tree_writes(pid: Optional[int]) -> Callable[[], Optional[int]]:
    """Bytes the process tree of pid has written so far through write(2) and its kind (/proc/PID/io
    wchar: log lines and files; send(2) on a socket is not counted)."""
    def read() -> Optional[int]:
        if pid is None:
            return None
        try:
            root = psutil.Process(pid)
            total = 0
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.io_counters().write_chars
                except (psutil.Error, AttributeError):
                    pass
            return total
        except psutil.Error:
            return None
    return read


class ServerWatch:
    def __init__(self, session: aiohttp.ClientSession, probe_path: str, stall_s: float,
                 activity: list[Callable[[], Any]]):
        self.session = session
        self.probe_path = probe_path
        self.stall_s = stall_s
        self.activity = activity  # each returns a value that changes whenever bytes flow
        self.found: Optional[ServerHung] = None  # what the watch found: the server hung or stopped
        self._seen = self._signature()
        self._last = time.monotonic()  # the quiet window runs from here, across sample() and guard()

    async def sample(self, probe: Awaitable[T]) -> Optional[T]:
        """A telemetry read before the level, given PROBE_TIMEOUT_S at most: a hung server must not
        hold the level back for a whole stall timeout before the watch even starts."""
        try:
            return await asyncio.wait_for(probe, PROBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return None

    async def _probe(self) -> str:
        """The health probe: "answers" (any HTTP answer, even 503 while loading, is a live server),
        "refused" (nothing listens on the port) or "silent"."""
        try:
            timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            async with self.session.get(self.probe_path, timeout=timeout) as resp:
                await resp.read()
                return "answers"
        except aiohttp.ClientConnectorError as e:
            return "refused" if isinstance(e.os_error, ConnectionRefusedError) else "silent"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return "silent"

    async def refusal(self, error: str) -> Optional[str]:
        """After a level whose load generator met a refused connection (and sent nothing more): the
        reason the server stopped listening when its port still refuses, else None (a passing refusal: the
        level's requests that were not sent count as failed)."""
        if await self._probe() != "refused":
            return None
        return (f"server stopped listening: {error}, then for {self.probe_path} too; the level's other "
                "requests were not sent")

    def _signature(self) -> tuple:
        out = []
        for read in self.activity:
            try:
                out.append(read())
            except Exception:  # noqa: BLE001 (a source that fails tells nothing)
                out.append(None)
        return tuple(out)

    async def _watch(self) -> None:
        """Returns once the server is hung or stopped listening (self.found says how)."""
        probed = float("-inf")
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            now_sig, now = self._signature(), time.monotonic()
            if now_sig != self._seen:
                self._seen, self._last = now_sig, now
                continue
            quiet = now - self._last
            if quiet < self.stall_s and (quiet < QUIET_PROBE_S or now - probed < QUIET_PROBE_S):
                continue
            probed, answer = now, await self._probe()
            if answer == "refused":
                self.found = ServerStopped(f"server stopped listening: no bytes on any stream for {quiet:.0f} s "
                                           f"and {self.probe_path} was refused a connection (the server is "
                                           "shutting down)")
                return
            quiet = time.monotonic() - self._last  # the probe took up to PROBE_TIMEOUT_S of the window
            if quiet < self.stall_s or self._signature() != self._seen:
                continue
            if answer == "answers":
                self._last = time.monotonic()  # slow, not hung: a fresh window
                continue
            self.found = ServerHung(f"server hung: no bytes on any stream for {quiet:.0f} s (scenario.stall_timeout_s="
                                    f"{self.stall_s:g}) and {self.probe_path} did not answer within "
                                    f"{PROBE_TIMEOUT_S:g} s")
            return

    async def guard(self, work: Awaitable[T]) -> T:
        """Await work while watching; ServerHung (the work cancelled) when the server hangs first."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(self._watch())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # an interrupt: neither may outlive this call
            task.cancel()
            watcher.cancel()
            raise
        if task.done():
            watcher.cancel()
            return task.result()
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
        watcher.result()  # a failure of the watch itself surfaces as itself
        raise self.found or ServerHung("server hung")


def hung_level_run(requests: list[tuple[Request, RequestRecord]], hung: ServerHung) -> LevelRun:
    """The level a hung (or stopped) server cut short, from the records this process holds: requests that
    ended keep what they measured, the others fail with its error kind (sent from worker processes, none
    came back)."""
    records = [rec for _, rec in requests]
    for rec in records:
        if rec.done_s is None or rec.sent_s is None:
            rec.error_kind, rec.error = hung.error_kind, str(hung)
    return LevelRun(records=records, workers=1, in_process=True, event_loop=loop_name(), loop_lag_p99_ms=None,
                    cpu_util=[], cpu_s=0.0)


def raise_if_hung(level: Level) -> None:
    """After a level is saved: a hung server ends the job (the runner then stops the server)."""
    reason = level.status_reason or ""
    if level.failed and reason.startswith(ServerHung.PREFIXES):
        raise ServerHung(reason)
