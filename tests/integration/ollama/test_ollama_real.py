"""The real Ollama server (built from its Go module by `python -m kvexp install ollama`), launched by kvexp
with the job's GGUF imported: each KV type applied as the server's own log states it, its KV cache
consistent with kvexp's planner (consistency between two parts of kvexp, not truth), token counts
equal to the server's eval_count, the client's TPOT beside the server's eval_duration on the real model,
and no server left after SIGINT or a killed server.

The fake Ollama (tests/support/fake_ollama.py) stays for what a real server cannot be made to do on demand:
malformed streams, stalls, mid-stream errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import missing, with_tiny
from unit.app.test_interrupts import Kvexp, jobs

from kvexp.backends.llamacpp import MIB
from kvexp.results.validate import check_file

KV = {"fp16": "f16", "q8_0": "q8_0", "q4_0": "q4_0"}  # kvexp's name -> OLLAMA_KV_CACHE_TYPE


def _run(tmp: Path, env: dict[str, str], *args: str) -> tuple[Kvexp, int]:
    k = Kvexp(list(args), tmp, env, server="ollama")
    return k, k.finish(timeout=600)


def _requests(job: Path) -> list[dict]:
    rows = [json.loads(x) for x in (job / "requests.jsonl").read_text().splitlines()]
    return [r for r in rows if not r["warmup"]]


@pytest.fixture(scope="module")
def sweep(ollama, tmp_path_factory):
    """One sweep of the tiny model over Ollama's three KV types."""
    tmp = tmp_path_factory.mktemp("ollama")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVEXP_CALIBRATION": str(tmp / "cal.json")}
    k, rc = _run(tmp, env, "-m", "backend=ollama", f"backend.binary={ollama}", "kv=fp16,q8_0,q4_0")
    assert rc == 0, k.output[-3000:]
    assert k.seen and not k.survivors()
    (folder,) = (tmp / "outputs" / "sweeps").iterdir()
    return folder


def test_each_kv_type_is_the_one_the_server_applied_and_consistent_with_the_plan(sweep):
    results = jobs(sweep)
    assert [r["kv"]["requested"] for r in results.values()] == list(KV)
    for r in results.values():
        kv = r["kv_cache"]
        assert r["status"] == "complete" and r["backend"]["version"] == "0.24.0"
        assert kv["dtype"] == kv["dtype_k"] == kv["dtype_v"] == KV[r["kv"]["requested"]]
        assert "printed by Ollama's runner" in kv["source"][0]
        plan = r["planner"]
        assert kv["capacity_tokens"] == plan["capacity_tokens"]  # cells, as the runner's log states them
        assert abs(kv["bytes"] - plan["kv_cache_bytes"]) <= 0.005 * MIB  # the log rounds to 0.01 MiB
    assert check_file(sweep / "sweep.json") == []
    assert (sweep / "report" / "report.pdf").is_file()


def test_output_counts_are_the_servers_eval_count(sweep):
    """kvexp records the server's eval_count, not its own count of stream lines: Ollama holds back a
    token whose text is an incomplete character and sends it with the next, so a line may carry two."""
    results = jobs(sweep)
    for d in sorted(p for p in sweep.iterdir() if (p / "requests.jsonl").is_file()):
        rows = _requests(d)
        assert rows and all(r["http_status"] == 200 and r["error"] is None for r in rows)
        for r in rows:  # num_predict reached: the server generated exactly max_tokens
            assert r["finish_reason"] == "length" and r["output_tokens"] == r["max_tokens"], r
            assert 1 <= len(r["token_times_s"]) <= r["output_tokens"]
            # the server's decode time lies inside the request's time as the client saw it
            assert r["prompt_tokens"] is not None and 0 < r["server_timings"]["eval_s"] < r["done_s"] - r["sent_s"]
        levels = results[d.name]["levels"]
        assert sum(lv["output_tokens"] for lv in levels) == sum(r["output_tokens"] for r in rows)


