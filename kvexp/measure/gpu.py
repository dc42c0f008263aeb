"""Background memory sampling: GPU memory through NVML, and the server's process-tree RSS so that a
CPU run still has a memory figure. With no NVIDIA driver the GPU figures are None, with one warning."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Optional

import psutil
import pynvml

log = logging.getLogger(__name__)
GIB = float(1 << 30)
_warned = False


def _nvml(quiet: bool = False) -> Any:
    """The pynvml module, initialised; None (with one warning per process, unless quiet) when unavailable."""
    global _warned
    try:
        pynvml.nvmlInit()
        return pynvml
    except Exception as e:  # no library, no driver, no device: all mean "no GPU figures"
        if not _warned and not quiet:
            log.warning("NVML unavailable (%s): GPU memory figures will be null", str(e) or type(e).__name__)
            _warned = True
        return None


@dataclass
class GPUInfo:
    name: Optional[str] = None
    memory_gib: Optional[float] = None
    driver: Optional[str] = None
    index: int = 0


def gpu_info(index: int = 0, quiet: bool = False) -> GPUInfo:
    """The GPU NVML describes (its fields None where there is none; quiet: no warning then)."""
    nv = _nvml(quiet)
    if nv is None:
        return GPUInfo(index=index)
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
        name = nv.nvmlDeviceGetName(h)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        driver = nv.nvmlSystemGetDriverVersion()
        return GPUInfo(name=name if isinstance(name, str) else name.decode(),
                       memory_gib=round(mem.total / GIB, 2),
                       driver=driver if isinstance(driver, str) else driver.decode(), index=index)
    except Exception as e:
        log.warning("NVML could not describe GPU %d: %s", index, e)
        return GPUInfo(index=index)


def tree_rss_bytes(pid: int) -> Optional[int]:
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


@dataclass
class MemoryPeaks:
    device_used_bytes: Optional[int] = None  # whole device, as NVML reports it
    server_gpu_bytes: Optional[int] = None  # the server's processes, where the driver reports them
    server_rss_bytes: Optional[int] = None
    samples: int = 0


class MemorySampler:
    """Samples in a thread every `interval_s` until stopped; peaks are kept per window (level)."""

    def __init__(self, pid: Optional[int], gpu_index: int = 0, interval_s: float = 0.1):
        self.pid = pid
        self.interval_s = interval_s
        self._nv = _nvml()
        self._handle = None
        if self._nv is not None:
            try:
                self._handle = self._nv.nvmlDeviceGetHandleByIndex(gpu_index)
            except Exception as e:
                log.warning("NVML has no GPU %d (%s): GPU memory figures will be null", gpu_index, e)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._peaks = MemoryPeaks()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        used = server_gpu = None
        pids: set[int] = set()
        rss = None
        if self.pid is not None:
            rss = tree_rss_bytes(self.pid)
            try:
                p = psutil.Process(self.pid)
                pids = {self.pid, *(c.pid for c in p.children(recursive=True))}
            except psutil.Error:
                pass
        if self._handle is not None:
            nv = self._nv
            try:
                used = int(nv.nvmlDeviceGetMemoryInfo(self._handle).used)
                procs = nv.nvmlDeviceGetComputeRunningProcesses(self._handle)
                mine = [pr.usedGpuMemory for pr in procs if pr.pid in pids and pr.usedGpuMemory]
                server_gpu = int(sum(mine)) if mine else None
            except Exception:
                pass
        with self._lock:
            pk = self._peaks
            pk.samples += 1
            pk.device_used_bytes = _max(pk.device_used_bytes, used)
            pk.server_gpu_bytes = _max(pk.server_gpu_bytes, server_gpu)
            pk.server_rss_bytes = _max(pk.server_rss_bytes, rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def start(self) -> "MemorySampler":
        self._thread = threading.Thread(target=self._run, name="kvexp-memory", daemon=True)
        self._thread.start()
        return self

    def window(self) -> MemoryPeaks:
        """Peaks since the last call (takes one more sample first), and starts a new window."""
        self._sample()
        with self._lock:
            pk, self._peaks = self._peaks, MemoryPeaks()
        return pk

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2)


def _max(a: Optional[int], b: Optional[int]) -> Optional[int]:
    if a is None:
        return b
    return a if b is None else max(a, b)
