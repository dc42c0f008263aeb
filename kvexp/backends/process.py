"""Launch, readiness, logging and shutdown of a server process; shared by every backend.

The server runs in its own session and process group with stdout/stderr going through a pipe to a small
process that keeps its log under a cap (kvexp/backends/serverlog.py), watched by another that ends the
whole session when kvexp ends (kvexp/backends/watcher.py). Readiness is polled
against a deadline while watching for early exit (the error quotes the log's last lines). Stopping
sends SIGTERM to the whole group, waits a grace period, then SIGKILLs it. Every live server is also
registered for an atexit/signal sweep, so none outlives kvexp: `raise_on_signals()` turns SIGINT,
SIGTERM and SIGHUP into an `Interrupted` exception in the main thread, so that every `finally` on the way out runs
(results are flushed, servers stopped, with a grace of at most INTERRUPT_GRACE_S once interrupted)."""

from __future__ import annotations

import asyncio
import atexit
import fcntl
import logging
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from kvexp.backends import launched, serverlog, watcher
from kvexp.backends.base import SCRATCH, BackendError
from kvexp.core.config import LogConfig

_LIVE: set["ServerProcess"] = set()
# SIGHUP (a closed terminal or ssh session), SIGQUIT (Ctrl-\\) and SIGUSR1/2 (whose default action would
# end kvexp without a word) end kvexp like Ctrl-C: servers stopped, results kept
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
INTERRUPT_GRACE_S = 3.0
_interrupted: Optional[str] = None  # the signal that ended this command (its name), once one has
_answered = False  # and the command has said so
_swallowed = False  # the signal's Interrupted landed in a finalizer, which could not raise it
_HOOK_CODE: set[Any] = set()  # the code of the unraisable hook that hands it back (_quiet_unraisable)
_continued = 0  # SIGCONTs so far: kvexp itself was stopped (Ctrl-Z, SIGSTOP) and continued


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived; str() is the signal's name."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def tail(path: Path, lines: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(os.fstat(f.fileno()).st_size - 16384, 0))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


# A line in which a server says why it failed: Ollama's `Error: ...`, llama.cpp's `error: ...`, Python's
# `...Error: ...`, Go's `panic:`; level=ERROR/FATAL log records.
_ERROR_LINE = re.compile(r"(?i)(\berror\b|error:|\bfatal\b|panic:|level=(error|fatal)|exception\b|"
                         r"cannot |can't |failed to |permission denied|read-only file system|no such file)")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def last_error_line(path: Path, limit: int = 300) -> Optional[str]:
    """The last line of a server's log that says it failed (see _ERROR_LINE), cut to `limit` characters
    and made printable; None when the log's last 16 KiB hold none."""
    for line in reversed(tail(path, 200).splitlines()):
        line = "".join(c if c.isprintable() else " " for c in _ANSI.sub("", line)).strip()
        if line and _ERROR_LINE.search(line):
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return None


KEEPER_WAIT_S = 5.0  # for the log's keeper to write a stopped server's last words
KEEPER_EXIT_WAIT_S = 2.0  # and those of a server that exited by itself (a child of it may hold the pipe longer)
MIB = 1 << 20


@dataclass(frozen=True)
class LogCap:
    """What is kept of a server's output, in bytes (max_bytes None: all of it), and the pattern of the
    lines kept whole besides (an adapter's log_kept; None: none)."""

    max_bytes: Optional[int]
    head_bytes: int
    lines_max_bytes: Optional[int]
    kept: Optional[str] = None

    @classmethod
    def of(cls, cfg: LogConfig, kept: Optional[str] = None) -> "LogCap":
        def size(mb: Optional[float]) -> Optional[int]:
            return None if mb is None else int(mb * MIB)
        return cls(size(cfg.max_mb), size(cfg.head_mb) or 0, size(cfg.lines_max_mb), kept)

    @property
    def head(self) -> Optional[int]:
        """The head the log's readers look for the marker in (None: no cap, no marker)."""
        return None if self.max_bytes is None else self.head_bytes

    @property
    def lines_head(self) -> Optional[int]:
        return None if self.lines_max_bytes is None else serverlog.lines_head(self.head_bytes, self.lines_max_bytes)


