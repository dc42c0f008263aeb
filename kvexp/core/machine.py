"""Facts about the machine kvexp runs on: the CPUs it may use and their model."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Optional


def cpu_ids() -> list[int]:
    """The CPUs this process may run on (its affinity: a container's or a Slurm job's share), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may run on, not the machine's total."""
    return len(cpu_ids())


def cpu_model() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def cpu_times() -> Optional[tuple[int, int, int]]:
    """(total, idle + iowait, steal) jiffies of all CPUs since boot, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    v = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(v), v[3] + v[4], v[7]


def load_view(before: Optional[tuple[int, int, int]], after: Optional[tuple[int, int, int]]) -> Optional[dict]:
    """How loaded the machine was over an interval: the 1-minute load average at its end, the usable cores,
    and the shares of all CPU time that were busy (every process: the server's, the client's and any
    other's) and stolen by the hypervisor. None where /proc/stat cannot tell."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    total = after[0] - before[0]
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {"load_avg_1m": load, "cores": usable_cpus(),
            "busy_share": round(1 - (after[1] - before[1]) / total, 3),
            "steal_share": round((after[2] - before[2]) / total, 3)}
