"""A launched server's log stays under its cap (log.max_mb) however much the server writes, with its head
(the launch, the KV cache lines), one marker line that counts the bytes dropped, and its latest output,
each byte kept where the server wrote it; the lines kvexp reads back (llama-server's per-request
timings) are kept whole beside it, so that the per-request truth check still compares every request;
and the log is written while kvexp is stopped, and to the server's last words after kvexp's SIGKILL.

A 100,000-request job at llama-server's ~20 KB per request wrote 2 GB; here a stand-in server writes
50 MB against a 1 MiB cap (the same arithmetic, fifty times smaller), and the real llama-server runs a
job against a 64 KiB cap."""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import TINY, survivors

from kvexp.app.checks import check_ranges
from kvexp.app.compose import compose
from kvexp.backends import serverlog
from kvexp.backends.pool import ServerPool
from kvexp.backends.process import LogCap, ServerProcess, last_error_line
from kvexp.backends.ollama import Ollama, OllamaConfig
from kvexp.core.config import ConfigError, ExperimentConfig, KVConfig, ModelConfig, ScenarioConfig
from kvexp.measure.runner import run_job
from kvexp.results.store import spec_of
from kvexp.results.validate import check_file

DEADLINE_S = 120  # a hang guard only
MIB = 1 << 20
MARKER = re.compile(rb"\[kvexp: (\d+) bytes of the server's log dropped here; cap log\.max_mb=[\d.]+\]\n")

# A stand-in server: its launch lines, then `lines` numbered lines of about 200 bytes with a print_timing
# line every 100th, then an error line; the same stream comes out of stream() below, to compare with.
SERVER = r"""
import sys
n = int(sys.argv[1])
out = sys.stdout.buffer
for i, part in enumerate(stream(n)):
    out.write(part)
    if i == 0:
        out.flush()
sys.exit(3)
"""


def stream(n: int):
    yield b"llama_kv_cache: size =    2.50 MiB (  5120 cells,   2 layers,  1/1 seqs), K (f16):    1.25 MiB\n"
    yield b"srv  llama_server: model loaded\n"
    for i in range(n):
        yield b"request %d " % i + b"x" * (150 + i % 97) + b"\n"
        if i % 100 == 0:
            yield b"slot print_timing: id  0 | task %d |        eval time =  %d.00 ms /  8 tokens\n" % (i, i)
    yield b"error: the last words of the stand-in\n"


def script(tmp: Path) -> Path:
    path = tmp / "server.py"
    path.write_text(inspect.getsource(stream) + SERVER)
    return path


def launch(tmp: Path, n: int, cap: LogCap) -> ServerProcess:
    s = ServerProcess([sys.executable, str(script(tmp)), str(n)], {}, tmp / "server.log", "stand-in", 1.0,
                      log_cap=cap)
    s.start()
    return s


def wait_exit(s: ServerProcess) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while s.exited() is None:
        assert time.monotonic() < deadline, "the stand-in never finished writing"
        time.sleep(0.05)


