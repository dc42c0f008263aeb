"""Deaths and hangs, on the real llama-server: SIGHUP (a dropped ssh session) and SIGKILL to kvexp leave
no server running (checked by pid 5 s later), and a server stopped with SIGSTOP mid-level ends that
level one quiet window (scenario.stall_timeout_s) after, fails the job and makes the run exit non-zero;
one told to stop (SIGTERM) ends it once its refused port is seen, seconds later (or, when its own signal
handler deadlocks it, as the hung server it then is)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import with_tiny, ROOT

from kvexp.results.store import load_document
from kvexp.results.validate import check_file



class Run:
    """`python -m kvexp` as a child process, its output collected as it comes, and its server found."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "kvexp", *with_tiny(args)], cwd=ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append((time.monotonic(), line))

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def wait_for(self, text: str, timeout: float = 120) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if text in line:
                    return t
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in kvexp's output:\n{self.output}")

    def server(self) -> psutil.Process:
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "llama-server" in Path(p.cmdline()[0]).name:
                    return p
            except (psutil.Error, IndexError):
                continue
        raise AssertionError(f"kvexp runs no llama-server:\n{self.output}")


def running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["SIGHUP", "SIGKILL"])
def test_no_server_outlives_kvexp(llama_server, tmp_path, sig):
    run = Run("scenario.requests=2000", f"hydra.run.dir={tmp_path}/run")
    try:
        run.wait_for("level 1: 2000 requests")
        server = run.server()
        time.sleep(1)
        os.kill(run.proc.pid, sig)
        rc = run.proc.wait(timeout=60)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    time.sleep(5)
    assert not running(server), f"llama-server pid {server.pid} outlived kvexp ({sig.name})"
    assert rc == (128 + sig if sig != signal.SIGKILL else -signal.SIGKILL)
    if sig == signal.SIGHUP:  # handled like Ctrl-C: what was measured is saved, the message says how to resume
        assert "kvexp: interrupted by SIGHUP: servers stopped, finished levels saved; resume with:" in run.output
        r = load_document(tmp_path / "run" / "result.json")[1]
        assert r["status"] == "partial" and r["status_reason"] == "interrupted by SIGHUP after 0 level(s)"
    assert check_file(tmp_path / "run" / "requests.jsonl") == []


