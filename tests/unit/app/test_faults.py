"""Hostile cases, each handled in one line with the right exit status and nothing measured lost: bad
config values refused at compose time, nonsense result files refused by `validate` with their JSON
path, one writer per folder, a resume with a changed spec that changes nothing, a full disk, Markdown
that escapes what users typed, quiet PDF layout, and the install's step lines. On the fake llama-server
(tests/support/fake_openai.py); the signal and hung-server cases on the real one are in test_faults_server.py."""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import TINY, kvexp_main, snapshot, ROOT

from kvexp.app import preflight
from kvexp.app.compose import check, compose, compose_all, kv_choices
from kvexp.backends import launched
from kvexp.core.config import ConfigError
from kvexp.results.store import load_document
from kvexp.results.validate import check_file, config_hash

import fake_openai  # noqa: E402


@pytest.fixture(scope="module")
def fake(tmp_path_factory) -> Path:
    return fake_openai.wrapper(tmp_path_factory.mktemp("fake"))


# ---------------------------------------------------------------- 6. bad config values
BAD_CONFIG = [
    ("backend.port=-1", "backend.port=-1: must be >= 1 and <= 65,535"),
    ("backend.port=70000", "backend.port=70000: must be >= 1 and <= 65,535"),
    ("gpu.memory_gib=-4", "gpu.memory_gib=-4.0: must be > 0"),
    ("backend.endpoint=notaurl", "backend.endpoint='notaurl': must be an http:// or https:// URL"),
    ("backend.endpoint=http://127.0.0.1:99999", "backend.endpoint='http://127.0.0.1:99999': the port must be in"),
    ("+scenario.foo=1", "scenario.foo: unknown key; allowed keys are api, arrival,"),
    ("+backend.foo=1", "backend.foo: unknown key; allowed keys are api_key_env,"),
    ("+foo=1", "foo: unknown key; allowed keys are backend,"),
    ("scenario.rates=[1,2]", "scenario.concurrency=[1, 2] and scenario.rates=[1.0, 2.0] are both set"),
    ("scenario.request_timeout_s=-1", "scenario.request_timeout_s=-1.0: must be > 0"),
    ("scenario.request_timeout_s=0", "scenario.request_timeout_s=0.0: must be > 0"),
    ("scenario.stall_timeout_s=-2", "scenario.stall_timeout_s=-2.0: must be > 0"),
    ("scenario.slo_ttft_ms=-1", "scenario.slo_ttft_ms=-1.0: must be > 0 (or null: no TTFT objective)"),
    ("scenario.slo_tpot_ms=0", "scenario.slo_tpot_ms=0.0: must be > 0"),
    ("backend.threads=-3", "backend.threads=-3: must be >= 1"),
    ("backend.stop_grace_s=-1", "backend.stop_grace_s=-1.0: must be >= 0"),
    ("backend.ready_timeout_s=-5", "backend.ready_timeout_s=-5.0: must be > 0"),
    ("backend.parallel=-1", "backend.parallel=-1: must be >= 1 and <= 4,096"),
    ("scenario.concurrency=[100000]", "scenario.concurrency=[100000]: every level must be an integer in 1..4,096"),
    ("backend.flash_attn=maybe", "backend.flash_attn='maybe': allowed values are on, off, auto"),
    ("scenario.arrival=bursty", "scenario.arrival='bursty': allowed values are constant, poisson"),
    ("client.event_loop=trio", "client.event_loop='trio': allowed values are auto, asyncio, uvloop"),
    ("unsupported=ignore", "unsupported='ignore': allowed values are auto, error, skip"),
    ("backend.host=256.1.1.1", "backend.host='256.1.1.1': not an IP address or host name"),
    ("backend.host=", "backend.host='': not an IP address or host name"),
    ("backend.context=10", "scenario.prompt_tokens + scenario.max_tokens = 48 tokens do not fit"),
    ("backend.context=0", "backend.context=0: must be >= 1"),
    ("gpu.index=-1", "gpu.index=-1: must be >= 0"),
    ("gpu.sample_interval_s=0", "gpu.sample_interval_s=0.0: must be >= 0.001"),
    ("scenario.max_tokens=10000000", "scenario.max_tokens=10000000: must be >= 1 and <= 1,048,576"),
    ("model.n_layers=-1", "model.n_layers=-1: must be >= 1"),
    ("backend=vllm backend.gpu_memory_utilization=1.5", "backend.gpu_memory_utilization=1.5: must be > 0 and <= 1"),
    ("backend=vllm backend.kv_cache_memory_bytes=-1", "backend.kv_cache_memory_bytes=-1: must be >= 1"),
    ("backend=vllm backend.block_size=0", "backend.block_size=0: must be >= 1"),
    ("backend=vllm backend.context=40", "scenario.prompt_tokens + scenario.max_tokens = 48 tokens do not fit the 40 tokens per sequence of backend.context=40:"),
]


