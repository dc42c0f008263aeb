"""The watcher: a tiny process beside each launched server that ends the server's processes when kvexp
ends, however kvexp ends (SIGKILL, an OOM kill, a crash).

The server's own parent-death signal (kvexp/backends/launched.py) reaches the server alone: vLLM's engine
core, its workers and its resource tracker, or Ollama's runner, are the server's children, and they
outlive it (reparented to pid 1). The watcher closes that gap. kvexp starts it right after the server, in
a session of its own (a terminal's signals do not reach it), with the read end of a pipe whose only write
end kvexp holds. The pipe closes when kvexp ends, or when kvexp stops the server; either way the watcher
then sweeps: every process of the server's session and process group, and every descendant of the server
it saw while it watched (one that left the session with setsid), gets SIGTERM (and SIGCONT), then after
a grace SIGKILL (a process that ignores SIGTERM, as vLLM's resource tracker does, first gets a grace of
its own to end once the others have, unlinking their shared memory); then it removes the server's scratch folder and its launch record, and exits.

Run as a script (`python -I -S watcher.py PID START GRACE SCRATCH RECORD`, the pipe on its stdin), it
imports the standard library only, so that it starts in milliseconds. kvexp itself imports the /proc
readers below (`members`, `start_ticks`) for `python -m kvexp cleanup`.

Pid reuse: a descendant is signalled only while its pid still has the start time it was seen with, and
a session's members only while the session's leader is gone or is still the server: Linux does not hand
out a pid again while a process still has it as its session or group id, so a member of a session whose
leader is gone belongs to that session as it was launched."""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

POLL_S = 1.0  # how often the watcher notes the server's descendants
SWEEP_ROUNDS = 5  # a process a sweep found may start others while it ends: look again, this many times


def _stat(pid: int) -> Optional[list[str]]:
    """/proc/PID/stat after the command name: state, ppid, pgrp, session, ... (starttime at [19])."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (None: no such process, or a zombie)."""
    st = _stat(pid)
    return None if st is None or st[0] in ("Z", "X") else int(st[19])


def alive(pid: int, start: int) -> bool:
    return start_ticks(pid) == start


def members(sid: int, pgid: int, start: int) -> dict[int, int]:
    """The live processes (pid: start ticks) in session sid or process group pgid, launched as the process
    sid = pgid started at `start`; empty when that pid now names another process (reused)."""
    leader = start_ticks(sid)
    if leader is not None and leader != start:
        return {}
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        st = _stat(int(name))
        if st is not None and st[0] not in ("Z", "X") and (int(st[3]) == sid or int(st[2]) == pgid):
            out[int(name)] = int(st[19])
    return out


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def note_descendants(roots: Iterable[int], seen: dict[int, int]) -> None:
    """Add to seen (pid: start ticks) every live descendant of roots, however far down."""
    todo = list(roots)
    while todo:
        for child in _children(todo.pop()):
            start = start_ticks(child)
            if start is not None and seen.get(child) != start:
                seen[child] = start
                todo.append(child)


def ignores_sigterm(pid: int) -> bool:
    """Whether the process ignores SIGTERM (/proc/PID/status SigIgn), as a multiprocessing resource tracker
    does: it ends by itself once the processes it serves have, after unlinking the shared memory they left."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigIgn:"))
        return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return False


def _wait(targets: dict[int, int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p, s) for p, s in targets.items()):
        time.sleep(0.05)


def sweep(pid: int, start: int, grace_s: float, seen: dict[int, int]) -> bool:
    """End every process of the server's session and group and every descendant seen: SIGTERM and
    SIGCONT, up to grace_s for them to end, then SIGKILL; a process that ignores SIGTERM gets up to grace_s
    more once the others are gone, to end by itself (ignores_sigterm). True when none is left."""
    for _ in range(SWEEP_ROUNDS):
        targets = {**{p: s for p, s in seen.items() if alive(p, s)}, **members(pid, pid, start)}
        note_descendants(targets, targets)
        if not targets:
            return True
        for sig in (signal.SIGTERM, signal.SIGCONT):
            _signal(targets, sig)
        _wait(targets, grace_s)
        patient = {p: s for p, s in targets.items() if ignores_sigterm(p)}
        _signal({p: s for p, s in targets.items() if p not in patient}, signal.SIGKILL)
        _wait({p: s for p, s in targets.items() if p not in patient}, 5)
        _wait(patient, grace_s)
        _signal(targets, signal.SIGKILL)
        _wait(targets, 5)
        seen.update(targets)
    return not members(pid, pid, start) and not any(alive(p, s) for p, s in seen.items())


def settle(pid: int, start: int, timeout_s: float) -> None:
    """Up to timeout_s for the processes of a stopped server's session and group to end by themselves."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and members(pid, pid, start):
        time.sleep(0.05)


def _signal(targets: dict[int, int], sig: int) -> None:
    for p, s in targets.items():
        if alive(p, s):
            try:
                os.kill(p, sig)
            except OSError:
                pass


def watch(pipe: int, pid: int, start: int, grace_s: float, scratch: str, record: str) -> bool:
    """Watch until the pipe closes, then sweep; True when nothing was left."""
    seen: dict[int, int] = {}
    while True:
        ready, _, _ = select.select([pipe], [], [], POLL_S)
        if ready and not os.read(pipe, 512):
            break  # kvexp has ended, or has stopped the server: every write end is closed
        if alive(pid, start):
            note_descendants([pid, *seen], seen)
    if not sweep(pid, start, grace_s, seen):
        return False
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    if record:
        Path(record).unlink(missing_ok=True)
    return True


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    pid, start, grace_s, scratch, record = int(argv[0]), int(argv[1]), float(argv[2]), argv[3], argv[4]
    return 0 if watch(sys.stdin.fileno(), pid, start, grace_s, scratch, record) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
