"""No process a server starts outlives kvexp, however kvexp ends, on a stand-in server whose children stay
in its group, leave the group (setpgid), leave the session (setsid) or ignore SIGTERM: the watcher ends
them all when kvexp is killed, and `cleanup` finds what is left when the watcher was killed too, by the
session and start time kvexp recorded, never a server whose kvexp still runs. (tests/integration/test_sigkill.py does
the same on the real servers.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import kvexp_main, survivors

from kvexp.backends import launched, watcher
from kvexp.backends.process import ServerProcess

DEADLINE_S = 60  # a hang guard only

# a stand-in kvexp: launches the family from its main thread, says what it launched, and waits to be killed
KVEXP = """
import json, sys, time
from pathlib import Path
from kvexp.backends.process import ServerProcess
out = Path(sys.argv[1])
s = ServerProcess(["sh", "-c", sys.argv[2]], {}, out / "server.log", "family")
s.start()
(out / "launched.json").write_text(json.dumps({"pid": s.pid, "watcher": s.watcher.proc.pid, "scratch": str(s.scratch)}))
time.sleep(600)
"""


def family(out: Path, escapes: bool = True) -> str:
    """A shell that ignores SIGTERM, with a child in its group, one that leaves the group, and (escapes) one
    that leaves the session once the watcher has had time to see it; each writes its pid to out/pids."""
    pids = out / "pids"
    return ("trap '' TERM; echo $TMPDIR > " + str(out / "tmpdir") + "; "
            f"sh -c 'echo $$ >> {pids}; exec sleep 300' & "
            f"python3 -c 'import os,time; os.setpgid(0,0); open(\"{pids}\",\"a\").write(f\"{{os.getpid()}}\\n\"); "
            "time.sleep(300)' & "
            + (f"(sleep 2; exec setsid sh -c 'echo $$ >> {pids}; exec sleep 301') & " if escapes else "")
            + "wait")


def launch(tmp_path: Path, escapes: bool = True) -> tuple[subprocess.Popen, dict, list[psutil.Process]]:
    out = tmp_path / "out"
    out.mkdir()
    k = subprocess.Popen([sys.executable, "-c", KVEXP, str(out), family(out, escapes)])
    want = 3 if escapes else 2
    deadline = time.monotonic() + DEADLINE_S
    while not ((out / "launched.json").is_file() and (out / "pids").is_file()
               and len((out / "pids").read_text().split()) == want):
        assert k.poll() is None and time.monotonic() < deadline, "the stand-in never launched its family"
        time.sleep(0.05)
    time.sleep(1.5)  # the watcher notes descendants once a second
    info = json.loads((out / "launched.json").read_text())
    info["watching"] = psutil.Process(info["watcher"])
    procs = [psutil.Process(int(p)) for p in [info["pid"], *(out / "pids").read_text().split()]]
    return k, info, procs


def wait_gone(procs: list[psutil.Process]) -> list[psutil.Process]:
    deadline = time.monotonic() + DEADLINE_S
    while survivors(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return survivors(procs)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXP_CACHE", str(tmp_path / "cache"))


def test_sigkill_of_kvexp_ends_every_process_of_its_server(tmp_path):
    k, info, procs = launch(tmp_path)
    try:
        assert (tmp_path / "out" / "tmpdir").read_text().strip() == info["scratch"]  # the server's TMPDIR
        assert Path(info["scratch"]).is_dir() and len(survivors(procs)) == 4
        k.kill()
        k.wait()
        assert not wait_gone(procs) and not wait_gone([info["watching"]])
        assert not Path(info["scratch"]).exists() and launched.records() == []
    finally:
        for p in survivors(procs):
            p.kill()


def test_cleanup_finds_what_is_left_by_the_recorded_session_when_the_watcher_is_gone_too(tmp_path, capsys):
    k, info, procs = launch(tmp_path, escapes=False)
    try:
        os.kill(info["watcher"], signal.SIGKILL)
        k.kill()
        k.wait()
        assert wait_gone(procs[:1]) == []  # the shell: its parent-death signal
        left = survivors(procs[1:])
        assert len(left) == 2 and all(p.ppid() != k.pid for p in left)  # reparented, no longer kvexp's
        (rec,) = launched.leftovers()
        assert (rec.pid, rec.sid, set(rec.processes())) == (info["pid"], info["pid"], {p.pid for p in left})
        assert kvexp_main("cleanup", "--dry-run") == 0 and len(survivors(procs[1:])) == 2
        listed = capsys.readouterr().out
        assert listed.startswith(f"kvexp cleanup: left running: sh (pid {info['pid']}, started ")
        assert all(f"(pid {p.pid})" in listed for p in left)
        assert kvexp_main("cleanup") == 0
        assert "kvexp cleanup: stopped sh" in capsys.readouterr().out
        assert not wait_gone(procs)
        assert not Path(info["scratch"]).exists() and launched.records() == []
    finally:
        for p in survivors(procs):
            p.kill()


def test_cleanup_never_touches_a_server_whose_kvexp_still_runs(tmp_path, capsys):
    k, info, procs = launch(tmp_path, escapes=False)
    try:
        os.kill(info["watcher"], signal.SIGKILL)  # kvexp alone guards it now
        assert launched.leftovers() == []
        assert kvexp_main("cleanup") == 0
        assert capsys.readouterr().out == "kvexp cleanup: no server left running by an ended kvexp\n"
        assert len(survivors(procs)) == 3
    finally:
        k.kill()
        k.wait()
        wait_gone(procs[:1])
        for p in survivors(procs):
            p.kill()


def test_a_session_whose_leader_is_another_process_now_is_not_the_servers():
    leader = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        start = watcher.start_ticks(leader.pid)
        assert watcher.members(leader.pid, leader.pid, start) == {leader.pid: start}
        # the leader's pid names a process started at another time than recorded: a reused pid, not ours
        assert watcher.members(leader.pid, leader.pid, start + 1) == {}
    finally:
        leader.kill()
        leader.wait()


def test_stop_ends_a_child_that_left_the_session_and_removes_the_scratch_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    s = ServerProcess(["sh", "-c", family(out)], {}, out / "server.log", "family")
    s.start()
    deadline = time.monotonic() + DEADLINE_S
    while not ((out / "pids").is_file() and len((out / "pids").read_text().split()) == 3):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.5)  # the watcher notes descendants once a second
    procs = [psutil.Process(s.pid), *(psutil.Process(int(p)) for p in (out / "pids").read_text().split())]
    scratch = s.scratch
    assert scratch is not None and scratch.is_dir()
    s.stop(grace_s=0.2)
    assert not wait_gone(procs)
    assert not scratch.exists() and launched.records() == []