@pytest.mark.parametrize("overrides,expected", BAD_CONFIG, ids=[c[0] for c in BAD_CONFIG])
def test_bad_value_refused_at_compose_time(overrides, expected):
    with pytest.raises(ConfigError) as e:
        for _, cfg in compose_all([*TINY, *overrides.split()]):
            check(cfg, kv_choices())
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(expected), msg


def test_bad_value_on_the_command_line_is_one_line_and_exit_1(tmp_path, capsys):
    assert kvexp_main("backend.port=70000", f"hydra.run.dir={tmp_path}/run") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvexp: backend.port=70000: must be >= 1 and <= 65,535 (or null: a free port)"]
    assert not (tmp_path / "run").exists()


def test_rates_alone_and_good_values_still_compose():
    for o in (["scenario.concurrency=[]", "scenario.rates=[2,4]"], ["backend.host=::1"], ["backend.host=localhost"],
              ["backend.endpoint=https://example.org:8443/v1"], ["backend.flash_attn=auto", "backend.context=4096"]):
        for _, cfg in compose_all(o):
            assert check(cfg, kv_choices()) is None
    cfg = compose([*TINY, "backend.flash_attn=off"])
    assert cfg.backend.flash_attn == "off" and f"{cfg.backend.flash_attn}" == "off"


# ---------------------------------------------------------------- 7. result files that are nonsense
@pytest.fixture(scope="module")
def good_run(fake, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("good") / "run"
    assert kvexp_main(f"backend.binary={fake}", f"hydra.run.dir={out}") == 0
    return out


def _result_cases(r: dict, agg: dict) -> list[tuple[str, str, str]]:
    """(name, file text, the JSON path its rejection must name)."""
    text = json.dumps(r)
    tput = json.dumps(r["levels"][0]["throughput_tok_s"])
    cases = [(n, text.replace(f'"throughput_tok_s": {tput}', f'"throughput_tok_s": {v}', 1),
              "$.levels[0].throughput_tok_s") for n, v in (("nan", "NaN"), ("inf", "Infinity"), ("1e400", "1e400"))]
    d = copy.deepcopy(r)
    d["levels"][0].update(errors=99, errors_by_kind={"timeout": 99})
    cases.append(("errors>requests", json.dumps(d), "$.levels[0].errors"))
    d = copy.deepcopy(r)
    d["levels"][0]["requests"] = 10 ** 30
    cases.append(("10^30 requests", json.dumps(d), "$.levels[0].requests"))
    d = copy.deepcopy(r)
    d.update(levels=[], status="complete")
    cases.append(("complete without levels", json.dumps(d), "$.levels"))
    d = copy.deepcopy(agg)
    d["planner"]["kv_bytes"]["auto"] = -2.0
    cases.append(("negative planner.kv_bytes", json.dumps(d), "$.planner.kv_bytes.auto"))
    d = copy.deepcopy(agg)
    d["runs"][0]["levels"][0]["ttft_p50_ms"] = float("nan")
    cases.append(("NaN in an aggregate", json.dumps(d), "$.runs[0].levels[0].ttft_p50_ms"))
    cases.append(("200,000-deep nesting", "[" * 200_000 + "]" * 200_000, "nested too deeply"))
    cases.append(("500-deep objects", '{"a":' * 500 + "1" + "}" * 500, "$.a.a.a"))
    return cases


def test_validate_rejects_nonsense_with_its_json_path(good_run, reference_path, tmp_path, capsys):
    r = load_document(good_run / "result.json")[1]
    agg = json.loads(reference_path.read_text())
    for name, text, where in _result_cases(r, agg):
        f = tmp_path / "bad.json"
        f.write_text(text)
        errs = check_file(f)
        assert errs and where in errs[0], (name, errs)
        assert kvexp_main("validate", str(f)) == 1, name
        out = capsys.readouterr().out
        assert "Traceback" not in out and where in out, (name, out)
    assert kvexp_main("report", str(f)) == 1  # the report refuses it too, in one line
    assert "Traceback" not in capsys.readouterr().err


def test_validate_does_not_read_a_device_or_a_huge_file_for_ever(tmp_path, monkeypatch, capsys):
    # in a process of its own, so that a validator reading /dev/zero for ever is killed (the timeout is a
    # hang guard, not a speed target) instead of filling this one's memory
    p = subprocess.run([sys.executable, "-m", "kvexp", "validate", "/dev/zero"], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stdout == "/dev/zero: not a regular file (a device, FIFO or socket); not a kvexp file\n"
    from kvexp.results import validate

    monkeypatch.setattr(validate, "MAX_FILE_BYTES", 1000)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"levels": ["x" * 2000]}))
    assert kvexp_main("validate", str(big)) == 1
    assert "larger than" in capsys.readouterr().out