def test_client_tpot_agrees_with_the_servers_eval_duration_on_the_real_model(ollama, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVEXP_CALIBRATION": str(tmp_path / "cal.json")}
    k, rc = _run(tmp_path, env, "backend=ollama", f"backend.binary={ollama}", "model=smollm2", "kv=q8_0",
                 "scenario.concurrency=[1]", "scenario.max_tokens=32", "scenario.requests=8",
                 f"hydra.run.dir={tmp_path}/run")
    assert rc == 0, k.output[-3000:]
    r = json.loads((tmp_path / "run" / "result.json").read_text())
    (lv,) = r["levels"]
    server = lv["server"]
    assert server["source"].startswith("Ollama's per-request durations")
    # the client's TPOT holds the server's decode time plus the stream's delivery; within 5 %
    assert lv["tpot_p50_ms"] == pytest.approx(server["tpot_p50_ms"], rel=0.05)
    # the GGUF kvexp imports gives prompts of exact length (one-token text units), so no estimate is made
    assert r["workload"]["prompt_mode"] == "exact text" and r["workload"]["chars_per_token"] is None
    assert lv["mean_prompt_tokens"] == r["scenario"]["prompt_tokens"]


@pytest.mark.parametrize("model,api", [("smollm2", "completions"), ("smollm2", "chat"), ("tiny", "completions")])
def test_every_prompt_is_the_asked_length_by_the_servers_count(ollama, llama_server, tmp_path, model, api):
    """Over a GGUF kvexp imports, prompts are text of one-token units found with llama.cpp's tokenizer
    over the same file, less what the server adds (BOS, chat template): every request's
    prompt_eval_count is its asked length, lengths drawn from a distribution and the warm-up included."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVEXP_CALIBRATION": str(tmp_path / "cal.json")}
    k, rc = _run(tmp_path, env, "backend=ollama", f"backend.binary={ollama}", f"model={model}", f"scenario.api={api}",
                 "scenario.prompt_dist.kind=uniform", "scenario.prompt_dist.min=17", "scenario.prompt_dist.max=64",
                 "scenario.prompt_tokens=40", "scenario.concurrency=[1]", "scenario.max_tokens=2",
                 f"hydra.run.dir={tmp_path}/run")
    assert rc == 0, k.output[-3000:]
    r = json.loads((tmp_path / "run" / "result.json").read_text())
    assert r["server"]["capabilities"]["offline_tokenizer"] and r["workload"]["prompt_mode"] == "exact text"
    units = r["workload"]["text_units"]
    assert units["source"].startswith("llama.cpp's /tokenize") and "estimated_because" not in r["workload"]
    assert [c["server_tokens"] - c["units"] for c in units["checks"]] == [units["added_tokens"]] * 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    compared = [(row["target_prompt_tokens"], row["prompt_tokens"]) for row in rows if row["error"] is None]
    assert len(compared) == len(rows) >= 9 and len({asked for asked, _ in compared}) > 1
    assert all(asked == counted for asked, counted in compared), compared
    print(f"\n{model} {api}: {len(compared)} requests, asked {min(compared)[0]}..{max(compared)[0]} tokens, "
          f"prompt_eval_count equal to it in all; the server adds {units['added_tokens']}")
    (lv,) = r["levels"]
    assert lv["workload"]["prompts_exact"] == lv["workload"]["prompts_checked"] == lv["requests"]


def test_sigint_leaves_no_ollama_process(ollama, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVEXP_CALIBRATION": str(tmp_path / "cal.json")}
    k = Kvexp(with_tiny(["backend=ollama", f"backend.binary={ollama}", "scenario.requests=2000",
                         f"hydra.run.dir={tmp_path}/run"]), tmp_path, env, server="ollama")
    k.wait_for("level 1: 2000 requests")
    assert len(k.servers()) >= 2  # `ollama serve` and the runner it started for the model
    time.sleep(0.5)
    k.proc.send_signal(signal.SIGINT)
    assert k.finish() == 130, k.output[-3000:]
    time.sleep(1)
    assert not k.survivors(), k.survivors()
    assert "Traceback" not in k.output


def test_a_killed_server_fails_its_job_and_the_next_runs(ollama, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVEXP_CALIBRATION": str(tmp_path / "cal.json")}
    k = Kvexp(with_tiny(["-m", "backend=ollama", f"backend.binary={ollama}", "kv=fp16,q8_0",
                         "scenario.requests=400"]), tmp_path, env, server="ollama")
    k.wait_for("ollama-tiny-fp16-smoke: level 1: 400 requests")
    for p in k.servers():
        p.kill()
    assert k.finish() == 1, k.output[-3000:]
    assert "kvexp: 1 job(s) failed: ollama-tiny-fp16-smoke" in k.output
    assert not k.survivors()
    (sweep,) = (tmp_path / "outputs" / "sweeps").iterdir()
    results = jobs(sweep)
    assert [r["status"] for r in results.values()] == ["failed", "complete"]
    assert results["0_ollama-tiny-fp16-smoke"]["status_reason"].startswith("ollama server was killed by SIGKILL")


def test_a_runner_killed_mid_level_fails_that_level_in_the_servers_words(ollama, tmp_path):
    """`kill -9` of Ollama's runner (not of `ollama serve`): Ollama loads the model again and goes on
    answering, so the level's requests mostly succeed; its figures mix two loads and a cold start, and
    the level fails with the scheduler's own line, not counted as valid."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVEXP_CALIBRATION": str(tmp_path / "cal.json")}
    k = Kvexp(with_tiny(["backend=ollama", f"backend.binary={ollama}", "scenario.requests=3000",
                         "scenario.concurrency=[2]", f"hydra.run.dir={tmp_path}/run"]), tmp_path, env, server="ollama")
    k.wait_for("level 2: 3000 requests")
    (runner,) = [p for p in k.servers() if "runner" in p.cmdline() and "--model" in p.cmdline()]
    time.sleep(0.5)
    runner.kill()
    assert k.finish(timeout=600) == 1, k.output[-3000:]
    r = json.loads((tmp_path / "run" / "result.json").read_text())
    (lv,) = r["levels"]
    # Ollama's own words where its log has them in time ("llama runner process no longer running", signal:
    # killed), else that it started its runner again; the level fails either way
    reason = lv["status_reason"]
    assert lv["status"] == "failed" and reason.startswith("the server lost its model during this level: Ollama")
    assert "the model was loaded again; its figures mix two loads" in reason, reason
    assert k.output.strip().splitlines()[-1] == "kvexp: 1 job(s) failed: ollama-tiny-fp16-smoke"
    assert not k.survivors()


def test_the_servers_last_error_line_is_quoted_when_it_exits(ollama, tmp_path):
    """An Ollama models folder on a read-only mount: `ollama serve` exits at once; the job's reason quotes
    its last error line, where it said only "exited with status 1"."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)]).returncode != 0:
        missing("a read-only mount (root and mount(8))", "run as root")
    try:
        env = {**os.environ, "KVEXP_CALIBRATION": str(tmp_path / "cal.json")}
        k, rc = _run(tmp_path, env, *with_tiny(["backend=ollama", f"backend.binary={ollama}",
                                                f"+backend.env={{OLLAMA_MODELS: {ro}}}", f"hydra.run.dir={tmp_path}/run"]))
    finally:
        subprocess.run(["umount", str(ro)])
    assert rc == 1
    r = json.loads((tmp_path / "run" / "result.json").read_text())
    assert r["status_reason"] == (f"ollama server exited with status 1 (its last error: Error: mkdir {ro}/blobs: "
                                  "read-only file system: ensure path elements are traversable) before becoming ready")