def lines_path(log_path: Path) -> Path:
    """Where the lines kept whole go: server.log -> server.lines.log."""
    name = f"{log_path.stem}.lines{log_path.suffix}" if log_path.suffix else f"{log_path.name}.lines"
    return log_path.with_name(name)


def _set_aside(path: Path) -> None:
    """A log a previous launch left (a resumed job's folder) becomes <name>.1, replacing an older one."""
    try:
        if path.stat().st_size:
            os.replace(path, path.with_name(path.name + ".1"))
    except OSError:
        pass


class ServerProcess:
    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, name: str,
                 grace_s: float = 10.0, unset: list[str] | tuple[str, ...] = (),
                 cpus: Optional[tuple[int, ...]] = None, log_cap: Optional[LogCap] = None):
        self.argv = argv
        self.env = env
        self.unset = tuple(unset)  # inherited variables the server must not see
        self.log_path = log_path
        self.lines_path = lines_path(log_path)
        self.log_cap = log_cap or LogCap.of(LogConfig())
        self.keeper: Optional[subprocess.Popen] = None  # keeps the log under its cap (kvexp/backends/serverlog.py)
        self._ended_log = False
        self.name = name
        self.grace_s = grace_s  # SIGTERM -> SIGKILL
        self.cpus = cpus  # None: wherever kvexp may run (kvexp/core/placement.py)
        self.proc: Optional[subprocess.Popen] = None
        self.watcher: Optional[launched.Watcher] = None  # ends the server's processes when kvexp ends
        self.scratch: Optional[Path] = None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # the server's temporary files go in a scratch folder of kvexp's (its TMPDIR unless the adapter
        # says otherwise; SCRATCH in its env names it), removed with the server (kvexp/backends/launched.py)
        self.scratch = launched.scratch_dir()
        if "TMPDIR" in self.env:  # one that does not exist sends a Python server's temporary files to /tmp
            Path(self.env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
        log, beside = self._log_pipes()
        try:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**{k: v for k, v in os.environ.items() if k not in self.unset},
                     **({"TMPDIR": str(self.scratch)} if self.scratch else {}),
                     **{k: v.replace(SCRATCH, str(self.scratch or tempfile.gettempdir())) for k, v in self.env.items()}},
                start_new_session=True,  # dies with kvexp, on its CPUs (kvexp/backends/launched.py)
                preexec_fn=launched.preexec(self.cpus),
            )
            _LIVE.add(self)
            self.watcher = launched.watch(self.proc.pid, self.scratch, beside)
        except OSError as e:
            launched.remove_scratch(self.scratch)
            raise BackendError(f"{self.name}: cannot launch {self.argv[0]}: {e.strerror}") from None
        except subprocess.SubprocessError as e:  # the preexec_fn failed: CPUs this process may not use
            launched.remove_scratch(self.scratch)
            raise BackendError(f"{self.name}: cannot launch {self.argv[0]} on CPUs {self.cpus}: {e}") from None
        finally:
            for fd in {log, beside}:
                os.close(fd)
        launched.remember(self.proc.pid, self.argv, self.scratch, self.watcher)

    def _log_pipes(self) -> tuple[int, int]:
        """The write ends the server and its watcher get: pipes to the log's keeper, started here, before
        the server, so that a keeper that cannot start leaves the server writing to the file itself (uncapped,
        as the warning says) before anything was launched. A log a previous launch left is set aside."""
        _set_aside(self.log_path)
        _set_aside(self.lines_path)
        cap = self.log_cap
        if sys.executable:
            (read, write), (wread, wwrite) = os.pipe(), os.pipe()
            try:
                fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, serverlog.PIPE_BYTES)
            except OSError:  # above this system's /proc/sys/fs/pipe-max-size: the default size serves too
                pass
            try:
                self.keeper = subprocess.Popen(
                    [sys.executable, "-I", "-S", serverlog.__file__, serverlog.spec(
                        str(self.log_path), cap.max_bytes, cap.head_bytes, str(self.lines_path), cap.lines_max_bytes,
                        cap.kept, other_fd=wread)],
                    stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(wread,),
                    start_new_session=True)  # a terminal's Ctrl-C must not end it before the server's last words
                if self.cpus:  # its work is the server's output: on the server's CPUs, off the client's
                    try:
                        os.sched_setaffinity(self.keeper.pid, self.cpus)
                    except OSError:
                        pass
                return write, wwrite
            except OSError as e:
                os.close(write)
                os.close(wwrite)
                logging.getLogger("kvexp").warning("%s: its log is not capped (the log keeper did not start: %s)",
                                                   self.name, e.strerror or e)
            finally:
                os.close(read)
                os.close(wread)
        self.log_cap = LogCap(None, cap.head_bytes, None)  # what was kept: all of it, no lines apart
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        return fd, fd

    def _log_written(self, timeout_s: float) -> None:
        """Up to timeout_s for the keeper to have written all the server's processes wrote (it ends when
        the last of them has closed the pipe)."""
        if self.keeper is not None and self.keeper.poll() is None:
            try:
                self.keeper.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass

    def _log_caught_up(self, timeout_s: float = 1.0) -> None:
        """Up to timeout_s for the keeper to have read all the server has written so far, so that what it
        wrote before now is in the file, as when it wrote the file itself: the pipe is empty (FIONREAD on
        the server's stdout, opened anew through /proc; Linux)."""
        if self.keeper is None or self.proc is None or self.keeper.poll() is not None:
            return
        try:
            fd = os.open(f"/proc/{self.proc.pid}/fd/1", os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                return
            deadline = time.monotonic() + timeout_s
            while struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0] and time.monotonic() < deadline:
                time.sleep(0.005)
            # the pipe is empty: the keeper has read all the server wrote so far, and writes what it reads at
            # once (before it lets the pipe gather again); a few of its gathering times see its last write
            # land. Not until the file stands still: a server that logs every poll (llama-server's "all slots
            # are idle" at each telemetry sample) never stands still, and each mark would wait the whole timeout
            time.sleep(max(0.0, min(3 * serverlog.GATHER_S, deadline - time.monotonic())))
        except OSError:
            pass
        finally:
            os.close(fd)

    def log_mark(self) -> tuple[int, int]:
        """How much the server has written so far, to the log and to its kept lines (a mark for log_since)."""
        self._log_caught_up()
        return (serverlog.written(self.log_path, self.log_cap.head),
                serverlog.written(self.lines_path, self.log_cap.lines_head))

    def log_since(self, mark: tuple[int, int]) -> str:
        """What the server wrote after mark, as far as the log keeps it (at most 4 MiB); where part of it
        was dropped, the lines kept whole (its kept lines) come first."""
        self._log_caught_up()
        text, whole = serverlog.since(self.log_path, self.log_cap.head, mark[0])
        if whole:
            return text
        kept, _ = serverlog.since(self.lines_path, self.log_cap.lines_head, mark[1])
        return kept + text

    def log_figures(self) -> dict[str, Any]:
        """The log's bytes as a result records them (backend.server_log_bytes, .server_lines_log_bytes)."""
        cap = self.log_cap
        out: dict[str, Any] = {"server_log_bytes": serverlog.figures(self.log_path, cap.head, cap.max_bytes)}
        if cap.kept is not None:
            out["server_lines_log"] = str(self.lines_path)
            out["server_lines_log_bytes"] = serverlog.figures(self.lines_path, cap.lines_head, cap.lines_max_bytes)
        return out

    def exited(self) -> Optional[int]:
        return self.proc.poll() if self.proc else None

    def exit_reason(self) -> Optional[str]:
        """'<name> exited with status N' / 'was killed by SIGKILL' once it has ended, else None."""
        rc = self.exited()
        if rc is None:
            return None
        if not self._ended_log:  # its last words, once, before they are quoted
            self._ended_log = True
            self._log_written(KEEPER_EXIT_WAIT_S)
        said = last_error_line(self.log_path)
        said = f" (its last error: {said})" if said else ""
        if rc < 0:
            try:
                return f"{self.name} was killed by {signal.Signals(-rc).name}{said}"
            except ValueError:
                pass
        return f"{self.name} exited with status {rc}{said}"

    def wait_ready(self, url: str, timeout_s: float) -> float:
        """Poll url until HTTP 200; returns seconds taken. Raises BackendError on exit or deadline."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            gone = self.exit_reason()
            if gone:
                raise BackendError(f"{gone} before becoming ready\nlast lines of {self.log_path}:\n"
                                   f"{tail(self.log_path)}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        ready = time.monotonic() - t0
                        self._log_caught_up()  # what it wrote before it answered is in its log
                        return ready
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise BackendError(f"{self.name} not ready at {url} after {timeout_s:g} s\n"
                                   f"last lines of {self.log_path}:\n{tail(self.log_path)}")
            time.sleep(0.05)

    def stop(self, grace_s: Optional[float] = None) -> Optional[int]:
        """SIGTERM to the group, grace, then SIGKILL. Idempotent; returns the exit status. A stop cut
        short (an interrupt) leaves the server registered, so that stop_all still ends it."""
        p = self.proc
        if p is None:
            return None
        grace = self.grace_s if grace_s is None else grace_s
        if _interrupted:
            grace = min(grace, INTERRUPT_GRACE_S)
        if p.poll() is None:
            _signal_group(p.pid, signal.SIGTERM)
            _signal_group(p.pid, signal.SIGCONT)  # a stopped (hung, SIGSTOPped) server must see the SIGTERM
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # the group may hold children even after the leader exited; those that end by themselves once it
        # has (vLLM's resource tracker, unlinking the shared memory its processes leave) get a moment
        if p.returncode is not None and self.watcher is not None:
            watcher.settle(p.pid, self.watcher.start, launched.WATCHER_GRACE_S)
        _signal_group(p.pid, signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _LIVE.discard(self)
        if p.returncode is not None:
            # the watcher sweeps what the group left (a child that left the group or the session), then
            # removes the scratch folder and the record
            if self.watcher is None or self.watcher.release():
                launched.remove_scratch(self.scratch)
                launched.forget(p.pid)
        self._log_written(KEEPER_WAIT_S)
        return p.returncode


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(grace_s: float = INTERRUPT_GRACE_S) -> None:
    for s in list(_LIVE):
        s.stop(grace_s)


def _repeat(signum: int, frame: object) -> None:
    """A signal after the one that ends kvexp: nothing (not SIG_IGN: a signal already pending when the
    handler changes would then raise "ignored due to race condition" in the middle of the stop). The
    one exception: the first signal's Interrupted, swallowed by a finalizer and handed back here."""
    global _swallowed
    if _swallowed and _interrupted is not None and not _answered:
        if _in_hook(frame):  # still inside the hook that handed it back: hand it back once more
            _hand_back()
            return
        _swallowed = False
        deliver(Interrupted(_interrupted))