def test_validate_reports_a_cut_last_line(good_run, tmp_path, capsys):
    text = (good_run / "requests.jsonl").read_text()
    cut = tmp_path / "requests.jsonl"
    cut.write_text(text[:-40])
    assert kvexp_main("validate", str(cut)) == 1
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.endswith("(the last line, cut short)")


# ---------------------------------------------------------------- 4. one writer per folder
def test_a_second_run_into_a_held_folder_is_refused_with_the_holders_pid(fake, tmp_path):
    folder = tmp_path / "sweep"
    first = subprocess.Popen([sys.executable, "-m", "kvexp", "-m", *TINY, f"backend.binary={fake}",
                              "backend.extra_args=[--token-gap,0.03]", "scenario.requests=20",
                              f"hydra.sweep.dir={folder}"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (folder / "multirun.yaml").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        second = subprocess.run([sys.executable, "-m", "kvexp", "-m", *TINY, f"backend.binary={fake}",
                                 f"hydra.sweep.dir={folder}", "resume=true"], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert first.poll() is None, "the first run ended before the second started: make it longer"
        assert second.returncode == 1
        assert second.stderr.strip().splitlines() == [
            f"kvexp: {folder}: another kvexp (pid {first.pid}) is writing into this folder; wait for it to end "
            "or choose another folder"]
    finally:
        first.wait(timeout=300)
    assert first.returncode == 0, first.stdout.read()  # type: ignore[union-attr]
    # the first run's data are its own: one level's rows per level, as its result says
    res = load_document(next(folder.glob("*/result.json")))[1]
    rows = [json.loads(x) for x in next(folder.glob("*/requests.jsonl")).read_text().splitlines()]
    for lv in res["levels"]:
        assert sum(1 for q in rows if q["level"] == lv["concurrency"] and not q["warmup"]) == lv["requests"]


def test_no_overwrite_without_resume(fake, good_run, capsys):
    before = snapshot(good_run)
    assert kvexp_main(f"backend.binary={fake}", f"hydra.run.dir={good_run}") == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"kvexp: {good_run}: already holds 1 result(s) ({good_run / 'result.json'}); add resume=true "
                    "to finish that run, or choose another folder")
    assert snapshot(good_run) == before


def test_a_quoted_folder_is_the_one_checked(fake, tmp_path, capsys):
    """A folder with a quote, given quoted and escaped as Hydra's grammar asks: the folder kvexp locks and
    checks for results is the one Hydra writes into, so the second run is refused, the first kept."""
    folder = tmp_path / "it's"
    given = "hydra.run.dir='" + str(folder).replace("'", "\\'") + "'"
    assert kvexp_main(f"backend.binary={fake}", given) == 0
    capsys.readouterr()
    before = snapshot(folder)
    assert kvexp_main(f"backend.binary={fake}", "scenario.requests=4", given) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"kvexp: {folder}: already holds 1 result(s)"), line
    assert snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["it's"]  # no folder named with the escape


def test_lock_holder_is_read_from_proc_locks(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # type: ignore[union-attr]
        with pytest.raises(ConfigError, match=f"another kvexp \\(pid {holder.pid}\\)"):
            preflight.lock(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    preflight.lock(tmp_path)  # free again once its holder has gone
    preflight.unlock_all()


# ---------------------------------------------------------------- 3. resume with a changed spec
@pytest.fixture(scope="module")
def sweep(fake, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sweep") / "s"
    assert kvexp_main("-m", f"backend.binary={fake}", "kv=fp16,q8_0", "scenario.requests=4",
                      f"hydra.sweep.dir={folder}") == 0
    return folder


def test_resume_with_changed_overrides_changes_nothing(fake, sweep, capsys):
    before = snapshot(sweep)
    assert ".hydra" in "".join(before) and "multirun.yaml" in before
    assert kvexp_main("-m", f"backend.binary={fake}", "kv=fp16,q4_0", "scenario.requests=4",
                      f"hydra.sweep.dir={sweep}", "resume=true") == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "the spec changed since it was measured" in line and "nothing in the folder was changed" in line
    assert line.endswith(f"start a new sweep: python -m kvexp -m {' '.join(TINY)} backend.binary={fake} kv=fp16,q4_0 "
                         "scenario.requests=4")
    assert snapshot(sweep) == before


def test_resume_after_the_spec_itself_changed_changes_nothing(sweep, capsys):
    # as if conf/scenario/smoke.yaml had been edited since: the saved overrides match, a job's hash not
    res = sweep / "1_llamacpp-tiny-q8_0-smoke" / "result.json"
    doc = json.loads(res.read_text())
    doc["config"]["scenario"]["warmup_requests"] += 1  # a result of that other spec: its hash is its config's
    doc["config_hash"] = config_hash(doc["config"])
    res.write_text(json.dumps(doc, indent=1) + "\n")
    before = snapshot(sweep)
    assert kvexp_main("resume", str(sweep)) == 1
    err = capsys.readouterr().err
    assert f"job llamacpp-tiny-q8_0-smoke: config hash {doc['config_hash']}, now" in err
    assert snapshot(sweep) == before


def test_skipped_job_gets_a_summary_and_the_sweep_its_report(fake, tmp_path):
    folder = tmp_path / "s"
    assert kvexp_main("-m", f"backend.binary={fake}", "kv=fp16,fp8", "unsupported=skip", "scenario.requests=2",
                      f"hydra.sweep.dir={folder}") == 0
    skipped = next(folder.glob("*fp8*"))
    assert "Status: **skipped**" in (skipped / "summary.md").read_text()
    assert (folder / "report" / "report.md").is_file() and (folder / "summary.md").is_file()


# ---------------------------------------------------------------- 2. failed runs exit non-zero
def test_a_run_whose_levels_all_failed_exits_non_zero(fake, tmp_path, capsys):
    assert kvexp_main(f"backend.binary={fake}", "backend.extra_args=[--fault,http500,--fault-after,1]",
                      f"hydra.run.dir={tmp_path}/run") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "kvexp: 1 job(s) failed: llamacpp-tiny-fp16-smoke"


class _Answers:
    """An attached endpoint that is not the server it was named as: healthy, and every other path answered
    200 with the same body."""

    def __init__(self, body: str):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                data = (b'{"status": "ok"}' if self.path == "/health" else body.encode())
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.parametrize("backend,body,reason", [
    ("llamacpp", "{not json", "/slots answered HTTP 200 with a body that is not JSON: '{not json'"),
    ("llamacpp", "[]", "/tokenize answered HTTP 200 with a JSON list where a dict was expected"),
    ("llamacpp", '{"build_info": 7}', "/slots answered HTTP 200 with a JSON dict where a list was expected"),
    ("vllm", "{}", "/tokenize answered HTTP 200 with an object without 'tokens' (list)"),
], ids=["not JSON", "a list", "an object", "vLLM: no tokens"])
def test_an_attached_endpoint_answering_other_json_fails_its_job_in_one_line(tmp_path, capsys, backend, body, reason):
    """200 with a body that is not the JSON the backend's server answers used to end the run in a
    traceback (`'list' object has no attribute 'get'`): it fails the job, saying which URL answered what."""
    junk = _Answers(body)
    try:
        assert kvexp_main(f"backend={backend}", f"backend.endpoint={junk.url}",
                          f"hydra.run.dir={tmp_path}/run") == 1
    finally:
        junk.server.shutdown()
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("kvexp: 1 job(s) failed: ")
    res = load_document(tmp_path / "run" / "result.json")[1]
    assert res["status"] == "failed" and junk.url + reason in res["status_reason"]


# ---------------------------------------------------------------- 8. disk full, unwritable folder
def test_unwritable_folder_is_one_line(fake, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert kvexp_main(f"backend.binary={fake}", f"hydra.run.dir={blocker}/run") == 1
    assert capsys.readouterr().err == f"kvexp: {blocker}/run: cannot write results here: Not a directory\n"


def _check_disk_full_folder(out: Path) -> None:
    assert check_file(out / "requests.jsonl") == []
    res = load_document(out / "result.json")[1]
    assert res["status"] == "failed"
    assert res["status_reason"].endswith("No space left on device"), res["status_reason"]
    assert not (out / ".kvexp-reserve").exists()


def test_disk_full_mid_job_injected(fake, tmp_path, monkeypatch, capsys):
    """ENOSPC injected into the writes of requests.jsonl after the first level's lines."""
    from kvexp.results import store as results

    real_write, written = os.write, []

    def full(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("requests.jsonl"):
            written.append(len(data))
            if len(written) > 2:  # warm-up, level 1, then the disk is full
                n = real_write(fd, bytes(data)[:len(data) // 2])  # half a level gets out first
                if n:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(results.os, "write", full)
    out = tmp_path / "run"
    assert kvexp_main(f"backend.binary={fake}", "scenario.concurrency=[1,2,4]", f"hydra.run.dir={out}") == 1
    _check_disk_full_folder(out)
    assert len(load_document(out / "result.json")[1]["levels"]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_disk_full_mid_job_on_a_tiny_tmpfs(fake, tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the injected test covers the same path")
    try:
        out = mnt / "run"
        r = subprocess.run([sys.executable, "-m", "kvexp", *TINY, f"backend.binary={fake}", "scenario.requests=100",
                            "scenario.concurrency=[1,2,4]", f"hydra.run.dir={out}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        _check_disk_full_folder(out)
    finally:
        subprocess.run(["umount", str(mnt)])


@pytest.fixture
def full_disk(tmp_path):
    """A 200 KiB tmpfs with 20 KiB left: less than Hydra's saved config and a first result need."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (mnt / "fill").write_bytes(bytes(180 << 10))
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)])


def test_a_disk_already_full_is_refused_before_anything_starts(full_disk):
    r = subprocess.run([sys.executable, "-m", "kvexp", *TINY, f"hydra.run.dir={full_disk / 'run'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert r.stderr == f"kvexp: {full_disk / 'run'}: cannot write results here: No space left on device\n", r.stderr


def test_a_report_onto_a_full_disk_says_so_in_one_line(full_disk, good_run, capsys):
    assert kvexp_main("report", str(good_run), "--out", str(full_disk / "rep")) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvexp: report: cannot write ") and err.endswith(": No space left on device\n"), err
    assert err.count("\n") == 1


# ---------------------------------------------------------------- 9. Markdown escapes user strings
def test_markdown_outputs_escape_user_strings(fake, tmp_path):
    folder = tmp_path / "s"
    evil = "'<script>x</script>|a*b'"
    assert kvexp_main("-m", f"backend.binary={fake}", f"model.name={evil}", "kv=fp16,fp8", "unsupported=skip",
                      "scenario.requests=2", f"hydra.sweep.dir={folder}") == 0
    mds = [*folder.glob("*/summary.md"), folder / "summary.md", folder / "report" / "report.md"]
    assert len(mds) == 4
    for md in mds:
        # a fenced code block (the exact launch command) shows its text literally in every renderer
        text = re.sub(r"(?ms)^(`{3,})[^\n]*\n.*?^\1$", "", md.read_text())
        assert "<script>" not in text and "|a*b" not in text, md
        assert "\\<script\\>x\\</script\\>\\|a\\*b" in text, md


# ---------------------------------------------------------------- 10. noise
def test_chart_svg_has_nothing_for_weasyprint_to_ignore(reference_path, tmp_path, caplog, capfd):
    from kvexp.analysis.aggregate import collect
    from kvexp.report.charts import presentation_attributes
    from kvexp.report.render import render_report

    assert presentation_attributes('<path d="M0" style="fill: none; stroke: #1f77b4"/>') == \
        '<path d="M0" fill="none" stroke="#1f77b4"/>'
    assert presentation_attributes('<text x="1" fill="red" style="fill: blue">a</text>') == \
        '<text x="1" fill="blue">a</text>'
    caplog.set_level(logging.DEBUG)
    render_report(collect([reference_path]), tmp_path / "rep")
    assert (tmp_path / "rep" / "report.pdf").is_file()
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "<svg" in html and "style=\"fill" not in html
    assert not [r for r in caplog.records if r.name.startswith(("weasyprint", "fontTools"))]
    out, err = capfd.readouterr()
    assert "Ignored" not in out + err


def test_install_step_prints_one_line_and_names_its_log_on_failure(tmp_path, capsys):
    from kvexp.assets.install import run_step

    log = tmp_path / "build.log"
    run_step([sys.executable, "-c", "for i in range(1, 201): print(f'[{i}/200] Building CXX object f{i}.o')"],
         step="compiling", log=log)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "kvexp install: compiling ..." and out[-1] == "kvexp install: compiling: 100 %"
    assert len(out) <= 12 and "Building CXX" in log.read_text()
    with pytest.raises(SystemExit) as e:
        run_step([sys.executable, "-c", "print('error: no compiler'); raise SystemExit(3)"], step="configuring", log=log)
    assert str(e.value) == f"kvexp install: configuring failed (exit status 3); its full output is in {log}"
    assert "error: no compiler" in log.read_text() and "error: no compiler" not in capsys.readouterr().out


# ---------------------------------------------------------------- 1. leftovers of a killed kvexp
def test_cleanup_stops_a_server_whose_kvexp_is_gone(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVEXP_CACHE", str(tmp_path))
    orphan = subprocess.Popen(["sleep", "300"], start_new_session=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        launched.remember(orphan.pid, ["/usr/bin/sleep", "300"])
        rec = json.loads((tmp_path / "servers" / f"{orphan.pid}.json").read_text())
        assert rec["kvexp_pid"] == os.getpid()
        rec.update(kvexp_pid=gone.pid)  # as if the kvexp that launched it had been killed
        (tmp_path / "servers" / f"{orphan.pid}.json").write_text(json.dumps(rec))
        assert [r.pid for r in launched.report_leftovers()] == [orphan.pid]
        assert kvexp_main("cleanup", "--dry-run") == 0 and orphan.poll() is None
        assert kvexp_main("cleanup") == 0
        assert f"kvexp cleanup: stopped sleep (pid {orphan.pid}" in capsys.readouterr().out
        assert orphan.wait(timeout=10) == -15
        assert not list((tmp_path / "servers").glob("*.json"))
        assert kvexp_main("cleanup") == 0
        assert capsys.readouterr().out == "kvexp cleanup: no server left running by an ended kvexp\n"
    finally:
        if orphan.poll() is None:
            orphan.kill()


def test_a_missing_model_file_is_refused_before_the_folder_is_made(tmp_path, capsys):
    assert kvexp_main("model=qwen2.5-7b", "model.gguf=/nonexistent.gguf", f"hydra.run.dir={tmp_path}/run") == 1
    assert capsys.readouterr().err == "kvexp: model.gguf='/nonexistent.gguf': no such file (a GGUF file is needed for model=qwen2.5-7b)\n"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_model_file_that_is_no_file_is_named_for_what_it_is(tmp_path, capsys, kind):
    """A folder or a named pipe given as model.gguf: said as such (it used to be "no such file"), and a
    FIFO is not opened (its read would wait for a writer)."""
    path = tmp_path / "model.gguf"
    path.mkdir() if kind == "folder" else os.mkfifo(path)
    assert kvexp_main("model=qwen2.5-7b", f"model.gguf={path}", f"hydra.run.dir={tmp_path}/run") == 1
    what = "a folder, not a file" if kind == "folder" else "a named pipe (FIFO), not a regular file"
    assert capsys.readouterr().err == f"kvexp: model.gguf='{path}': {what} (a GGUF file is needed for model=qwen2.5-7b)\n"
