"""Where a server kvexp launches and kvexp's own client run on this machine's CPUs.

On a machine that holds both, a server busy on every core delays the client's event loop, and with it
every timestamp the client takes: a request goes out late, a token is read late. Split keeps them
apart: the server's process group (and every process it starts) is pinned to some of the CPUs kvexp
may use, the job's event loop and its worker processes to the others (the last ones; interrupts tend to
land on CPU 0). The client gets one CPU per worker process it may start (client.workers, or for auto
one per 64 concurrent streams), at least one, and the server at least one.

auto splits when kvexp launches the server and may use two or more CPUs, whichever the server: every
process a server starts inherits the CPUs of the process kvexp launched (llama-server's threads, Ollama's
runner, vLLM's engine core and workers), and a server that binds threads itself is told the same CPUs
(vLLM's CPU build: VLLM_CPU_OMP_THREADS_BIND, its adapter), so every server of a comparison has the same
CPU budget. An attached server (backend.endpoint) is not kvexp's to place. Every result records the
placement in environment.placement, with the CPUs every thread of the server's process tree was read
back on during the run (`tree_cpus`): what was applied, not only what was asked."""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import psutil

from kvexp.core.config import ConfigError, ExperimentConfig, Placement, highest_concurrency
from kvexp.core.machine import cpu_ids, usable_cpus

STREAMS_PER_CPU = 64  # a client CPU per this many concurrent streams (client.workers=auto)


@dataclass(frozen=True)
class CpuPlan:
    """A job's placement: split (server_cpus and client_cpus set) or shared (both None)."""

    mode: str  # "split" | "shared"
    server_cpus: Optional[tuple[int, ...]]
    client_cpus: Optional[tuple[int, ...]]
    reason: str

    @property
    def server_threads(self) -> int:
        """CPU threads for a server that is not told how many: its own CPUs when split, else all the
        CPUs kvexp may use but one (the load generator's)."""
        return len(self.server_cpus) if self.server_cpus else max(1, usable_cpus() - 1)

    def to_json(self, seen: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """environment.placement; seen: `tree_cpus` of the server (None: not launched by kvexp, or gone)."""
        return {"mode": self.mode, "server_cpus": None if self.server_cpus is None else list(self.server_cpus),
                "client_cpus": None if self.client_cpus is None else list(self.client_cpus),
                "server_cpus_seen": None if seen is None else seen["cpus"],
                "server_processes": None if seen is None else seen["processes"], "reason": self.reason}


def client_share(workers: Any, streams: int, cpus: int) -> int:
    """CPUs for the client: one per worker process it may start, at least one, leaving one for the server."""
    wanted = int(workers) if workers != "auto" else math.ceil(max(1, streams) / STREAMS_PER_CPU)
    return max(1, min(wanted, cpus - 1))


def plan(cfg: ExperimentConfig, cpus: Optional[list[int]] = None) -> CpuPlan:
    """The placement of cfg's job on `cpus` (default: the CPUs kvexp may use). client.placement=split on
    one CPU, or with an attached server, is refused (ConfigError)."""
    setting = cfg.client.placement
    cpus = sorted(cpus if cpus is not None else cpu_ids())
    if cfg.backend.endpoint:
        if setting == Placement.split:
            raise ConfigError("client.placement=split: an attached server (backend.endpoint) is not kvexp's to "
                              "place; use client.placement=auto or shared")
        return CpuPlan("shared", None, None, "an attached server (backend.endpoint) runs where it was started")
    if setting == Placement.shared:
        return CpuPlan("shared", None, None, "client.placement=shared")
    if len(cpus) < 2:
        if setting == Placement.split:
            raise ConfigError(f"client.placement=split needs 2 or more CPUs; kvexp may use {len(cpus)}")
        return CpuPlan("shared", None, None, "one CPU: nothing to split")
    k = client_share(cfg.client.workers, highest_concurrency(cfg.scenario), len(cpus))
    return CpuPlan("split", tuple(cpus[:-k]), tuple(cpus[-k:]),
                   f"client.placement={setting}: the server on {len(cpus) - k} CPU(s), the client on {k}")


def pin_self(cpus: Optional[tuple[int, ...]]) -> None:
    """For a launched server's preexec_fn: this (child) process on cpus, which its children inherit."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def cpus_of(pid: Optional[int]) -> Optional[list[int]]:
    """The CPUs a process may run on (None: no such process, or not Linux)."""
    try:
        return sorted(os.sched_getaffinity(pid)) if pid else None
    except (OSError, AttributeError):
        return None


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return [pid]


def tree_cpus(pid: Optional[int]) -> Optional[dict[str, Any]]:
    """The CPUs every thread of a process and of every process under it may run on, read back from the
    operating system: {"cpus": their union, "processes": [{"pid", "name", "threads", "cpus"}] (a process's
    cpus: the union over its threads)}. A server that set its threads' CPUs itself shows here. None: no
    such process, or not Linux."""
    if not pid:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    rows: list[dict[str, Any]] = []
    for proc in procs:
        cpus: set[int] = set()
        threads = 0
        for tid in _threads(proc.pid):
            try:
                cpus |= os.sched_getaffinity(tid)
                threads += 1
            except (OSError, AttributeError):  # a thread that ended meanwhile; not Linux
                continue
        if threads:
            try:
                name = proc.name()
            except psutil.Error:
                continue
            rows.append({"pid": proc.pid, "name": name, "threads": threads, "cpus": sorted(cpus)})
    if not rows:
        return None
    return {"cpus": sorted({c for r in rows for c in r["cpus"]}), "processes": rows}


@contextmanager
def client_side(p: CpuPlan) -> Iterator[None]:
    """The job's event-loop thread (and the worker processes and threads it starts) on the client's
    CPUs while it measures; back where it was afterwards."""
    if not p.client_cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, p.client_cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
