"""Facts about the machine kvexp runs on: the CPUs it may use and their model."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Optional


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or a Slurm job's share), not the
    machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None