def repeats_ignored() -> bool:
    """Whether a signal has ended this command (ignore_repeats ran)."""
    return signal.getsignal(signal.SIGINT) is _repeat


def ignore_repeats() -> None:
    """From now on SIGINT, SIGTERM and SIGHUP do nothing: the first one decides the line and the exit status,
    and a repeat must not cut the stop or the cleanup short."""
    for sig in HANDLED:
        signal.signal(sig, _repeat)


def _on_signal(signum: int, frame: object) -> None:
    # the exception lands in whichever asyncio task runs; the tasks it cuts short would each log an error
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    end_by(signum)


def end_by(signum: int) -> None:
    """The first signal ends the command: it decides the line and the exit status (later ones are
    ignored) and is raised as Interrupted."""
    global _interrupted
    _interrupted = signal.Signals(signum).name
    ignore_repeats()
    deliver(Interrupted(_interrupted))


def deliver(exc: BaseException) -> None:
    """Raise exc (a signal's Interrupted) where nothing swallows it. Raised from the handler while an event
    loop runs, it lands in whatever code the signal cut (aiohttp's response parser hands it to that one
    response as a payload error, and the run went on), so there it is raised by a callback of the loop
    itself, which asyncio lets through to the code that runs the loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise exc from None

    def throw() -> None:
        raise exc

    loop.call_soon_threadsafe(throw)


def interrupt_answered() -> None:
    """The command the signal ended has said so (raise_if_interrupted has nothing more to raise)."""
    global _answered
    _answered = True


def raise_if_interrupted() -> None:
    """A checkpoint for a signal that was swallowed all the same (in a finalizer or a garbage-collector
    callback, whose exceptions Python only prints): it ends the command here."""
    if _interrupted is not None and not _answered:
        raise Interrupted(_interrupted)


def raise_on_signals(handler: Callable[[int, object], None] = _on_signal) -> dict[int, object]:
    """SIGINT, SIGTERM and SIGHUP raise Interrupted in the main thread from now on (through `handler`, which
    ends in end_by); returns the handlers they replace (for signal.signal, to restore them)."""
    global _interrupted, _answered
    _interrupted, _answered = None, False
    if not getattr(sys.unraisablehook, "keeps_quiet_on_signals", False):
        sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
    replaced = {sig: signal.signal(sig, handler) for sig in HANDLED}
    replaced[signal.SIGCONT] = signal.signal(signal.SIGCONT, _on_continue)
    return replaced


def _on_continue(signum: int, frame: object) -> None:
    global _continued
    _continued += 1


def continued() -> int:
    """How often kvexp itself has been stopped (Ctrl-Z, SIGSTOP) and continued since its command began: a
    level it changes during was timed across the pause."""
    return _continued


def _quiet_unraisable(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """Python prints an exception it cannot raise (one from a finalizer or a garbage-collector callback)
    with a traceback; a signal's Interrupted landing there is not printed but raised again in the main
    thread, outside the finalizer (_hand_back). A command's checkpoints (raise_if_interrupted) would
    only catch it later: during a report, seconds."""
    def quiet(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, Interrupted):
            hook(unraisable)
        elif _interrupted is not None and not _answered:
            _hand_back()

    quiet.keeps_quiet_on_signals = True  # type: ignore[attr-defined]
    _HOOK_CODE.add(quiet.__code__)
    return quiet


def _hand_back() -> None:
    """Repeat the signal to the main thread from another thread, once this one lets go of the interpreter
    (the hook has returned by then, or _repeat hands it back again): the repeat also wakes the main thread
    from a blocking call, and _repeat raises the swallowed Interrupted there."""
    global _swallowed
    _swallowed = True
    go = threading.Event()

    def repeat() -> None:
        go.wait()
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    try:
        threading.Thread(target=repeat, daemon=True).start()
    except RuntimeError:  # the interpreter is shutting down: its exit is the command's end anyway
        return
    go.set()


def _in_hook(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code is _hand_back.__code__ or frame.f_code in _HOOK_CODE:
            return True
        frame = frame.f_back
    return False


_process_exits = False  # kvexp runs as its own process (kvexp.app.cli.entry), which ends with the command


def process_exits_after_command() -> None:
    global _process_exits
    _process_exits = True


def restore_signals(handlers: dict[int, object]) -> None:
    """Put back the handlers raise_on_signals (or quiet_on_signals) replaced; but where a signal ended the
    command and the process ends with it, a second one (Ctrl-C after a SIGTERM) stays ignored while kvexp
    leaves, and the first decides the exit status."""
    global _interrupted, _answered, _swallowed
    if not (_process_exits and repeats_ignored()):
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        # the command is over: a later one in this process (a test, a library caller of run_job) must not
        # find its signal at a checkpoint
        _interrupted, _answered, _swallowed = None, False, False


atexit.register(stop_all)
