"""The servers kvexp launches, kept between jobs: a consecutive job whose launch is identical reuses
the running server instead of starting another."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvexp.backends.base import Adapter, BackendError
from kvexp.backends.process import LogCap, ServerProcess, free_port, port_in_use
from kvexp.core.config import ExperimentConfig


@dataclass
class Server:
    """A launched server and what it was launched with (to reuse it for an identical next job)."""

    key: tuple
    process: ServerProcess
    base_url: str
    launch_command: list[str]
    ready_s: float


class ServerPool:
    """Keeps the last launched server so that a consecutive job with an identical launch reuses it
    (a server that has exited is never reused; run_job releases one after a job that did not complete)."""

    def __init__(self) -> None:
        self.current: Optional[Server] = None

    def release(self) -> None:
        if self.current is not None:
            self.current.process.stop()
            self.current = None

    def acquire(self, backend: Adapter, cfg: ExperimentConfig, log_path: Path) -> tuple[Server, bool]:
        key = backend.spec.key
        cur = self.current
        if cur is not None and cur.key == key and cur.process.exited() is None:
            return cur, True
        self.release()
        b = cfg.backend
        if b.port and port_in_use(b.host, b.port):
            raise BackendError(f"backend.port={b.port}: the port is already in use on {b.host}; free it or "
                               "leave backend.port unset to use a free one")
        port = b.port or free_port(b.host)
        argv = backend.launch_argv(port)
        proc = ServerProcess(argv, backend.launch_env(port), log_path, f"{b.name} server", b.stop_grace_s,
                             unset=backend.launch_env_unset(), cpus=backend.spec.cpus,
                             log_cap=LogCap.of(cfg.log, backend.log_kept))
        proc.start()
        base = f"http://{_url_host(cfg.backend.host)}:{port}"
        try:
            ready = proc.wait_ready(base + backend.health_path, cfg.backend.ready_timeout_s)
        except BaseException:
            proc.stop()
            raise
        self.current = Server(key, proc, base, argv, ready)
        return self.current, False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
