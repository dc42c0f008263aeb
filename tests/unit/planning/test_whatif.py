"""What-if for other GPUs: the planner's inputs re-planned for each conf/gpu preset, with the overhead
this machine measured, and `kvexp plan --gpus`."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ROOT

from kvexp import backends
from kvexp.capacity import planner
from kvexp.planning import whatif
from kvexp.results.blocks import PlanInputs

VLLM = backends.REGISTRY["vllm"].cache_model
LLAMACPP = backends.REGISTRY["llamacpp"].cache_model
RTX = whatif.GPUPreset("rtx5070ti", "NVIDIA GeForce RTX 5070 Ti", 15.92)
H100 = whatif.GPUPreset("h100", "NVIDIA H100 80GB HBM3", 79.65)
BPT = 57344  # qwen2.5-7b, fp16: 2 x 28 x 4 x 128 x 2


def _inputs(kv="auto", **kw):
    base = {"backend": "vllm", "model": "qwen2.5-7b", "kv_dtype": kv, "n_layers": 28, "n_kv_heads": 4,
            "head_dim": 128, "params_b": 7.62, "weights_gib": 5.188, "dtype_bytes": None,
            "gpu_memory_utilization": 0.9, "overhead_gib": 1.5, "kv_cache_memory_bytes": None,
            "context_tokens": 4368, "parallel": 48, "prompt_tokens": 4096, "max_tokens": 256, "block_size": 16}
    return PlanInputs.from_json({**base, **kw})


def _table(overhead, gpu="NVIDIA GeForce RTX 5070 Ti", kv="fp16"):
    return {"schema_version": 1, "kind": "kvexp-calibration",
            "entries": [{"backend": "vllm", "gpu": gpu, "kv_dtype": kv, "overhead_gib": overhead, "samples": []}]}


def test_presets_are_read_from_conf_gpu_smallest_first():
    gpus = whatif.gpu_presets()
    keys = [g.key for g in gpus]
    assert set(keys) == {"l4", "l40s", "a100-40gb", "a100-80gb", "h100", "h200", "rtx4090", "rtx5070ti"}
    assert keys[0] == "rtx5070ti" and keys[-1] == "h200"
    assert [g.memory_gib for g in gpus] == sorted(g.memory_gib for g in gpus)
    assert [g.key for g in whatif.parse_gpus("h100,l4", gpus)] == ["h100", "l4"]
    with pytest.raises(ValueError, match="--gpus h300: no such GPU preset"):
        whatif.parse_gpus("h300", gpus)


def test_the_reference_gpu_reproduces_the_reference_capacities():
    fp16 = whatif.what_if(_inputs(), {}, VLLM, RTX)
    fp8 = whatif.what_if(_inputs("fp8"), {}, VLLM, RTX)
    assert fp16["kv_tokens"] == 143040 and fp8["kv_tokens"] == 286096
    # whole 16-token blocks of a 4352-token request, less vLLM's null block
    assert fp16["max_concurrent"] == (143040 // 16 - 1) // (4352 // 16) == 32
    assert fp16["limit"] == "preemption" and fp16["calibrated_kv_tokens"] is None


def test_a_bigger_gpu_gets_the_memory_it_adds_and_the_overhead_measured_elsewhere():
    fitted = planner.overhead_for_capacity(158048, 15.92, 5.188, BPT)  # what vLLM reported on the RTX
    row = whatif.what_if(_inputs(), {}, VLLM, H100, _table(fitted))
    expected = planner.vllm_capacity_tokens(79.65, 5.188, BPT)
    assert row["kv_tokens"] == expected
    assert row["calibrated_from"] == "NVIDIA GeForce RTX 5070 Ti"
    assert row["calibrated_kv_tokens"] == planner.vllm_capacity_tokens(79.65, 5.188, BPT, overhead_gib=fitted)
    assert row["calibrated_kv_tokens"] > row["kv_tokens"]  # the measured overhead is below 1.5 GiB
    # the GPU's own fit wins over another GPU's
    own = whatif.what_if(_inputs(), {}, VLLM, H100, {"entries": _table(fitted)["entries"] + _table(
        1.0, gpu=H100.name)["entries"], "schema_version": 1, "kind": "kvexp-calibration"})
    assert own["calibrated_from"] == H100.name and own["calibrated_overhead_gib"] == 1.0


def test_the_cpu_builds_budget_and_block_size_do_not_travel_to_a_gpu():
    cpu = _inputs(kv_cache_memory_bytes=256 << 20, block_size=128)
    sources = {"kv_cache_memory_bytes": "kvexp's default for the CPU build", "block_size": "vLLM's default (CPU build)"}
    assert whatif.what_if(cpu, sources, VLLM, RTX)["kv_tokens"] == 143040
    user = {"kv_cache_memory_bytes": "backend.kv_cache_memory_bytes", "block_size": "backend.block_size"}
    row = whatif.what_if(cpu, user, VLLM, RTX)
    assert row["kv_tokens"] == (256 << 20) // BPT // 128 * 128


def test_slots_backends_get_the_largest_context_that_fits_in_padded_slots():
    inp = _inputs("q8_0", backend="llamacpp", prompt_tokens=512, max_tokens=256, gpu_memory_utilization=None)
    row = whatif.what_if(inp, {}, LLAMACPP, H100)
    bpt = planner.kv_bytes_per_token(28, 4, 128, 34 / 32)
    cells = planner.max_context_tokens(79.65, 5.188, bpt)
    assert row["kv_tokens"] == cells and row["limit"] == "slots"
    assert row["memory_concurrent"] == cells // 768  # 768 is a multiple of llama-server's 256-cell pad
    odd = whatif.what_if(replace(inp, prompt_tokens=500), {}, LLAMACPP, H100)
    assert odd["memory_concurrent"] == cells // 768  # 756 tokens still take 768 cells
    assert whatif.what_if(replace(inp, weights_gib=None), {}, LLAMACPP, H100)["kv_tokens"] is None


def test_a_paged_server_runs_no_more_sequences_than_its_max_num_seqs():
    """A tiny model on an H200 holds hundreds of thousands of requests in its pool, but vLLM runs at most
    --max-num-seqs at once: the user's value, else vLLM's default for that GPU (not a value kvexp
    derived from one sweep's levels)."""
    tiny = _inputs(n_layers=2, n_kv_heads=2, head_dim=32, weights_gib=0.01, prompt_tokens=64, max_tokens=64,
                   context_tokens=192, parallel=16)
    h200 = whatif.GPUPreset("h200", "NVIDIA H200", 140.4)
    a100 = whatif.GPUPreset("a100-80gb", "NVIDIA A100-SXM4-80GB", 79.15)
    derived = {"parallel": "derived: highest concurrency level"}
    row = whatif.what_if(tiny, derived, VLLM, h200)
    pool = planner.plan_job(whatif._arch(tiny), "auto", VLLM, 140.4, prompt_tokens=64, max_tokens=64,
                            levels=[], context=192)["max_concurrency_before_preemption"]
    assert pool > 100_000
    assert row["max_concurrent"] == row["max_num_seqs"] == 1024 and row["limit"] == "max_num_seqs"
    assert whatif.what_if(tiny, derived, VLLM, a100)["max_concurrent"] == 256  # vLLM: no A100 is "large"
    user = whatif.what_if(tiny, {"parallel": "backend.parallel"}, VLLM, h200)
    assert user["max_concurrent"] == 16 and "--max-num-seqs 16" in whatif.row_cells(user)[9]
    # a pool smaller than the cap still limits by preemption
    assert whatif.what_if(_inputs(), derived, VLLM, RTX)["limit"] == "preemption"


def test_weights_larger_than_the_gpu_do_not_fit():
    row = whatif.what_if(_inputs(weights_gib=30.0), {}, VLLM, RTX)
    assert row["kv_tokens"] == 0 and row["max_concurrent"] == 0 and row["fits"] is False


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "kvexp", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT, env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                                         "KVEXP_CALIBRATION": "/nonexistent/calibration.json"})


