"""kvexp as a process, on the real llama-server: no server outlives it after a normal end, a killed
server, an exception in kvexp or SIGINT/SIGTERM; what was measured survives, and an interrupted sweep
resumed measures exactly what is missing."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import TINY, with_tiny

from kvexp.backends.process import tail
from kvexp.results.store import load_document
from kvexp.results.validate import check_file

import fake_openai  # noqa: E402


class Kvexp:
    """kvexp run as a subprocess: its log lines as they come, and every process it started."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str], server: str = "llama-server"):
        self.server = server  # what a server's command line holds
        self.proc = subprocess.Popen(args if args[0] == sys.executable else [sys.executable, "-m", "kvexp", *with_tiny(args)],
                                     cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self.seen: dict[int, psutil.Process] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def servers(self) -> list[psutil.Process]:
        """The servers kvexp runs now; each is remembered for survivors()."""
        found = []
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                argv = p.cmdline()
                # the program, not a fork of kvexp about to exec, nor the program asked for its --help
                # (kvexp reads the flags this build takes before it checks backend.extra_args)
                if self.server in " ".join(argv[:2]) and "--help" not in argv:
                    found.append(self.seen.setdefault(p.pid, p))
        except psutil.Error:  # kvexp or a short-lived child has just ended
            pass
        return found

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            self.servers()
            assert self.proc.poll() is None and time.monotonic() < deadline, f"{text!r} never came:\n{self.output[-3000:]}"
            time.sleep(0.01)

    def finish(self, timeout: float = 180) -> int:
        while self.proc.poll() is None:  # keep watching for servers until the end
            self.servers()
            assert timeout > 0, self.output[-3000:]
            time.sleep(0.05)
            timeout -= 0.05
        self._reader.join(10)
        return self.proc.returncode

    def survivors(self) -> list[psutil.Process]:
        return [p for p in self.seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "KVEXP_CALIBRATION": str(tmp_path / "calibration.json")}


def jobs(sweep: Path) -> dict[str, dict]:
    return {d.name: load_document(d / "result.json")[1] for d in sorted(sweep.iterdir()) if (d / "result.json").is_file()}


def measured(job_dir: Path) -> list[str]:
    return [x for x in (job_dir / "requests.jsonl").read_text().splitlines() if '"warmup": false' in x]


def test_server_killed_in_job_two_of_four(llama_server, tmp_path, env):
    k = Kvexp(["-m", "kv=fp16,q8_0,q4_0,bf16", f"backend.binary={llama_server}"], tmp_path, env)
    k.wait_for("llamacpp-tiny-q8_0-smoke: level 1: 8 requests")
    for server in k.servers():
        server.kill()
    assert k.finish() == 1, k.output[-3000:]
    assert "kvexp: 1 job(s) failed: llamacpp-tiny-q8_0-smoke" in k.output
    assert len(k.seen) == 4 and not k.survivors()
    (sweep,) = (tmp_path / "outputs" / "sweeps").iterdir()
    results = jobs(sweep)
    assert [r["status"] for r in results.values()] == ["complete", "failed", "complete", "complete"]
    two = results["1_llamacpp-tiny-q8_0-smoke"]
    assert two["status_reason"].startswith("llamacpp server was killed by SIGKILL after ")
    assert two["backend"]["log_tail"] == tail(sweep / "1_llamacpp-tiny-q8_0-smoke" / "server.log", 20) != ""
    assert [lv["concurrency"] for lv in results["2_llamacpp-tiny-q4_0-smoke"]["levels"]] == [1, 2]
    assert check_file(sweep / "sweep.json") == []


# requests per level: enough for a level to take a few seconds, so that SIGINT lands inside it on any
# machine and stopping can be told from waiting for the level to finish
LEVEL = 300


@pytest.fixture(scope="module")
def interrupted(llama_server, tmp_path_factory):
    """A three-job sweep stopped by SIGINT while job two measures its second level."""
    cwd = tmp_path_factory.mktemp("interrupted")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVEXP_CALIBRATION": str(cwd / "calibration.json")}
    k = Kvexp(["-m", "kv=fp16,q8_0,q4_0", f"backend.binary={llama_server}", f"scenario.requests={LEVEL}"], cwd, env)
    k.wait_for(f"llamacpp-tiny-q8_0-smoke: level 2: {LEVEL} requests")
    t = time.monotonic()
    k.proc.send_signal(signal.SIGINT)
    rc = k.finish()
    stop_s = time.monotonic() - t
    (sweep,) = (cwd / "outputs" / "sweeps").iterdir()
    return k, rc, stop_s, sweep, cwd, env


def test_sigint_stops_every_server_and_keeps_what_was_measured(interrupted):
    k, rc, stop_s, sweep, _, _ = interrupted
    assert rc == 130
    assert k.seen and not k.survivors()
    assert ("kvexp: interrupted by SIGINT: servers stopped, finished levels saved; resume with: "
            f"python -m kvexp resume {sweep.resolve()}\n") in k.output
    assert "Traceback" not in k.output
    results = jobs(sweep)
    assert list(results) == ["0_llamacpp-tiny-fp16-smoke", "1_llamacpp-tiny-q8_0-smoke"]
    two = results["1_llamacpp-tiny-q8_0-smoke"]
    assert (two["status"], two["status_reason"]) == ("partial", "interrupted by SIGINT after 1 level(s)")
    assert [lv["concurrency"] for lv in two["levels"]] == [1]
    # kvexp ended sooner than the level it cut short takes to measure in full (job one's level 2, the
    # same level measured earlier in this run): it stopped rather than waiting for the level to end
    (full,) = [lv["wall_s"] for lv in results["0_llamacpp-tiny-fp16-smoke"]["levels"] if lv["concurrency"] == 2]
    print(f"\nstopped {stop_s:.2f} s after SIGINT; the level takes {full:.2f} s")
    assert stop_s < full
    for d in sweep.iterdir():
        if (d / "requests.jsonl").exists():
            assert check_file(d / "requests.jsonl") == []


def test_resume_measures_exactly_what_is_missing(interrupted):
    k, _, _, sweep, cwd, env = interrupted
    before = {name: (sweep / name / "result.json").read_bytes() for name in ("0_llamacpp-tiny-fp16-smoke",)}
    two = sweep / "1_llamacpp-tiny-q8_0-smoke"
    kept = measured(two)
    command = k.output.split("resume with: ")[1].splitlines()[0]
    r = Kvexp([sys.executable, *shlex.split(command)[1:]], cwd, env)
    assert r.finish() == 0, r.output[-3000:]
    assert not r.survivors()
    results = jobs(sweep)
    assert [r_["status"] for r_ in results.values()] == ["complete"] * 3
    assert (sweep / "0_llamacpp-tiny-fp16-smoke" / "result.json").read_bytes() == before["0_llamacpp-tiny-fp16-smoke"]
    resumed = results["1_llamacpp-tiny-q8_0-smoke"]
    assert [lv["concurrency"] for lv in resumed["levels"]] == [1, 2] and len(resumed["resumed_at"]) == 1
    now = measured(two)
    assert now[:LEVEL] == kept  # level 1: the very same requests
    assert {json.loads(x)["level"] for x in now[LEVEL:]} == {2} and len(now) == 2 * LEVEL  # level 2: measured now
    assert "resumed_at" not in results["2_llamacpp-tiny-q4_0-smoke"]
    assert check_file(sweep / "sweep.json") == []


@pytest.mark.parametrize("then_ctrl_c", [False, True], ids=["sigterm", "sigterm-then-sigint"])
def test_sigterm_mid_level(tmp_path, env, then_ctrl_c):
    """SIGTERM ends the run at once; Ctrl-C pressed again and again while it stops changes nothing: the
    first signal decides the line and the exit status."""
    fake = fake_openai.wrapper(tmp_path)
    stall_s = 86_400  # the hung request would wait a day for its next byte (the server still answers /health)
    k = Kvexp([f"backend.binary={fake}", "backend.extra_args=[--fault,stall,--fault-after,3]",
               f"scenario.stall_timeout_s={stall_s}"], tmp_path, env, server="fake_openai")
    k.wait_for("level 1: 8 requests")
    time.sleep(0.3)  # the third request now hangs
    k.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05 * then_ctrl_c)  # Python runs the handlers of signals pending together in signal-number order
    while then_ctrl_c and k.proc.poll() is None:
        k.proc.send_signal(signal.SIGINT)
        time.sleep(0.005)
    assert k.finish() == 143, k.output[-3000:]
    assert k.output.count("interrupted by") == 1 and "Traceback" not in k.output and "SIGINT" not in k.output
    # it ended at all (finish's guard is minutes): it did not wait the day the hung request would
    assert len(k.seen) == 1 and not k.survivors()
    (run,) = (tmp_path / "outputs" / "runs").iterdir()
    assert f"resume with: python -m kvexp resume {run}" in k.output
    r = load_document(run / "result.json")[1]
    assert (r["status"], r["status_reason"]) == ("partial", "interrupted by SIGTERM after 0 level(s)")


