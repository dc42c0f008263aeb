"""No server outlives the kvexp that started it.

Two guards. First, every server is launched with a parent-death signal (Linux prctl(PR_SET_PDEATHSIG,
SIGKILL), set in the child before exec): when kvexp dies, however it dies (SIGKILL, an OOM kill, a
crash), the kernel kills the server. The signal fires when the *thread* that launched the server ends,
so servers are launched from the main thread (the runner does); from another thread no parent-death
signal is set (that thread could end long before kvexp does) and only the second guard applies.
A server's own children (vLLM's engine process) are not covered by the signal; they share the
server's process group, which the second guard stops as a whole.

Second, a record of every launched server (pid, process group, start time, argv, kvexp's pid) is kept
under kvexp's cache folder (servers/<pid>.json) and removed when the server is stopped. At the next
start kvexp reports servers whose kvexp is gone, and `python -m kvexp cleanup` stops them. A record is
trusted only while its pid still has the recorded start time (pids are reused)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil

from kvexp.core import placement
from kvexp.core.paths import cache_dir

log = logging.getLogger("kvexp")
PR_SET_PDEATHSIG = 1
CLEANUP_GRACE_S = 5.0


def records_dir() -> Path:
    return cache_dir() / "servers"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent (thread) dies. Must not raise or log."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() == 1:  # the parent died between fork and prctl: the signal will never come
            os._exit(1)
    except Exception:  # noqa: BLE001 (not Linux: the record below still guards)
        pass


def preexec(cpus: Optional[tuple[int, ...]] = None) -> Optional[Callable[[], None]]:
    """The preexec_fn for a server's Popen: the parent-death signal on Linux from the main thread, and
    the server (and what it starts) on `cpus` (kvexp/core/placement.py)."""
    dies = os.uname().sysname == "Linux" and threading.current_thread() is threading.main_thread()
    if not dies and not cpus:
        return None

    def child() -> None:
        if dies:
            _die_with_parent()
        placement.pin_self(cpus)
    return child


@dataclass
class Record:
    pid: int
    pgid: int
    started: float  # the server's start time (psutil create_time)
    argv: list[str]
    kvexp_pid: int
    kvexp_started: Optional[float]

    @property
    def path(self) -> Path:
        return records_dir() / f"{self.pid}.json"

    def server_alive(self) -> bool:
        return _same(self.pid, self.started)

    def kvexp_alive(self) -> bool:
        return _same(self.kvexp_pid, self.kvexp_started)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        prog = Path(self.argv[0]).name if self.argv else "?"
        return f"{prog} (pid {self.pid}, started {when} by kvexp pid {self.kvexp_pid}, which has ended)"


def _same(pid: int, started: Optional[float]) -> bool:
    try:
        p = psutil.Process(pid)
        return started is None or abs(p.create_time() - started) < 0.05 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _started(pid: int) -> Optional[float]:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def remember(pid: int, argv: list[str]) -> None:
    """Record a server just launched (best effort: a cache folder that cannot be written only loses
    the report of leftovers, never the run)."""
    rec = Record(pid=pid, pgid=pid, started=_started(pid) or time.time(), argv=list(argv), kvexp_pid=os.getpid(),
                 kvexp_started=_started(os.getpid()))
    try:
        rec.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = rec.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(rec)))
        os.replace(tmp, rec.path)
    except OSError as e:
        log.debug("could not record server %d: %s", pid, e)


def forget(pid: int) -> None:
    try:
        (records_dir() / f"{pid}.json").unlink(missing_ok=True)
    except OSError:
        pass


def records() -> list[Record]:
    out = []
    for p in sorted(records_dir().glob("*.json")) if records_dir().is_dir() else []:
        try:
            out.append(Record(**json.loads(p.read_text())))
        except (OSError, ValueError, TypeError):
            p.unlink(missing_ok=True)  # unreadable: nothing it says can be trusted
    return out


def leftovers() -> list[Record]:
    """Servers still running whose kvexp has ended. Records of servers that have ended go."""
    out = []
    for r in records():
        if not r.server_alive():
            forget(r.pid)
        elif not r.kvexp_alive():
            out.append(r)
    return out


def report_leftovers() -> list[Record]:
    found = leftovers()
    for r in found:
        log.warning("a server a previous kvexp started is still running: %s; stop it with `python -m kvexp cleanup`",
                    r.describe())
    return found


def stop(r: Record, grace_s: float = CLEANUP_GRACE_S) -> bool:
    """SIGTERM to the server's group (a stopped server is continued so that it can end), grace, then
    SIGKILL; True when it has ended."""
    for sig in (signal.SIGTERM, signal.SIGCONT):
        try:
            os.killpg(r.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and r.server_alive():
        time.sleep(0.1)
    try:
        os.killpg(r.pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    time.sleep(0.2)
    gone = not r.server_alive()
    if gone:
        forget(r.pid)
    return gone