def test_a_server_writing_fifty_times_its_cap_leaves_its_head_a_counted_gap_and_its_tail(tmp_path):
    n = 250_000  # about 50 MB
    cap = LogCap(max_bytes=1 * MIB, head_bytes=MIB // 4, lines_max_bytes=1 * MIB, kept="print_timing: ")
    s = launch(tmp_path, n, cap)
    try:
        wait_exit(s)
        said = s.exit_reason()  # quotes the last error line: the keeper has written the server's last words
    finally:
        s.stop()
    full = b"".join(stream(n))
    log = (tmp_path / "server.log").read_bytes()
    print(f"\nthe stand-in wrote {len(full):,} bytes; server.log holds {len(log):,} (cap {cap.max_bytes:,})")
    assert len(full) > 40 * cap.max_bytes
    assert len(log) <= cap.max_bytes
    (marker,) = MARKER.finditer(log)  # one gap, one line
    head, tail = log[:marker.start()], log[marker.end():]
    assert full.startswith(head) and head.startswith(b"llama_kv_cache: size =") and b": model loaded\n" in head
    assert head.endswith(b"\n") and cap.head_bytes - 300 < len(head) <= cap.head_bytes  # cut at a line's end
    assert full.endswith(tail) and len(tail) > cap.max_bytes // 4
    assert int(marker[1]) == len(full) - len(head) - len(tail)  # the count is exact
    assert said == "stand-in exited with status 3 (its last error: error: the last words of the stand-in)"
    assert last_error_line(tmp_path / "server.log") == "error: the last words of the stand-in"
    # every print_timing line, whole, in order, beside the capped log
    timings = [line for line in full.splitlines(keepends=True) if b"print_timing: " in line]
    assert (tmp_path / "server.lines.log").read_bytes() == b"".join(timings)
    figures = s.log_figures()
    assert figures["server_log_bytes"] == {"written": len(full), "on_disk": len(log),
                                           "dropped": int(marker[1]), "cap": cap.max_bytes}
    assert figures["server_lines_log_bytes"]["dropped"] == 0


def test_marks_stay_valid_across_cuts(tmp_path):
    """A mark taken before a stretch (written) finds the stretch's bytes after any number of cuts, and
    says when part of it was dropped; the kept lines of the stretch come first then."""
    path = str(tmp_path / "log")
    f = serverlog.CappedFile(path, 64 << 10, 8 << 10, "log", "log.max_mb=0.0625")
    sent = bytearray()
    for i in range(3000):  # ~150 KB: several cuts
        line = b"line %d " % i + b"y" * (i % 50) + b"\n"
        if i == 2990:
            mark = serverlog.written(path, 8 << 10)
            assert mark == len(sent)
        f.write(line)
        sent += line
    f.close()
    text, whole = serverlog.since(path, 8 << 10, mark)
    assert whole and text.encode() == sent[mark:]
    text, whole = serverlog.since(path, 8 << 10, 1000)  # in the head, before the gap
    assert not whole and text.startswith(sent[1000:1100].decode()) and "[kvexp: " in text
    text, whole = serverlog.since(path, 8 << 10, 40_000)  # dropped since
    assert not whole and text.startswith("[kvexp: ")
    assert os.path.getsize(path) <= 64 << 10
    assert serverlog.written(path, 8 << 10) == len(sent)


def test_kept_lines_are_capped_too_and_a_long_line_is_not_kept(tmp_path):
    lines = serverlog.CappedFile(str(tmp_path / "lines"), 16 << 10, 4 << 10, "kept lines", "log.lines_max_mb=x")
    keeper = serverlog.Keeper(serverlog.CappedFile(str(tmp_path / "log"), None, 0, "log", "none"), lines, "keep me")
    for i in range(5000):
        keeper.feed(b"keep me %d\n" % i if i % 2 else b"not this %d\n" % i)
    keeper.feed(b"z" * (serverlog.LONG_LINE + 10))  # a line longer than any kept one: its end is no line
    keeper.feed(b" keep me\nlast: keep me")
    keeper.close()
    data = (tmp_path / "lines").read_bytes()
    assert len(data) <= 16 << 10
    assert data.startswith(b"keep me 1\nkeep me 3\n") and data.endswith(b"keep me 4999\nlast: keep me\n")
    assert b"not this" not in data and b"zz" not in data
    assert re.search(rb"\[kvexp: \d+ bytes of the server's kept lines dropped here; cap log.lines_max_mb=x\]\n",
                     data)


# a stand-in kvexp: launches the stand-in server, says what it launched, and waits to be stopped or killed
KVEXP = """
import json, sys, time
from pathlib import Path
from kvexp.backends.process import LogCap, ServerProcess
out = Path(sys.argv[1])
s = ServerProcess(sys.argv[2:], {}, out / "server.log", "stand-in", log_cap=LogCap(1 << 20, 1 << 18, 1 << 20))
s.start()
(out / "launched.json").write_text(json.dumps({"pid": s.pid, "keeper": s.keeper.pid}))
time.sleep(600)
"""


def stand_in_kvexp(tmp: Path, server: list[str]) -> tuple[subprocess.Popen, dict]:
    k = subprocess.Popen([sys.executable, "-c", KVEXP, str(tmp), *server])
    deadline = time.monotonic() + DEADLINE_S
    while not (tmp / "launched.json").is_file():
        assert k.poll() is None and time.monotonic() < deadline, "the stand-in kvexp never launched its server"
        time.sleep(0.05)
    time.sleep(0.2)
    return k, json.loads((tmp / "launched.json").read_text())


def test_the_log_is_written_while_kvexp_is_stopped(tmp_path):
    """The server never waits on kvexp: with kvexp stopped (SIGSTOP, as Ctrl-Z), it writes 50 MB and ends."""
    n = 250_000
    k, info = stand_in_kvexp(tmp_path, [sys.executable, str(script(tmp_path)), str(n)])
    server = psutil.Process(info["pid"])
    try:
        k.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + DEADLINE_S
        while server.is_running() and server.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the server blocked while kvexp was stopped"
            time.sleep(0.1)
        assert k.poll() is None  # kvexp was stopped all along
        log = (tmp_path / "server.log").read_bytes()
        assert log.endswith(b"error: the last words of the stand-in\n") and len(log) <= 1 << 20
    finally:
        k.kill()
        k.wait()


def test_after_a_sigkill_of_kvexp_the_log_holds_the_servers_last_words_and_the_keeper_ends(tmp_path):
    last = "error: SIGTERM, my last words"
    # the server itself dies with kvexp (its parent-death signal); its child, as vLLM's engine core or
    # Ollama's runner, gets the watcher's SIGTERM and says so
    (tmp_path / "child.sh").write_text(f"trap 'echo \"{last}\"; exit 0' TERM\necho started\n"
                                       "while :; do sleep 0.1; done\n")
    server = ["sh", "-c", f"sh {tmp_path / 'child.sh'} & wait"]
    k, info = stand_in_kvexp(tmp_path, server)
    procs = [psutil.Process(info["keeper"]), psutil.Process(info["pid"])]
    k.kill()  # the watcher ends the server (SIGTERM first), whose last words the keeper writes, and ends
    k.wait()
    deadline = time.monotonic() + DEADLINE_S
    while survivors(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not survivors(procs)
    said = (tmp_path / "server.log").read_text().splitlines()  # (sh may say its sleep was "Terminated")
    assert said[0] == "started" and said[-1] == last


# Ollama 0.24.0's own lines when its runner was killed mid-level (tests/test_backend_ollama.py has them too)
GONE = ('time=2026-12-07T12:52:43.855Z level=WARN source=server.go:1305 msg="llama runner process no longer '
        'running" sys=9 string="signal: killed"')
AGAIN = ('time=2026-12-07T12:52:43.867Z level=INFO source=server.go:433 msg="starting runner" '
         'cmd="/root/.cache/kvexp/bin/ollama-0.24.0-b1 runner --model /m/blobs/sha256-2dfa --port 43849"')
BUSY = """
import os, sys, time
out = sys.stdout
print("launched", flush=True)
while not os.path.exists(sys.argv[3]):  # the level begins
    time.sleep(0.01)
for i in range(20000):
    print(f'time=t level=INFO source=routes.go:1 msg="request" status=200 n={i}')
    if i == 9000:
        print(sys.argv[1]); print(sys.argv[2])
out.flush()
time.sleep(600)
"""


def test_a_runner_lost_mid_level_is_found_where_the_cap_dropped_that_part_of_the_log(tmp_path):
    """A level whose part of the log the cap dropped still fails in the server's words: Ollama's runner
    lines are kept whole (Ollama.log_kept) and log_since reads them first."""
    cfg = ExperimentConfig(backend=OllamaConfig(), model=ModelConfig(name="tiny", ollama="tiny"),
                           kv=KVConfig(name="f16", per_backend={"ollama": "f16"}),
                           scenario=ScenarioConfig(name="t", prompt_tokens=8, max_tokens=8, concurrency=[1], requests=1))
    ollama = Ollama(cfg, "tiny", None)
    (tmp_path / "busy.py").write_text(BUSY)
    cap = LogCap(max_bytes=64 << 10, head_bytes=8 << 10, lines_max_bytes=64 << 10, kept=Ollama.log_kept)
    go = tmp_path / "go"
    s = ServerProcess([sys.executable, str(tmp_path / "busy.py"), GONE, AGAIN, str(go)], {}, tmp_path / "server.log",
                      "stand-in", 1.0, log_cap=cap)
    try:
        s.start()
        deadline = time.monotonic() + DEADLINE_S
        while "launched" not in serverlog.since(s.log_path, cap.head, 0)[0]:
            assert time.monotonic() < deadline and s.exited() is None
            time.sleep(0.05)
        mark = s.log_mark()
        go.touch()
        while serverlog.written(s.log_path, cap.head) < 1_000_000:  # ~1.3 MB, 20 times the cap
            assert time.monotonic() < deadline and s.exited() is None
            time.sleep(0.05)
        time.sleep(0.2)
        part = s.log_since(mark)
        assert GONE not in (tmp_path / "server.log").read_text()  # the cap dropped it from the log
        assert part.startswith(GONE + "\n" + AGAIN + "\n")  # the kept lines, first
        assert ollama.model_lost(part) == ('Ollama\'s runner died ("llama runner process no longer running", '
                                           'signal: killed) and the model was loaded again')
        assert ollama.model_lost(s.log_since(s.log_mark())) is None  # a later stretch: nothing lost
    finally:
        s.stop()


def test_the_cap_is_a_setting_checked_at_compose_time_and_no_part_of_the_spec():
    cfg = compose([*TINY, "log.max_mb=1", "log.head_mb=0.25", "log.lines_max_mb=null"])
    check_ranges(cfg)
    cap = LogCap.of(cfg.log)
    assert (cap.max_bytes, cap.head_bytes, cap.lines_max_bytes) == (MIB, MIB // 4, None)
    assert "log" not in spec_of(cfg)  # a resumed job may change it
    default = compose(TINY).log
    assert (default.max_mb, default.head_mb, default.lines_max_mb) == (8.0, 2.0, 8.0)
    for overrides, line in ((["log.head_mb=0.75", "log.max_mb=1"],
                             "log.head_mb=0.75: must be > 0 and <= 0.5 MiB (half of log.max_mb, so that the latest "
                             "output has room)"),
                            (["log.max_mb=0"], "log.max_mb=0.0: must be >= 0.01 and <= 1,048,576 MiB (or null: "
                                               "no cap)"),
                            (["log.lines_max_mb=inf"], "log.lines_max_mb=inf: must be >= 0.01")):
        with pytest.raises(ConfigError) as e:
            check_ranges(compose([*TINY, *overrides]))
        assert str(e.value).startswith(line), str(e.value)


# ---- the real llama-server

EVAL_TIME = re.compile(r"print_timing: .*\|\s+eval time =\s*([\d.]+) ms /\s*(\d+) tokens \(\s*([\d.]+) ms per token")


def test_a_llama_server_job_under_a_tiny_cap_keeps_its_kv_lines_and_every_requests_timing(llama_server, tmp_path):
    """llama-server at -lv 4 against a 64 KiB cap: the log stays under it, the KV cache is still read from
    its head, and every request's server timing (its print_timing line, kept whole beside the log) is the
    one kvexp recorded from the stream: the per-request truth check, on a capped log."""
    cfg = compose([*TINY, f"backend.binary={llama_server}", "scenario.requests=24", "scenario.concurrency=[1,4]",
                   "log.max_mb=0.0625", "log.head_mb=0.03125"])
    pool = ServerPool()
    try:
        res = run_job(cfg, tmp_path, pool=pool).to_json()
    finally:
        pool.release()
    assert check_file(tmp_path / "result.json") == []
    b = res["backend"]
    log = (tmp_path / "server.log").read_bytes()
    assert res["status"] == "complete" and len(log) <= 64 << 10
    assert b["server_log_bytes"]["on_disk"] <= b["server_log_bytes"]["cap"] == 64 << 10
    assert b["server_log_bytes"]["dropped"] > 0  # the cap did cut
    (m,) = MARKER.finditer(log)
    assert int(m[1]) == b["server_log_bytes"]["dropped"]
    assert res["kv_cache"]["capacity_tokens"] and res["kv_cache"]["bytes"]  # read from the head's KV lines
    rows = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    print(f"\n{len(rows)} requests; llama-server wrote {b['server_log_bytes']['written']:,} bytes of log "
          f"({b['server_log_bytes']['written'] / len(rows):,.0f} per request, launch included), "
          f"{b['server_log_bytes']['on_disk']:,} kept; {b['server_lines_log_bytes']['on_disk']:,} bytes of "
          "kept lines")
    kept = Path(b["server_lines_log"]).read_text()
    logged = sorted(round(float(ms), 2) for _, _, ms in EVAL_TIME.findall(kept))
    recorded = sorted(round(r["server_timings"]["predicted_per_token_s"] * 1000, 2)
                      for r in rows if r["error"] is None and r.get("server_timings"))
    assert len(recorded) == len(rows) > 2 * 24  # every request of both levels and the warm-up
    compared = sum(1 for a, c in zip(logged, recorded) if a == pytest.approx(c, abs=0.011))
    print(f"{len(logged)} print_timing lines kept, {compared} requests compared with them")
    assert len(logged) == len(recorded) and compared == len(recorded) > 0
