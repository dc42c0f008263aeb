"""The whole path through Hydra on the real llama-server: `python -m kvexp -m kv=fp16,q8_0 scenario=smoke`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_watched, survivors, with_tiny

from kvexp.results.validate import check_file


def run_kvexp(args, cwd: Path, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvexp", *with_tiny(args)], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def run_kvexp_watched(args, cwd: Path, timeout=300):
    """run_kvexp, with the llama-servers this kvexp started (its own process tree, seen while it ran)."""
    return run_watched([sys.executable, "-m", "kvexp", *with_tiny(args)], "llama-server", timeout, cwd=cwd)


@pytest.fixture(scope="module")
def sweep(llama_server, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("sweep")
    p, servers = run_kvexp_watched(["-m", "kv=fp16,q8_0", "scenario=smoke", f"backend.binary={llama_server}"], cwd)
    assert p.returncode == 0, p.stderr[-3000:]
    sweeps = list((cwd / "outputs" / "sweeps").iterdir())
    assert len(sweeps) == 1
    return sweeps[0], p, servers


def jobs(sweep_dir: Path) -> list[Path]:
    return sorted(d for d in sweep_dir.iterdir() if (d / "result.json").is_file())


def test_two_jobs_with_readable_names(sweep):
    sweep_dir, *_ = sweep
    names = [d.name for d in jobs(sweep_dir)]
    assert names == ["0_llamacpp-tiny-fp16-smoke", "1_llamacpp-tiny-q8_0-smoke"]


def test_files_validate(sweep):
    sweep_dir, *_ = sweep
    for d in jobs(sweep_dir):
        for f in ("result.json", "requests.jsonl"):
            assert check_file(d / f) == [], f
        assert (d / "summary.md").read_text().startswith("# kvexp job: llamacpp-tiny-")
        assert (d / "server.log").stat().st_size > 0
    assert check_file(sweep_dir / "sweep.json") == []
    assert "| llamacpp-tiny-q8_0-smoke |" in (sweep_dir / "summary.md").read_text()
    (rec,) = json.loads((sweep_dir / "sweep.json").read_text())["recommendations"]  # one scenario, no SLO
    assert rec["scenario"] == "smoke" and rec["slo"] is None and rec["best"]["label"].startswith("llamacpp-tiny-")
    assert "## Ranking\n\n- smoke, no latency objective set" in (sweep_dir / "summary.md").read_text()
    report = (sweep_dir / "report" / "report.md").read_text()
    assert report.index("## Verdict") < report.index("## Ranking") < report.index("## Findings")


def test_kv_types_are_the_servers_own(sweep):
    sweep_dir, *_ = sweep
    reported = []
    for d in jobs(sweep_dir):
        r = json.loads((d / "result.json").read_text())
        assert r["status"] == "complete"
        assert "server log: llama_kv_cache size line (cells x streams)" in r["kv_cache"]["source"]
        reported.append((r["kv"]["requested"], r["kv_cache"]["dtype"], r["kv_cache"]["dtype_k"], r["kv_cache"]["dtype_v"]))
        assert r["kv_cache"]["capacity_tokens"] == 512  # -c 128 -np 2: 2 slots x 64, each padded to 256 cells
        assert r["planner"]["capacity_tokens"] == 512
    assert reported == [("fp16", "f16", "f16", "f16"), ("q8_0", "q8_0", "q8_0", "q8_0")]


def test_server_and_client_ran_on_cpus_of_their_own(sweep):
    sweep_dir, *_ = sweep
    mine = sorted(os.sched_getaffinity(0))
    for d in jobs(sweep_dir):
        r = json.loads((d / "result.json").read_text())
        pl = r["environment"]["placement"]
        if len(mine) < 2:
            assert pl["mode"] == "shared" and pl["server_cpus"] is None
            continue
        assert pl["mode"] == "split" and pl["server_cpus"] + pl["client_cpus"] == mine
        assert pl["server_cpus_seen"] == pl["server_cpus"]  # the server's own affinity, read from the OS
        argv = r["backend"]["launch_command"]
        assert argv[argv.index("-t") + 1] == str(len(pl["server_cpus"]))
        assert r["environment"]["client"]["cores"] == len(pl["client_cpus"])


def test_measurements(sweep):
    sweep_dir, *_ = sweep
    for d in jobs(sweep_dir):
        r = json.loads((d / "result.json").read_text())
        assert [lv["concurrency"] for lv in r["levels"]] == [1, 2]
        for lv in r["levels"]:
            assert lv["errors"] == 0 and lv["requests"] == 8
            assert lv["throughput_tok_s"] > 0 and lv["ttft_p50_ms"] > 0 and lv["tpot_p50_ms"] > 0
            assert lv["mean_prompt_tokens"] == 32 and lv["mean_output_tokens"] == 16
            assert lv["peak_rss_gib"] > 0  # a CPU run still has a memory figure
            assert lv["peak_vram_gib"] is None  # no NVIDIA driver here: null, not 0
        reqs = [json.loads(x) for x in (d / "requests.jsonl").read_text().splitlines()]
        measured = [q for q in reqs if not q["warmup"]]
        assert len(measured) == 16 and len(reqs) == 17
        assert all(q["prompt_tokens"] == 32 and q["output_tokens"] == 16 for q in measured)
        assert all(len(q["token_times_s"]) == 16 for q in measured)


def test_no_server_left(sweep):
    _, _, servers = sweep
    assert len(servers) == 2  # one per KV type (a launch of its own, not the first one's server reused)
    assert not survivors(servers)


def test_single_default_run(llama_server, tmp_path):
    p, servers = run_kvexp_watched([f"backend.binary={llama_server}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs" / "runs").iterdir()
    assert run_dir.name.endswith("_llamacpp-tiny-fp16-smoke")
    assert check_file(run_dir / "result.json") == []
    assert len(servers) == 1 and not survivors(servers)


def test_missing_llama_server_says_how_to_get_it(tmp_path):
    p = run_kvexp(["backend.binary=/nonexistent/llama-server"], tmp_path)
    assert p.returncode == 1
    assert "python -m kvexp install llamacpp" in p.stderr
    assert "Traceback" not in p.stderr


def test_what_a_person_reads_is_prose_with_the_verdict_first(sweep):
    """Every Markdown, HTML, CSV and PDF page the real sweep rendered: no Python repr, no None or nan, no
    nearly empty page, the verdict before the findings; the verdict names the noise it held the jobs to."""
    from unit.analysis.test_verdict import check_readable

    sweep_dir, *_ = sweep
    check_readable(sweep_dir)
    summary = (sweep_dir / "summary.md").read_text()
    verdict = summary.split("## Verdict", 1)[1].split("##", 1)[0]
    assert "smoke: " in verdict and "repeat with scenario.repeats=3" in verdict
    assert ("tie" in verdict) != ("leads" in verdict)  # either a tie or a measurable lead, never both
    # the KV bytes per token the verdict weighs (the server's KV size over its cells) is the planner's,
    # computed from the model's architecture and the dtype's block size
    from kvexp.results.runs import Run

    for run in json.loads((sweep_dir / "sweep.json").read_text())["runs"]:
        assert Run.from_json(run).bytes_per_token == run["planner"]["kv_bytes_per_token"], run["label"]