def test_plan_gpus_all_answers_for_every_preset():
    p = _plan("model=qwen2.5-7b", "backend=vllm", "kv=fp16,fp8", "scenario=long", "--gpus", "all")
    assert p.returncode == 0, p.stderr
    text = p.stdout.split("What if:", 1)[1]
    rows = [ln.split("|") for ln in text.splitlines() if "| qwen2.5-7b |" in ln]
    assert len(rows) == 16
    rtx = [r for r in rows if r[1].strip() == "NVIDIA GeForce RTX 5070 Ti"]
    assert sorted(r[8].strip() for r in rtx) == ["143,040", "286,096"]
    h200 = [r for r in rows if r[1].strip() == "NVIDIA H200"]
    assert {r[8].strip() for r in h200} == {f"{planner.vllm_capacity_tokens(140.4, 5.188, b):,}"
                                             for b in (BPT, BPT // 2)}


def test_plan_gpu_h200_answers_and_a_bad_gpus_is_one_line():
    p = _plan("gpu=h200")
    assert p.returncode == 0 and "NVIDIA H200 140.4 GiB" in p.stdout
    bad = _plan("--gpus", "h300")
    assert bad.returncode == 1
    assert bad.stderr.strip().startswith("kvexp: --gpus h300: no such GPU preset; allowed values are all, ")


def test_plan_help_names_the_what_if():
    p = _plan("--help")
    assert p.returncode == 0 and "--gpus all|PRESET,..." in p.stdout and "gpu={a100-40gb,a100-80gb," in p.stdout


def test_a_slotted_server_serves_no_more_requests_at_once_than_its_slots():
    """SmolLM2 on an H200: the memory holds 25,269 requests of 192 tokens, but llama-server launched with
    -np 4 (the scenario's highest concurrency, or backend.parallel) serves 4 at once and queues the rest."""
    smol = _inputs("f16", backend="llamacpp", model="smollm2", n_layers=30, n_kv_heads=3, head_dim=64,
                   params_b=0.1345, weights_gib=0.0916, prompt_tokens=128, max_tokens=64, parallel=4,
                   gpu_memory_utilization=None, context_tokens=None)
    h200 = whatif.GPUPreset("h200", "NVIDIA H200", 140.4)
    row = whatif.what_if(smol, {"parallel": "derived: highest concurrency level"}, LLAMACPP, h200)
    assert row["max_concurrent"] == row["slots"] == 4 and row["limit"] == "slots"
    assert row["memory_concurrent"] > 20_000
    assert whatif.row_cells(row)[9] == f"queueing beyond (4 slots; the memory holds {row['memory_concurrent']:,})"
    wide = whatif.what_if(replace(smol, parallel=64), {"parallel": "backend.parallel"}, LLAMACPP, h200)
    assert wide["max_concurrent"] == 64
    small = whatif.GPUPreset("tiny", "a small GPU", 1.7)  # the memory binds before the slots do
    few = whatif.what_if(replace(smol, parallel=100_000), {}, LLAMACPP, small)
    assert few["limit"] == "queueing" and few["max_concurrent"] == few["memory_concurrent"] < 100_000


def test_tensor_parallel_splits_the_weights_and_the_kv_over_the_gpus():
    one = whatif.what_if(_inputs(), {}, VLLM, H100)
    two = whatif.what_if(_inputs(tensor_parallel=2), {}, VLLM, H100)
    # two GPUs: twice the memory, the weights once, an overhead on each
    assert two["kv_tokens"] == planner.vllm_capacity_tokens(2 * 79.65, 5.188, BPT, overhead_gib=3.0)
    assert two["kv_tokens"] > 2 * one["kv_tokens"]
