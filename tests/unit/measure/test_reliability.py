"""Server faults, on the fake llama-server (tests/support/fake_openai.py) launched by kvexp itself: every fault is
classified per request and counted in its level, a dead server ends its job at once with the exit status
and the log's tail, a server is never reused after it died, and no server outlives its job."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import TINY

from kvexp.app.compose import compose
from kvexp.backends.base import BackendError
from kvexp.backends.pool import ServerPool
from kvexp.backends.process import ServerProcess, free_port
from kvexp.measure.runner import run_job
from kvexp.report.summary import render_job_summary
from kvexp.results.documents import JobResult
from kvexp.results.store import load_document

import fake_openai  # noqa: E402

FAKE = Path(fake_openai.__file__).resolve()


@pytest.fixture(autouse=True)
def _own_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXP_CALIBRATION", str(tmp_path / "calibration.json"))


@pytest.fixture(scope="module")
def fake_binary(tmp_path_factory) -> Path:
    return fake_openai.wrapper(tmp_path_factory.mktemp("fake"))


@pytest.fixture
def pool():
    p = ServerPool()
    yield p
    p.release()


def run(tmp_path: Path, binary: Path, pool: ServerPool, *overrides: str, name: str = "job"):
    """One job on the fake: (its result.json, read back and validated; the exception that ended it)."""
    cfg = compose([*TINY, "scenario=smoke", f"backend.binary={binary}", "scenario.stall_timeout_s=0.3", *overrides])
    out = tmp_path / name
    try:
        run_job(cfg, out, pool=pool)
        err = None
    except Exception as e:  # noqa: BLE001 - the test looks at what ended the job
        err = e
    return load_document(out / "result.json")[1], err


def faults(kind: str, after: int = 1, every: int = 1) -> str:
    return f"backend.extra_args=[--fault,{kind},--fault-after,{after},--fault-every,{every}]"


@pytest.mark.parametrize("fault,kind", [("stall", "timeout"), ("http500", "http_status"), ("http429", "http_status"),
                                        ("reset", "connection"), ("malformed", "protocol"), ("truncate", "protocol")])
def test_each_fault_is_classified_and_fails_its_level(tmp_path, fake_binary, pool, fault, kind):
    r, err = run(tmp_path, fake_binary, pool, faults(fault), "scenario.concurrency=[2]", "scenario.requests=4")
    assert err is None  # the job ends normally; its level says what went wrong
    (lv,) = r["levels"]
    assert (lv["status"], lv["errors"], lv["errors_by_kind"]) == ("failed", 4, {kind: 4})
    assert r["status"] == "partial" and r["status_reason"].startswith(f"1 level(s) failed: 4/4 requests failed ({kind} 4)")
    assert "srv  log_server_r: request:" in r["backend"]["log_tail"]
    rows = [json.loads(x) for x in (tmp_path / "job" / "requests.jsonl").read_text().splitlines()]
    assert [q["error_kind"] for q in rows if not q["warmup"]] == [kind] * 4
    assert f"level 2: FAILED — 4/4 requests failed ({kind} 4)" in render_job_summary(JobResult.from_json(r))
    assert pool.current is None  # a server is not kept after a job that did not complete


@pytest.mark.parametrize("max_error_rate,status", [(0.5, "ok"), (0.1, "failed")])
def test_error_rate_threshold(tmp_path, fake_binary, pool, max_error_rate, status):
    # every 4th measured request fails: 2 of 8
    r, _ = run(tmp_path, fake_binary, pool, faults("http500", after=2, every=4), "scenario.concurrency=[1]",
               f"scenario.max_error_rate={max_error_rate}")
    (lv,) = r["levels"]
    assert (lv["errors"], lv["requests"], lv["status"]) == (2, 8, status)
    assert "2 of 8 requests failed" in [w["text"] for w in lv["warnings"] if w["code"] == "errors"]
    assert r["status"] == ("complete" if status == "ok" else "partial")


def test_dead_server_ends_the_job_at_once(tmp_path, fake_binary, pool):
    # warm-up and two requests go through, then the server kills itself (SIGKILL) mid-stream
    r, err = run(tmp_path, fake_binary, pool, faults("crash", after=3), "scenario.concurrency=[1,2,4]")
    assert isinstance(err, BackendError) and "killed by SIGKILL" in str(err)
    assert r["status"] == "failed"
    assert r["status_reason"] == "llamacpp server was killed by SIGKILL after 1 level(s); its last lines are in backend.log_tail"
    assert "fake: fault crash" in r["backend"]["log_tail"]
    assert [(lv["concurrency"], lv["status"]) for lv in r["levels"]] == [(1, "failed")]
    rows = [json.loads(x) for x in (tmp_path / "job" / "requests.jsonl").read_text().splitlines()]
    level = [q for q in rows if not q["warmup"]]
    assert len(level) == 8  # the level in progress ends; no request goes to the next levels
    # and none goes to the dead port after the first that was refused there: the others are not sent
    refused = [q for q in level if q["error"] and q["error"].startswith("connection refused")]
    not_sent = [q for q in level if q["sent_s"] is None]
    # one stream (concurrency 1): after the refusal it met, none of its requests went out
    assert len(refused) <= r["levels"][0]["concurrency"] and not_sent, level
    sent_after = [q for q in level if q["sent_s"] is not None and q["sent_s"] > refused[0]["done_s"]] if refused else []
    assert not sent_after, sent_after
    assert all(q["error"].startswith("not sent: connection refused by 127.0.0.1:") for q in not_sent)
    assert pool.current is None


def test_a_wedged_server_whose_threads_drop_each_request_is_hung(tmp_path, fake_binary, pool):
    """A deadlocked llama-server still takes connections and ends each request's stream empty after a
    while: those empty ends are no sign of life, so the level ends one stall timeout after its last token
    (it used to go on for as long as requests remained, each cut after the server's own timeout)."""
    r, err = run(tmp_path, fake_binary, pool, faults("wedge", after=3), "scenario.concurrency=[2]",
                 "scenario.requests=40", "scenario.stall_timeout_s=3")
    quiet = re.match(r"server hung: no bytes on any stream for (\d+) s", str(err))
    assert quiet and int(quiet.group(1)) >= 3, err  # a whole window of quiet, as the watch asks
    (lv,) = r["levels"]
    assert lv["status"] == "failed" and lv["status_reason"].startswith("server hung"), lv["status_reason"]
    rows = [json.loads(x) for x in (tmp_path / "job" / "requests.jsonl").read_text().splitlines()]
    # the watch cut the level short: requests still queued or streaming end as "server hung", where the old
    # code went on until the wedged server had ended every one of the 40 (each empty, after its 1 s)
    level = [q for q in rows if not q["warmup"]]
    assert any(q["error"] and "server hung" in q["error"] for q in level), level


def test_a_dead_server_is_not_reused(tmp_path, fake_binary, pool):
    first, _ = run(tmp_path, fake_binary, pool, "scenario.concurrency=[1]", "scenario.requests=2", name="a")
    assert first["status"] == "complete" and pool.current is not None
    assert first["backend"]["launch_command"][first["backend"]["launch_command"].index("--host") + 1] == "127.0.0.1"
    second, _ = run(tmp_path, fake_binary, pool, "scenario.concurrency=[1]", "scenario.requests=2", name="b")
    assert second["backend"]["reused_server"] is True  # an identical launch reuses a live server
    pid = pool.current.process.pid
    os.kill(pid, signal.SIGKILL)
    pool.current.process.proc.wait()
    third, _ = run(tmp_path, fake_binary, pool, "scenario.concurrency=[1]", "scenario.requests=2", name="c")
    assert third["status"] == "complete" and third["backend"]["reused_server"] is False
    assert pool.current.process.pid != pid


def test_never_ready(tmp_path, fake_binary, pool):
    from kvexp.core.config import BackendConfig

    # 5 s: long enough for the fake (a Python program) to start and answer 503 on a busy machine
    r, err = run(tmp_path, fake_binary, pool, "backend.extra_args=[--fault,never_ready]", "backend.ready_timeout_s=5")
    # the 5 s asked for, not the default it replaces, is the wait the reason states
    assert BackendConfig.ready_timeout_s != 5 and isinstance(err, BackendError)
    assert r["status"] == "failed" and r["status_reason"].startswith("llamacpp server not ready at http://127.0.0.1:")
    assert r["status_reason"].endswith("/health after 5 s")
    assert "GET /health 127.0.0.1 503" in r["backend"]["log_tail"]


def test_slow_start_is_waited_for(tmp_path, fake_binary, pool):
    r, err = run(tmp_path, fake_binary, pool, "backend.extra_args=[--start-delay,0.5]", "scenario.concurrency=[1]",
                 "scenario.requests=2")
    assert err is None and r["status"] == "complete" and r["backend"]["ready_s"] >= 0.5


def test_exit_before_ready(tmp_path, fake_binary, pool):
    r, err = run(tmp_path, fake_binary, pool, "backend.extra_args=[--start-delay,x]")
    assert isinstance(err, BackendError)
    # the server's own words, its log's last error line, in the one line
    assert r["status_reason"] == ("llamacpp server exited with status 2 (its last error: fake_openai: error: "
                                  "argument --start-delay: invalid float value: 'x') before becoming ready")
    assert "invalid float value: 'x'" in r["backend"]["log_tail"]


def test_port_taken(tmp_path, fake_binary, pool):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r, err = run(tmp_path, fake_binary, pool, f"backend.port={port}")
    assert isinstance(err, BackendError)
    assert r["status_reason"] == (f"backend.port={port}: the port is already in use on 127.0.0.1; free it or "
                                  "leave backend.port unset to use a free one")


def test_api_key_is_sent_but_never_written(tmp_path, monkeypatch, pool):
    key = "sk-test-5e3f9a1b2c7d"
    port = free_port()
    fake = ServerProcess([sys.executable, str(FAKE), "--port", str(port), "--api-key", key], {},
                         tmp_path / "fake.log", "fake")
    fake.start()
    try:
        fake.wait_ready(f"http://127.0.0.1:{port}/health", 20)
        monkeypatch.setenv("KVEXP_TEST_API_KEY", key)
        common = [f"backend.endpoint=http://127.0.0.1:{port}", "scenario.concurrency=[1]", "scenario.requests=2"]
        r, err = run(tmp_path, Path("unused"), pool, *common, "backend.api_key_env=KVEXP_TEST_API_KEY")
        assert err is None and r["status"] == "complete"
        refused, err = run(tmp_path, Path("unused"), pool, *common, name="no-key")
        assert "401" in str(err)  # the fake does check the key
    finally:
        fake.stop()
    files = [p for p in (tmp_path / "job").rglob("*") if p.is_file()]
    assert len(files) >= 2
    assert not [p for p in files if key.encode() in p.read_bytes()]


def test_an_attached_server_that_dies_ends_its_job(tmp_path, pool):
    """No process to watch: the next level's health probe finds the server gone, and the job fails as
    for a launched server instead of sending its requests to a dead port."""
    port = free_port()
    fake = ServerProcess([sys.executable, str(FAKE), "--port", str(port), "--fault", "crash", "--fault-after", "3"],
                         {}, tmp_path / "fake.log", "fake")
    fake.start()
    try:
        fake.wait_ready(f"http://127.0.0.1:{port}/health", 20)
        r, err = run(tmp_path, Path("unused"), pool, f"backend.endpoint=http://127.0.0.1:{port}",
                     "scenario.concurrency=[1,2]", "scenario.requests=4", "scenario.warmup_requests=0")
    finally:
        fake.stop()
    assert isinstance(err, BackendError) and r["status"] == "failed"
    assert r["status_reason"].startswith(f"the attached server at http://127.0.0.1:{port} does not answer "
                                         f"http://127.0.0.1:{port}/health (")
    assert [lv["concurrency"] for lv in r["levels"]] == [1]  # level 2 never sent a request


def test_an_attached_server_that_is_not_there_is_said_so_first(tmp_path, pool, caplog):
    """Nothing listens at backend.endpoint: the job fails on its first probe, saying so in plain words
    (aiohttp's own text named TLS it never used), before a warning about a KV cache it could not read."""
    port = free_port()
    r, err = run(tmp_path, Path("unused"), pool, f"backend.endpoint=http://127.0.0.1:{port}")
    assert isinstance(err, BackendError) and r["status"] == "failed"
    assert r["status_reason"] == (f"the attached server at http://127.0.0.1:{port} does not answer "
                                  f"http://127.0.0.1:{port}/health (connection refused by 127.0.0.1:{port})")
    assert "KV cache type" not in caplog.text and r["levels"] == []


def test_stop_ends_the_whole_group_even_when_sigterm_is_ignored(tmp_path):
    lives_s = 30  # what the group would live for if nothing killed it
    proc = ServerProcess(["sh", "-c", f"trap '' TERM; sleep {lives_s} & sleep {lives_s}"], {}, tmp_path / "log",
                         "stubborn")
    proc.start()
    time.sleep(0.2)
    root = psutil.Process(proc.pid)  # the group the test started: its shell and the shell's children
    group = [p for p in [root, *root.children(recursive=True)] if _pgid(p.pid) == proc.pid]
    assert len(group) >= 2
    proc.stop(grace_s=0.3)
    # killed after the grace (a group left to its sleeps would have exited by itself, status 0)
    assert proc.exit_reason() == "stubborn was killed by SIGKILL"
    time.sleep(0.1)
    assert not [p for p in group if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_a_bursting_stream_is_flagged_as_bursts_not_as_a_client_limit(tmp_path, fake_binary, pool):
    """The server decodes a token every 5 ms but sends each response in one write: the client's TPOT
    reflects delivery (about 0), the server's own is 5 ms, and the level says so."""
    r, err = run(tmp_path, fake_binary, pool, "backend.extra_args=[--fault,burst,--token-gap,0.005]",
                 "scenario.concurrency=[2]", "scenario.requests=6", "scenario.stall_timeout_s=5")
    assert err is None
    (lv,) = r["levels"]
    codes = {w["code"] for w in lv["warnings"]}
    assert lv["status"] == "ok" and lv["delivery"]["bursts"] is True
    assert lv["delivery"]["tokens_per_chunk"] >= 8 and lv["delivery"]["multi_token_chunk_share"] == 1.0
    assert "bursts" in codes
    # no client limit made of the bursts: the level is client-limited only where this run's own loop lag
    # or CPU says so (a busy machine may), never for the ITL a burst leaves (about 0)
    from kvexp.metrics.stats import client_limits

    own = bool(client_limits(lv["loop_lag_p99_ms"], None, [lv["client_cpu_util"]]))
    assert lv["client_limited"] is own and ("client_limited" in codes) is own
    # the client's TPOT is the delivery's (tokens read together); the server's is its decode gap, which
    # the client could not see: its first token came only after the server had decoded them all
    assert lv["tpot_p50_ms"] < lv["server"]["tpot_p50_ms"] / 4
    assert lv["server"]["tpot_p50_ms"] * (lv["mean_output_tokens"] - 1) <= lv["ttft_p50_ms"]
    burst = next(w for w in lv["warnings"] if w["code"] == "bursts")
    assert burst["values"]["server_tpot_ms"] == lv["server"]["tpot_p50_ms"]