@pytest.mark.parametrize("sig", [signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2])
def test_signals_whose_default_would_kill_kvexp_silently_end_it_like_sigterm(tmp_path, env, sig):
    """SIGQUIT (Ctrl-\\) and SIGUSR1/2 kept their default action: kvexp ended without a word, its result
    unfinished. Now each ends it as SIGTERM does: servers stopped, what was measured saved, one line."""
    fake = fake_openai.wrapper(tmp_path)
    k = Kvexp([f"backend.binary={fake}", "backend.extra_args=[--fault,stall,--fault-after,3]",
               "scenario.stall_timeout_s=86400"], tmp_path, env, server="fake_openai")
    k.wait_for("level 1: 8 requests")
    k.proc.send_signal(sig)
    assert k.finish() == 128 + sig, k.output[-3000:]
    assert k.output.count(f"interrupted by {sig.name}") == 1 and "Traceback" not in k.output
    assert len(k.seen) == 1 and not k.survivors()
    (run,) = (tmp_path / "outputs" / "runs").iterdir()
    r = load_document(run / "result.json")[1]
    assert (r["status"], r["status_reason"]) == ("partial", f"interrupted by {sig.name} after 0 level(s)")


def test_exception_in_kvexp(llama_server, tmp_path, env):
    code = ("import sys, kvexp.measure.runner as r\n"
            "def boom(*a, **k): raise ZeroDivisionError('boom')\n"
            "r._planner_block = boom\n"
            "from kvexp.app.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    k = Kvexp([sys.executable, "-c", code, *TINY, f"backend.binary={llama_server}"], tmp_path, env)
    assert k.finish() == 1
    assert len(k.seen) == 1 and not k.survivors()
    (run,) = (tmp_path / "outputs" / "runs").iterdir()
    r = load_document(run / "result.json")[1]
    assert (r["status"], r["status_reason"]) == ("failed", "ZeroDivisionError: boom")


def test_kvexp_stopped_and_continued_mid_level_fails_that_level_not_the_server(tmp_path, env):
    """Ctrl-Z then fg (SIGSTOP, SIGCONT) of kvexp for longer than the stall timeout: the level's timings
    include the pause, so it fails saying so, and the server (which went on answering) is not called hung;
    the next level is measured as usual."""
    fake = fake_openai.wrapper(tmp_path)
    k = Kvexp([f"backend.binary={fake}", "backend.extra_args=[--token-gap,0.05]", "scenario.requests=8",
               "scenario.max_tokens=16", "scenario.concurrency=[1,2]", "scenario.stall_timeout_s=2",
               f"hydra.run.dir={tmp_path}/run"], tmp_path, env, server="fake_openai")
    k.wait_for("level 1: 8 requests")
    time.sleep(1)
    k.proc.send_signal(signal.SIGSTOP)
    time.sleep(4)  # twice the stall timeout
    k.proc.send_signal(signal.SIGCONT)
    assert k.finish() == 0, k.output[-3000:]
    r = load_document(tmp_path / "run" / "result.json")[1]
    one, two = r["levels"]
    assert (one["status"], one["status_reason"]) == ("failed", "kvexp itself was stopped (Ctrl-Z or SIGSTOP) and "
                                                     "continued during this level: its timings include the pause")
    assert two["status"] == "ok" and r["status"] == "partial" and "server hung" not in k.output
    assert not k.survivors()
