"""No server outlives the kvexp that started it.

Three guards. First, every server is launched with a parent-death signal (Linux prctl(PR_SET_PDEATHSIG,
SIGKILL), set in the child before exec): when kvexp dies, however it dies (SIGKILL, an OOM kill, a
crash), the kernel kills the server. The signal fires when the *thread* that launched the server ends,
so servers are launched from the main thread (the runner does); from another thread no parent-death
signal is set (that thread could end long before kvexp does) and only the second guard applies.
A server's own children (vLLM's engine core, workers and resource tracker; Ollama's runner) are not
covered by the signal: they share the server's session and process group, which the second guard ends.

Second, a watcher process beside each server (kvexp/backends/watcher.py) holds a pipe that closes when
kvexp ends, however it ends, and then ends every process of the server's session and group and every
descendant of the server it saw, and removes the server's scratch folder (its TMPDIR, under
<cache>/tmp/) and its record.

Third, a record of every launched server (pid = process group = session, its start time, argv, scratch
folder, kvexp's pid and start time) is kept under kvexp's cache folder (servers/<pid>.json) and removed
when the server is stopped. At the next start kvexp reports servers whose kvexp is gone and of which a
process is left (found by the recorded session and group, not by name or environment: vLLM rewrites
its processes' titles), and `python -m kvexp cleanup` stops them. A record is trusted only while its pid
still has the recorded start time, or no process has it any more (pids are reused); a server whose
kvexp still runs is never touched."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Callable, Optional

import psutil

from kvexp.backends import watcher
from kvexp.core import placement
from kvexp.core.paths import cache_dir

log_ = logging.getLogger("kvexp")
PR_SET_PDEATHSIG = 1
CLEANUP_GRACE_S = 5.0
WATCHER_GRACE_S = 3.0  # SIGTERM -> SIGKILL for what is left when kvexp has ended
# a Unix socket's path holds at most 107 bytes, and vLLM names its IPC sockets <TMPDIR>/<uuid4>
SCRATCH_MAX_CHARS = 107 - 37


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


def scratch_dir() -> Optional[Path]:
    """A new folder for a server's temporary files (its TMPDIR): under <cache>/tmp/, or under the system's
    temporary folder where that path leaves no room for vLLM's socket names; None if neither can be made."""
    for base, prefix in ((cache_dir() / "tmp", ""), (Path(tempfile.gettempdir()), "kvexp-server-")):
        try:
            base.mkdir(parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        except OSError:
            continue
        if len(str(folder)) <= SCRATCH_MAX_CHARS:
            return folder
        folder.rmdir()
    return None


def remove_scratch(folder: Optional[Path | str]) -> None:
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Watcher:
    """The watcher of one server (kvexp/backends/watcher.py) and kvexp's end of its pipe."""

    proc: subprocess.Popen
    pipe: Optional[int]
    start: int  # the server's start time in clock ticks (watcher.start_ticks)

    def release(self) -> bool:
        """The server has been stopped: close the pipe, so that the watcher sweeps what the server left and
        ends. True when it has swept everything (it removed the scratch folder and the record)."""
        if self.pipe is not None:
            os.close(self.pipe)
            self.pipe = None
        try:
            return self.proc.wait(timeout=WATCHER_GRACE_S + 10) == 0
        except subprocess.TimeoutExpired:
            return False


def watch(pid: int, scratch: Optional[Path], log: Optional[int | IO[bytes]] = None) -> Optional[Watcher]:
    """Start the watcher of server pid (best effort: without it, the parent-death signal and the record
    still guard). Its output goes to log (a file or a descriptor: the server's log)."""
    start = watcher.start_ticks(pid)
    if start is None or not sys.executable:
        return None
    read, write = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", watcher.__file__, str(pid), str(start), str(WATCHER_GRACE_S),
             str(scratch or ""), str(records_dir() / f"{pid}.json")],
            stdin=read, stdout=subprocess.DEVNULL if log is None else log, stderr=subprocess.DEVNULL if log is None else log,
            start_new_session=True)  # a terminal's Ctrl-C or hang-up must not end it before kvexp
    except OSError as e:
        os.close(write)
        log_.debug("could not start the watcher of server %d: %s", pid, e)
        return None
    finally:
        os.close(read)
    return Watcher(proc, write, start)


