"""Quality measurements on real servers: llama.cpp (llama-perplexity and llama-server) and vLLM with
the tiny quality models kvexp writes itself, through the whole CLI path; Ollama's continuation path
through its adapter against the fake server (no real Ollama can be installed here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import hardware_skip, missing, with_tiny, ROOT

from kvexp.results.validate import check_file


def run_kvexp(args: list[str], cwd: Path, cache: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVEXP_QUALITY_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kvexp", *with_tiny(args)], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=env)


def results(folder: Path) -> dict[str, dict]:
    out = {}
    for f in sorted(folder.rglob("result.json")):
        assert check_file(f) == [], f
        r = json.loads(f.read_text())
        out[r["kv"]["requested"]] = r
    return out


def depths(r: dict) -> dict[int, dict]:
    return {d["context"]: d for d in r["quality"]["teacher_forced"]["depths"]}


# --- llama.cpp ----------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def llama_perplexity(llama_server) -> Path:
    from kvexp.assets.install import find_llama_perplexity

    found = find_llama_perplexity(llama_server)
    if found is None:
        missing("llama-perplexity", "run `python -m kvexp install llamacpp`")
    return found


@pytest.fixture(scope="module")
def llama_sweep(llama_server, llama_perplexity, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("quality")
    cache = cwd / "qcache"
    p = run_kvexp(["-m", "model=tiny-quality", "kv=fp16,q8_0,q4_0", "scenario=quality",
                   f"backend.binary={llama_server}"], cwd, cache)
    assert p.returncode == 0, p.stderr[-3000:]
    (sweep,) = list((cwd / "outputs" / "sweeps").iterdir())
    return sweep, cache


@pytest.mark.llamacpp
def test_llamacpp_f16_against_itself_is_the_floor(llama_sweep):
    sweep, _ = llama_sweep
    r = results(sweep)["fp16"]
    assert r["status"] == "complete" and r["levels"] == []
    q = r["quality"]
    for depth, d in depths(r).items():
        assert d["status"] == "ok", d
        assert abs(d["kld_mean"]) <= 1e-6, d  # llama-perplexity prints 6 decimals
        assert d["rerun_identical"] is True and d["self_kld_mean"] == 0.0 and d["self_top1_agreement"] == 1.0
        # the 16-bit base file's steps of 2.4e-4 nats can swap near-tied top tokens: at most 1 in 1000
        assert d["top1_agreement"] >= 0.999, d
        assert 20 < d["ppl_base"] < 500 and d["ppl"] == pytest.approx(d["ppl_base"], rel=1e-5)
    assert set(depths(r)) == {512, 2048, 4096}
    assert q["determinism"]["deterministic"] is True and q["warnings"] == []
    assert q["continuation"]["identical_share"] == 1.0 and q["continuation"]["kld_prefix_mean"] == 0.0


@pytest.mark.llamacpp
def test_llamacpp_quantised_kv_drifts_in_order(llama_sweep):
    sweep, _ = llama_sweep
    res = results(sweep)
    q8, q4 = depths(res["q8_0"]), depths(res["q4_0"])
    for depth in (512, 2048, 4096):
        assert q8[depth]["status"] == q4[depth]["status"] == "ok"
        assert 0 < q8[depth]["kld_mean"] < q4[depth]["kld_mean"], (q8[depth], q4[depth])
        assert q4[depth]["top1_agreement"] < q8[depth]["top1_agreement"] < 1.0
        assert q8[depth]["kld_median"] <= q8[depth]["kld_p99"] <= q8[depth]["kld_max"]
    c8, c4 = res["q8_0"]["quality"]["continuation"], res["q4_0"]["quality"]["continuation"]
    assert c8["prompts"] == c4["prompts"] == 8 and c8["unit"] == "token"
    assert c4["prefix_agreement"] <= c8["prefix_agreement"] < 1.0
    assert c4["kld_prefix_mean"] > 0


@pytest.mark.llamacpp
def test_the_sweep_measures_the_baseline_once(llama_sweep):
    sweep, cache = llama_sweep
    res = results(sweep)
    assert res["fp16"]["quality"]["baseline"]["cached"] is False
    assert res["fp16"]["quality"]["baseline"]["measured_by_this_job"] == [
        "teacher-forced depth 512", "teacher-forced depth 2048", "teacher-forced depth 4096", "continuations"]
    for kv in ("q8_0", "q4_0"):
        b = res[kv]["quality"]["baseline"]
        assert b["cached"] is True and b["measured_by_this_job"] == []
        assert b["key"] == res["fp16"]["quality"]["baseline"]["key"]
        assert not (sweep / f"{'1' if kv == 'q8_0' else '2'}_llamacpp-tiny-quality-{kv}-quality" /
                    "baseline-server.log").exists()
    (entry,) = list(cache.iterdir())
    assert sorted(p.name for p in entry.iterdir()) == [
        "continuations.json", "key.json", "tf-ctx2048.json", "tf-ctx2048.kld", "tf-ctx4096.json", "tf-ctx4096.kld",
        "tf-ctx512.json", "tf-ctx512.kld"]
    # every llama-perplexity command and its output is kept
    log = (sweep / "1_llamacpp-tiny-quality-q8_0-quality" / "quality.log").read_text()
    assert "-ctk q8_0 -ctv q8_0" in log and "--kl-divergence" in log


@pytest.mark.llamacpp
def test_the_report_shows_the_quality_table_chart_and_trade(llama_sweep):
    sweep, _ = llama_sweep
    md = (sweep / "report" / "report.md").read_text()
    assert "## Quality: drift from the 16-bit KV cache" in md
    assert "| llamacpp-tiny-quality-q4_0-quality | q4_0 | fp16 | 4096 |" in md
    assert "![Mean KLD from the 16-bit KV cache vs context depth](charts/quality-kld.png)" in md
    assert (sweep / "report" / "charts" / "quality-kld.png").stat().st_size > 1000
    assert "llama.cpp q8_0 KV vs fp16: 0.53× KV memory for the same tokens, mean KLD" in md
    html = (sweep / "report" / "report.html").read_text()
    assert 'id="chart-quality-kld"' in html and "<svg" in html
    agg = json.loads((sweep / "sweep.json").read_text())
    assert sum(1 for r in agg["runs"] if r.get("quality")) == 3


@pytest.mark.llamacpp
def test_quality_after_speed_levels_measures_a_missing_baseline_itself(llama_server, llama_perplexity, tmp_path):
    p = run_kvexp(["model=tiny-quality", "kv=q8_0", "scenario=smoke", "quality.enabled=true", "quality.depths=[512]",
                   "quality.prompts=3", "quality.max_tokens=8", f"backend.binary={llama_server}"],
                  tmp_path, tmp_path / "qcache")
    assert p.returncode == 0, p.stderr[-3000:]
    (folder,) = list((tmp_path / "outputs" / "runs").iterdir())
    (r,) = results(folder).values()
    assert r["status"] == "complete" and len(r["levels"]) == 2  # the smoke levels ran first
    q = r["quality"]
    assert q["baseline"]["cached"] is False and "continuations" in q["baseline"]["measured_by_this_job"]
    assert (folder / "baseline-server.log").stat().st_size > 0  # an f16 server of its own
    assert depths(r)[512]["kld_mean"] > 0 and q["continuation"]["prompts"] == 3


# --- vLLM ---------------------------------------------------------------------------------------------

@pytest.mark.vllm
def test_vllm_fp8_drifts_and_auto_reproduces_itself(tmp_path):
    from kvexp.backends.vllm import cpu_fp8_kv_supported
    from kvexp.assets.install import vllm_python

    if vllm_python() is None:
        missing("the vLLM CPU venv", "run `python -m kvexp install vllm`")
    kvs = "fp16,fp8" if cpu_fp8_kv_supported(Path("/proc/cpuinfo").read_text()) else "fp16"
    p = run_kvexp(["-m", "backend=vllm", "model=tiny-quality", f"kv={kvs}", "scenario=quality", "quality.depths=[512]",
                   "quality.prompts=4", "quality.max_tokens=16"], tmp_path, tmp_path / "qcache")
    assert p.returncode == 0, p.stderr[-3000:]
    (sweep,) = list((tmp_path / "outputs" / "sweeps").iterdir())
    res = results(sweep)
    auto = depths(res["fp16"])[512]
    assert auto["kld_mean"] == 0.0 and auto["top1_agreement"] == 1.0 and auto["positions"] == 4 * 255
    assert res["fp16"]["quality"]["determinism"]["deterministic"] is True
    assert res["fp16"]["quality"]["teacher_forced"]["top_k"] == 10
    if "fp8" not in res:
        hardware_skip("fp8 KV on vLLM's CPU build needs AVX-512 or AMX; this CPU has neither")
    fp8 = depths(res["fp8"])[512]
    assert fp8["kld_mean"] > 0 and fp8["top1_agreement"] < 1.0
    assert res["fp8"]["quality"]["baseline"]["cached"] is True
    assert res["fp8"]["kv_cache"]["capacity_tokens"] == 2 * res["fp16"]["kv_cache"]["capacity_tokens"]


# --- Ollama (the real server: its continuation path through the adapter) -------------------------------

def test_ollama_quality_degrades_to_continuations_with_reasons(ollama, tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvexp", *with_tiny(["-m", "backend=ollama", "kv=fp16,q8_0",
                        "scenario=quality", "quality.prompts=3", "quality.max_tokens=8", f"backend.binary={ollama}"])],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={**os.environ, "KVEXP_QUALITY_CACHE": str(tmp_path / "qcache"), "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    (sweep,) = list((tmp_path / "outputs" / "sweeps").iterdir())
    res = results(sweep)
    for kv in ("fp16", "q8_0"):
        q = res[kv]["quality"]
        tf = q["teacher_forced"]
        assert tf["depths"] == [] and "no log-probabilities of given text" in tf["reason"]
        c = q["continuation"]
        assert c["unit"] == "character" and c["prompts"] == 3 and c["identical_share"] is not None
        assert c["kld_prefix_mean"] is None and "exposes no log-probabilities" in c["reason"]
    assert res["q8_0"]["quality"]["baseline"]["cached"] is True


@pytest.mark.llamacpp
def test_resume_measures_quality_that_an_interrupted_job_lacks(llama_server, llama_perplexity, tmp_path):
    args = ["model=tiny-quality", "scenario=quality", "quality.depths=[512]", "quality.prompts=2",
            "quality.max_tokens=8", f"backend.binary={llama_server}"]
    p = run_kvexp(args, tmp_path, tmp_path / "qcache")
    assert p.returncode == 0, p.stderr[-3000:]
    (folder,) = list((tmp_path / "outputs" / "runs").iterdir())
    path = folder / "result.json"
    r = json.loads(path.read_text())
    r.pop("quality")  # as if interrupted while measuring quality
    r.update(status="partial", status_reason="interrupted by SIGINT after 0 level(s)")
    path.write_text(json.dumps(r))
    p = run_kvexp(["resume", str(folder)], tmp_path, tmp_path / "qcache")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(path.read_text())
    assert r["status"] == "complete" and r["quality"]["baseline"]["cached"] is True
    assert depths(r)[512]["status"] == "ok"
