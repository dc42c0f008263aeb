"""Gemma 3 270M, a real sliding-window model (`python -m kvexp install gemma3`), on the real llama-server:
the KV memory kvexp's planner predicts against the two caches the server's own log states, at two
contexts per sequence and two slot counts. The log is read here with this file's own pattern, not
kvexp's parser."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import missing
from perplexity_by_hand import ByHand

from kvexp.app.compose import compose
from kvexp.assets import embedded
from kvexp.backends.llamacpp import CELL_PAD
from kvexp.backends.pool import ServerPool
from kvexp.measure.runner import run_job
from kvexp.results.validate import check_file
from kvexp.capacity import modelinfo
from kvexp.capacity.planner import plan_job
from kvexp import backends
from kvexp.core.config import ModelConfig

# `llama_kv_cache: size =   48.00 MiB (  8192 cells,   3 layers,  2/2 seqs), ...`
SIZE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\)")
MIB = 1 << 20


@pytest.fixture(scope="module")
def gemma3() -> Path:
    m = embedded.GEMMA3_270M
    if not m.gguf.is_file():
        missing("Gemma 3 270M", "run `python -m kvexp install gemma3`")
    return m.gguf


def _launch_log(server: Path, gguf: Path, ctx: int, slots: int, tmp: Path) -> str:
    """llama-server's startup log at -lv 4, up to its two KV cache size lines (it is stopped then)."""
    log = tmp / f"server-{ctx}-{slots}.log"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx),
                                 "-np", str(slots), "-t", "1", "-ctk", "f16", "-ctv", "f16", "-fa", "on", "-lv", "4"],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            for _ in range(600):  # the KV lines come before the model is loaded: at most 60 s
                text = log.read_text(errors="replace")
                if "creating     SWA KV cache" in text and len(SIZE.findall(text)) >= 2 or proc.poll() is not None:
                    break
                time.sleep(0.1)
        finally:
            proc.kill()
            proc.wait()
    return log.read_text(errors="replace")


@pytest.mark.parametrize("per_seq", [4096, 16384])
@pytest.mark.parametrize("slots", [1, 4])
def test_planner_kv_bytes_equal_llama_servers_two_caches(llama_server, gemma3, tmp_path, per_seq, slots):
    text = _launch_log(llama_server, gemma3, per_seq * slots, slots, tmp_path)
    sizes = SIZE.findall(text)
    assert "creating non-SWA KV cache" in text and len(sizes) == 2, text[-2000:]
    (full_mib, full_cells, full_layers, _, streams), (swa_mib, swa_cells, swa_layers, _, _) = sizes
    assert (int(full_layers), int(swa_layers), int(streams)) == (3, 15, slots)
    served = sum(float(x) for x in (full_mib, swa_mib))
    arch = modelinfo.arch_from(ModelConfig(name="gemma3-270m"), gemma3)
    cache = backends.REGISTRY["llamacpp"].cache_model
    plan = plan_job(arch, "f16", cache, None, prompt_tokens=128, max_tokens=64, levels=[1],
                    context=per_seq * slots, parallel=slots)
    assert plan["capacity_tokens"] == int(full_cells) * slots
    assert plan["window_tokens"] == int(swa_cells) * slots
    assert abs(plan["kv_cache_bytes"] / MIB - served) <= 0.01 * 2  # each size is printed to 0.01 MiB
    assert int(swa_cells) == -(-min(per_seq, 512 + 512) // CELL_PAD) * CELL_PAD


# --- a kvexp job on Gemma 3: its KV memory against the server's, its timings against the server's --------

def _job(tmp: Path, *overrides: str) -> dict:
    pool = ServerPool()
    try:
        res = run_job(compose(["model=gemma3-270m", *overrides]), tmp, pool=pool).to_json()
    finally:
        pool.release()
    assert check_file(tmp / "result.json") == []
    return res


@pytest.mark.llamacpp
def test_a_gemma3_job_records_both_caches_and_the_planner_agrees(llama_server, gemma3, tmp_path):
    res = _job(tmp_path, f"backend.binary={llama_server}", "kv=q8_0", "scenario=cpu", "scenario.concurrency=[1,2]",
               "scenario.requests=6", "scenario.max_tokens=32", "backend.context=8192", "backend.parallel=2")
    assert res["status"] == "complete" and all(lv["errors"] == 0 for lv in res["levels"])
    kv, plan = res["kv_cache"], res["planner"]
    assert kv["dtype"] == "q8_0" and kv["capacity_tokens"] == 8192 and kv["window_tokens"] == 2 * 1024
    assert plan["sliding_window"] == 512 and plan["window_tokens"] == kv["window_tokens"]
    assert kv["bytes"] == plan["kv_cache_bytes"]  # exact: cells x layers x 272 bytes of q8_0 a row
    compared = 0
    for lv in res["levels"]:
        server = lv["server"]
        assert server["requests"] == lv["requests"]
        if lv["delivery"]["bursts"]:  # tokens read together: the client cannot time them one by one
            continue
        assert lv["tpot_p50_ms"] == pytest.approx(server["tpot_p50_ms"], rel=0.03)
        compared += 1
    print(f"\nGemma 3 TPOT compared with llama-server's own timings at {compared} of {len(res['levels'])} levels")


@pytest.mark.llamacpp
def test_gemma3_q4_0_drift_equals_llama_perplexity_run_by_hand(llama_server, gemma3, tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXP_QUALITY_CACHE", str(tmp_path / "qcache"))
    res = _job(tmp_path / "job", f"backend.binary={llama_server}", "kv=q4_0", "scenario=quality",
               "quality.depths=[512]", "quality.prompts=1")
    (d,) = res["quality"]["teacher_forced"]["depths"]
    hand = ByHand(llama_server, gemma3, tmp_path / "hand.kld").kld("q4_0")
    print(f"\nGemma 3 q4_0 at 512: KLD kvexp {d['kld_mean']} vs by hand {hand}")
    assert d["kld_mean"] == pytest.approx(hand, abs=1e-6) and hand > 0.01