@dataclass
class Record:
    pid: int
    pgid: int
    started: float  # the server's start time (psutil create_time)
    argv: list[str]
    kvexp_pid: int
    kvexp_started: Optional[float]
    sid: Optional[int] = None  # the server's session (= pid = pgid); None in records older than it
    start_ticks: Optional[int] = None  # the start time as /proc states it (watcher.start_ticks)
    scratch: Optional[str] = None  # the server's TMPDIR
    watcher_pid: Optional[int] = None

    @property
    def path(self) -> Path:
        return records_dir() / f"{self.pid}.json"

    def processes(self) -> dict[int, int]:
        """The server's processes still running (pid: start ticks): its session's and group's, as launched."""
        if self.start_ticks is None:  # an older record: the server itself only
            return {self.pid: 0} if _same(self.pid, self.started) else {}
        return watcher.members(self.sid or self.pgid, self.pgid, self.start_ticks)

    def kvexp_alive(self) -> bool:
        return _same(self.kvexp_pid, self.kvexp_started)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        prog = Path(self.argv[0]).name if self.argv else "?"
        left = [f"{_name(p)} (pid {p})" for p in sorted(self.processes())]
        return (f"{prog} (pid {self.pid}, started {when} by kvexp pid {self.kvexp_pid}, which has ended"
                + (f"; its processes left: {', '.join(left)})" if left else ")"))


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


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


def remember(pid: int, argv: list[str], scratch: Optional[Path] = None, watched: Optional[Watcher] = None) -> None:
    """Record a server just launched (best effort: a cache folder that cannot be written only loses
    the report of leftovers, never the run)."""
    rec = Record(pid=pid, pgid=pid, started=_started(pid) or time.time(), argv=list(argv), kvexp_pid=os.getpid(),
                 kvexp_started=_started(os.getpid()), sid=pid, start_ticks=watcher.start_ticks(pid),
                 scratch=str(scratch) if scratch else None, watcher_pid=watched.proc.pid if watched else None)
    try:
        rec.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = rec.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(rec)))
        os.replace(tmp, rec.path)
    except OSError as e:
        log_.debug("could not record server %d: %s", pid, e)


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
    """Servers of which a process still runs and whose kvexp has ended. Records of servers that have
    ended go (with the scratch folder, once their kvexp has ended too)."""
    out = []
    for r in records():
        if r.processes():
            if not r.kvexp_alive():
                out.append(r)
            continue
        if not r.kvexp_alive():
            remove_scratch(r.scratch)
        forget(r.pid)
    return out


def report_leftovers() -> list[Record]:
    found = leftovers()
    for r in found:
        log_.warning("a server a previous kvexp started is still running: %s; stop it with `python -m kvexp cleanup`",
                    r.describe())
    return found


def stop(r: Record, grace_s: float = CLEANUP_GRACE_S) -> bool:
    """SIGTERM to every process of the server's session and group (a stopped one is continued so that it
    can end), grace, then SIGKILL; True when none is left (the scratch folder and the record then go)."""
    if r.start_ticks is not None:
        gone = watcher.sweep(r.sid or r.pgid, r.start_ticks, grace_s, {})
        if gone:
            remove_scratch(r.scratch)
            forget(r.pid)
        return gone
    for sig in (signal.SIGTERM, signal.SIGCONT):
        try:
            os.killpg(r.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and r.processes():
        time.sleep(0.1)
    try:
        os.killpg(r.pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    time.sleep(0.2)
    gone = not r.processes()
    if gone:
        forget(r.pid)
    return gone
