"""Launch, readiness, logging and shutdown of a server process; shared by every backend.

The server runs in its own process group with stdout/stderr going to a log file. Readiness is polled
against a deadline while watching for early exit (the error quotes the log's last lines). Stopping
sends SIGTERM to the whole group, waits a grace period, then SIGKILLs it. Every live server is also
registered for an atexit/signal sweep, so none outlives kvexp."""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from kvexp.backends.base import BackendError

_LIVE: set["ServerProcess"] = set()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 15) -> str:
    try:
        data = path.read_bytes()[-16384:].decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


class ServerProcess:
    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, name: str):
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.name = name
        self.proc: Optional[subprocess.Popen] = None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env}, start_new_session=True,
            )
        except OSError as e:
            raise BackendError(f"{self.name}: cannot launch {self.argv[0]}: {e.strerror}") from None
        finally:
            log.close()
        _LIVE.add(self)

    def exited(self) -> Optional[int]:
        return self.proc.poll() if self.proc else None

    def wait_ready(self, url: str, timeout_s: float) -> float:
        """Poll url until HTTP 200; returns seconds taken. Raises BackendError on exit or deadline."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            rc = self.exited()
            if rc is not None:
                raise BackendError(
                    f"{self.name} exited with status {rc} before becoming ready; last lines of "
                    f"{self.log_path}:\n{tail(self.log_path)}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise BackendError(
                    f"{self.name} not ready at {url} after {timeout_s:.0f} s; last lines of "
                    f"{self.log_path}:\n{tail(self.log_path)}")
            time.sleep(0.05)

    def stop(self, grace_s: float = 10.0) -> Optional[int]:
        """SIGTERM to the group, grace, then SIGKILL. Idempotent; returns the exit status."""
        p = self.proc
        if p is None:
            return None
        try:
            if p.poll() is None:
                _signal_group(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
            # the group may hold children even after the leader exited
            _signal_group(p.pid, signal.SIGKILL)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        finally:
            _LIVE.discard(self)
        return p.returncode


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(grace_s: float = 5.0) -> None:
    for s in list(_LIVE):
        s.stop(grace_s)


atexit.register(stop_all)