def hung_server_ends_its_level(tmp_path: Path, workers: int) -> None:
    """SIGSTOP to the server mid-level: the watch finds no bytes on any stream for stall_timeout_s and no
    answer to the health probe, and the level fails that quiet window (plus the watch's own allowances)
    after, where the requests' own timeouts would keep it going for hours."""
    from kvexp.measure.watch import CANCEL_WAIT_S, CHECK_INTERVAL_S, PROBE_TIMEOUT_S

    stall = 5.0
    run = Run("scenario.requests=3000", "scenario.concurrency=[2]", f"scenario.stall_timeout_s={stall:g}",
              f"client.workers={workers}", f"hydra.run.dir={tmp_path}/run")
    try:
        run.wait_for("level 2: 3000 requests")
        server = run.server()
        time.sleep(1)
        os.kill(server.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        ended = run.wait_for("(FAILED)", timeout=stall + 60)  # a hang guard: a watch that never fires
        rc = run.proc.wait(timeout=120)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    # the watch notices within a check of the quiet window and gives the probe its timeout; the level
    # then unwinds within CANCEL_WAIT_S. Twice the first part: a busy machine delays every step, while a
    # watch that waited for the requests' own timeouts (stall_timeout_s each, 2 at a time, 3,000 of them)
    # or for a second quiet window would be far later
    detect = stall + CHECK_INTERVAL_S + PROBE_TIMEOUT_S
    print(f"\nthe level ended {ended - stopped:.1f} s after SIGSTOP (one window and the watch's allowances: "
          f"{detect + CANCEL_WAIT_S:g} s)")
    assert rc == 1
    assert run.output.strip().splitlines()[-1] == "kvexp: 1 job(s) failed: llamacpp-tiny-fp16-smoke"
    assert not running(server)
    r = load_document(tmp_path / "run" / "result.json")[1]
    (lv,) = r["levels"]
    assert lv["status"] == "failed" and lv["status_reason"].startswith("server hung: no bytes on any stream for")
    # the quiet the watch measured: one window (not cut short, and not a second one)
    quiet = int(re.search(r"no bytes on any stream for (\d+) s", lv["status_reason"]).group(1))
    assert stall <= quiet < 2 * stall, lv["status_reason"]
    assert r["status"] == "failed" and r["status_reason"].startswith("server hung")
    assert check_file(tmp_path / "run" / "requests.jsonl") == []
    rows = [json.loads(x) for x in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert sum(1 for q in rows if not q["warmup"]) == lv["requests"] == 3000
    # the end state, not a clock: the watch cut the level, so the requests it never sent fail with its
    # reason (a level that waited for the requests' own timeouts would have sent all 3,000), and the only
    # other failures are requests that went out and met their own stall timeout first
    mine = [q for q in rows if not q["warmup"]]
    unsent = [q for q in mine if q["sent_s"] is None]
    assert unsent and all(q["error"] == lv["status_reason"] for q in unsent)
    own = [q for q in mine if q["error"] and q["error"] != lv["status_reason"]]
    assert all(q["sent_s"] is not None for q in own), {q["error"] for q in own}


@pytest.mark.parametrize("workers", [1, 2], ids=["own-loop", "2-worker-processes"])
def test_a_hung_server_ends_its_level_within_the_stall_timeout(llama_server, tmp_path, workers):
    hung_server_ends_its_level(tmp_path, workers)


def port_state(port: int, patience: float) -> str:
    """"refused" once nothing listens on the port within patience seconds, else "answers" or "silent"
    (the connection is taken but /slots, which llama-server's engine loop answers, is not within 2 s)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + patience
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/slots", timeout=2).read()
            state = "answers"
        except urllib.error.HTTPError:
            state = "answers"
        except urllib.error.URLError as e:
            if isinstance(e.reason, ConnectionRefusedError):
                return "refused"
            state = "silent"
        except (TimeoutError, OSError):
            state = "silent"
        if time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def test_a_server_told_to_stop_mid_level_ends_it_without_waiting_for_the_stall_timeout(llama_server, tmp_path):
    """SIGTERM to llama-server mid-level. Usually it closes its listener at once but stays in its shutdown
    with every stream open and silent: the watch's early probe is refused, so the level fails within a few
    seconds of quiet, well before scenario.stall_timeout_s. But llama-server's signal handler takes its
    task-queue lock, and when the signal lands while the main thread holds that lock (inside
    server_queue::yield_to_queue during a decode; frequent on a busy machine) the server deadlocks: its
    port stays open and nothing answers. That is a hung server, ended one stall timeout after the quiet
    began (its /health still answers then, from the HTTP threads; the watch asks /slots). The test sees
    for itself which of the two the server did, and holds kvexp to that one."""
    stall = 30
    run = Run("scenario.requests=40", "scenario.concurrency=[4]", "scenario.max_tokens=4000",
              f"scenario.stall_timeout_s={stall}", f"hydra.run.dir={tmp_path}/run")
    try:
        run.wait_for("level 4: 40 requests")
        server = run.server()
        port = int(server.cmdline()[server.cmdline().index("--port") + 1])
        time.sleep(1)
        server.send_signal(signal.SIGTERM)
        state = port_state(port, patience=10)
        assert state != "answers", "llama-server's loop still answers /slots 10 s after SIGTERM"
        run.wait_for("(FAILED)", timeout=stall + 120)  # a hang guard
        rc = run.proc.wait(timeout=120)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    print(f"\nllama-server after SIGTERM: {state} (refused: it shut its port; silent: deadlocked in its handler)")
    assert rc == 1
    assert run.output.strip().splitlines()[-1] == "kvexp: 1 job(s) failed: llamacpp-tiny-fp16-smoke"
    assert not running(server)
    r = load_document(tmp_path / "run" / "result.json")[1]
    (lv,) = r["levels"]
    quiet = int(re.search(r"no bytes on any stream for (\d+) s", lv["status_reason"]).group(1))
    rows = [json.loads(x) for x in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    cut = [q for q in rows if not q["warmup"] and q["error_kind"] is not None]  # what the watch cut short
    if state == "refused":
        assert lv["status"] == "failed" and lv["status_reason"].startswith("server stopped listening:"), lv["status_reason"]
        assert quiet < stall, lv["status_reason"]  # the refused probe, not the stall timeout, ended it
        assert r["status"] == "failed" and r["status_reason"].startswith("server stopped listening:")
        assert cut and all(q["error_kind"] == "connection" and "server stopped listening" in q["error"] for q in cut)
    else:  # deadlocked: the port takes connections and answers nothing, a hung server
        assert lv["status"] == "failed" and lv["status_reason"].startswith("server hung:"), lv["status_reason"]
        assert stall <= quiet < 2 * stall, lv["status_reason"]
        assert r["status"] == "failed" and r["status_reason"].startswith("server hung")
        # the streams' own stall timeouts (the same 30 s) may fire beside the watch: timeouts all the same
        assert all(q["error_kind"] == "timeout" for q in cut) and any("server hung" in q["error"] for q in cut)
    assert check_file(tmp_path / "run" / "requests.jsonl") == []
