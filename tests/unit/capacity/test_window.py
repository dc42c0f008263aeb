"""Sliding-window models: the window read from GGUF headers and config.json, the KV memory each server
keeps for it (a fixed window part and a per-token part), and the report's words for it. Every
expected figure here is computed by hand from the model's published numbers and the servers' sources,
not by kvexp's planner."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvexp import backends
from kvexp.backends.llamacpp import parse_kv_log
from kvexp.capacity import modelinfo
from kvexp.capacity.planner import ModelArch, plan_job
from kvexp.planning import whatif
from kvexp.report.summary import kv_per_token_words
from kvexp.results.blocks import Plan, PlanInputs

LLAMACPP = backends.REGISTRY["llamacpp"].cache_model
MIB = 1 << 20

# Gemma 3 270M as its GGUF header states it (gemma-3-270m-q4_k_m.gguf)
GEMMA3_270M_META = {"general.architecture": "gemma3", "gemma3.block_count": 18, "gemma3.attention.head_count": 4,
                    "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256,
                    "gemma3.attention.value_length": 256, "gemma3.attention.sliding_window": 512,
                    "gemma3.context_length": 32768, "gemma3.embedding_length": 640}
GEMMA3_270M = ModelArch(18, 1, 256, 0.268, 0.236, name="gemma3-270m", sliding_window=512, sliding_layers=15)


def test_the_gguf_header_gives_gemma3_its_window_and_llama_cpps_layer_pattern():
    values, sources = modelinfo.gguf_fields(GEMMA3_270M_META)
    # llama.cpp (src/models/gemma3.cpp: load_swa_pattern(ml, 6)): layers 5, 11 and 17 are global
    assert (values["sliding_window"], values["sliding_layers"]) == (512, 15)
    assert "1 global in 6" in sources["sliding_layers"]
    per_layer = {**GEMMA3_270M_META, "gemma3.attention.sliding_window_pattern": [True, False] * 9}
    assert modelinfo.gguf_fields(per_layer)[0]["sliding_layers"] == 9
    plain = {k.replace("gemma3", "llama"): v for k, v in GEMMA3_270M_META.items()
             if "sliding" not in k} | {"general.architecture": "llama"}
    assert "sliding_window" not in modelinfo.gguf_fields(plain)[0]


@pytest.mark.parametrize("cfg, window, sliding", [
    ({"num_hidden_layers": 62, "sliding_window": 1024, "sliding_window_pattern": 6}, 1024, 52),  # Gemma 3 27B
    ({"num_hidden_layers": 18, "sliding_window": 512,
      "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3}, 512, 15),
    ({"num_hidden_layers": 24, "sliding_window": 128,
      "layer_types": ["sliding_attention", "full_attention"] * 12}, 128, 12),  # gpt-oss
    ({"num_hidden_layers": 32, "sliding_window": 4096}, 4096, 32),  # Mistral 7B v0.1: every layer
    ({"num_hidden_layers": 28, "sliding_window": 131072, "use_sliding_window": False}, None, None),  # Qwen2.5
    ({"num_hidden_layers": 32, "sliding_window": None}, None, None),  # Mistral v0.3
])
def test_config_json_windows(cfg, window, sliding):
    values, _ = modelinfo.hf_config_fields({"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128, **cfg})
    assert (values.get("sliding_window"), values.get("sliding_layers")) == (window, sliding)


def _iswa_bytes(cells_per_seq: int, seqs: int, k_bytes: float = 2.0) -> int:
    """llama.cpp's two caches for Gemma 3 270M, by hand: 3 global layers keep every cell, 15 sliding
    layers keep pad256(min(cells, 512 + n_ubatch 512)) cells, per sequence (1 KV head of 256, K and V)."""
    swa = -(-min(cells_per_seq, 512 + 512) // 256) * 256
    return round(seqs * (cells_per_seq * 3 + swa * 15) * 256 * 2 * k_bytes)


@pytest.mark.parametrize("per_seq", [4096, 16384])
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_llamacpp_iswa_cache_is_the_window_plus_the_global_layers(per_seq, slots):
    p = plan_job(GEMMA3_270M, "f16", LLAMACPP, None, prompt_tokens=128, max_tokens=64, levels=[1],
                 context=per_seq * slots, parallel=slots)
    assert p["kv_cache_bytes"] == _iswa_bytes(per_seq, slots)
    assert p["kv_bytes_per_token"] == 3 * 256 * 2 * 2 and p["kv_window_bytes_per_token"] == 15 * 256 * 2 * 2
    assert (p["capacity_tokens"], p["window_tokens"]) == (per_seq * slots, 1024 * slots)


def test_the_issue_launch_is_78_mib_where_every_layer_global_would_be_288():
    p = plan_job(GEMMA3_270M, "f16", LLAMACPP, None, prompt_tokens=128, max_tokens=64, levels=[1],
                 context=16384, parallel=2)
    assert p["kv_cache_bytes"] == 78 * MIB
    flat = plan_job(ModelArch(18, 1, 256, 0.268, 0.236), "f16", LLAMACPP, None, prompt_tokens=128,
                    max_tokens=64, levels=[1], context=16384, parallel=2)
    assert flat["kv_cache_bytes"] == 288 * MIB and flat["window_tokens"] is None
    q8 = plan_job(GEMMA3_270M, "q8_0", LLAMACPP, None, prompt_tokens=128, max_tokens=64, levels=[1],
                  context=16384, parallel=2)
    assert q8["kv_cache_bytes"] == _iswa_bytes(8192, 2, 34 / 32)


def test_a_unified_stream_holds_one_window_per_sequence():
    p = plan_job(GEMMA3_270M, "f16", LLAMACPP, None, prompt_tokens=128, max_tokens=64, levels=[1],
                 context=16384, parallel=4, unified_kv=True)
    # one stream of 16,384 cells; its window: 512 x 4 sequences + 512, padded to 256
    assert p["window_tokens"] == 2560
    assert p["kv_cache_bytes"] == 16384 * 3072 + 2560 * 15360


def test_a_short_context_keeps_every_layer_in_full():
    p = plan_job(GEMMA3_270M, "f16", LLAMACPP, None, prompt_tokens=128, max_tokens=64, levels=[1],
                 context=512, parallel=2)  # 256 cells a sequence: the window is not reached
    assert p["window_tokens"] == 512 and p["kv_cache_bytes"] == 512 * 18 * 256 * 2 * 2


def test_gemma3_27b_what_if_by_hand():
    """Gemma 3 27B (config.json: 62 layers, 16 KV heads of 128, window 1,024, 1 global layer in 6: 10
    global, 52 sliding), f16 KV, llama.cpp, one 4,096 + 256-token request a slot, on an H100 preset."""
    inputs = PlanInputs(model="gemma3-27b", backend="llamacpp", kv_dtype="f16", n_layers=62, n_kv_heads=16,
                        head_dim=128, params_b=27.0, weights_gib=50.0, sliding_layers=52,
                        model_sliding_window=1024, prompt_tokens=4096, max_tokens=256, parallel=48)
    h100 = whatif.GPUPreset("h100", "NVIDIA H100 80GB HBM3", 79.65)
    row = whatif.what_if(inputs, {}, LLAMACPP, h100)
    cells = 4352  # 4,096 + 256 tokens, a multiple of 256 already
    global_bytes = cells * 2 * 10 * 16 * 128 * 2
    window_bytes = 1536 * 2 * 52 * 16 * 128 * 2  # pad256(min(4,352, 1,024 + 512))
    free = (79.65 - 50.0 - 1.5) * 2**30
    assert row["memory_concurrent"] == row["max_concurrent"] == int(free // (global_bytes + window_bytes)) == 29
    flat = whatif.what_if(replace(inputs, sliding_layers=None, model_sliding_window=None), {}, LLAMACPP, h100)
    assert flat["max_concurrent"] == int(free // (cells * 2 * 62 * 16 * 128 * 2)) == 13


ISWA_LOG = """\
llama_kv_cache_iswa: creating non-SWA KV cache, size = 8192 cells
llama_kv_cache:        CPU KV buffer size =    48.00 MiB
llama_kv_cache: size =   48.00 MiB (  8192 cells,   3 layers,  2/2 seqs), K (f16):   24.00 MiB, V (f16):   24.00 MiB
llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells
llama_kv_cache:        CPU KV buffer size =    30.00 MiB
llama_kv_cache: size =   30.00 MiB (  1024 cells,  15 layers,  2/2 seqs), K (f16):   15.00 MiB, V (f16):   15.00 MiB
"""


def test_llamacpp_log_of_two_caches_is_read_whole():
    info = parse_kv_log(ISWA_LOG)
    assert info is not None
    assert (info.capacity_tokens, info.window_tokens, info.bytes) == (16384, 2048, 78 * MIB)
    assert info.dtype == "f16"


def test_the_plan_names_both_parts():
    p = plan_job(GEMMA3_270M, "f16", LLAMACPP, None, prompt_tokens=128, max_tokens=64, levels=[1],
                 context=16384, parallel=2)
    assert kv_per_token_words(Plan.from_json(p)) == "3,072 + 15.00 MiB window/seq"  # 1,024 cells x 15 layers x 1,024 bytes
    plain = plan_job(ModelArch(30, 3, 64, 0.13, 0.09), "f16", LLAMACPP, None, prompt_tokens=128, max_tokens=64,
                     levels=[1], context=512, parallel=2)
    assert kv_per_token_words(Plan.from_json(plain)) == "23,040"


def test_vllm_hybrid_pool_by_hand():
    """vLLM 0.32 (vllm/v1/core/kv_cache_utils.py): Gemma 3 270M's 3 global and 15 sliding layers make 6
    groups of 3 layers sharing one pool; a block holds 128 tokens of 3 layers (3 x 128 x 2 x 256 x 2 bytes),
    so a 256 MiB budget is 682 blocks, as the CPU server's cache_config_info says (num_gpu_blocks 682)."""
    vllm = backends.REGISTRY["vllm"].cache_model
    p = plan_job(GEMMA3_270M, "float16", vllm, None, prompt_tokens=128, max_tokens=64, levels=[1, 64],
                 context=208, block_size=128, kv_cache_memory_bytes=256 << 20)
    assert p["blocks"] == (256 << 20) // (3 * 128 * 2 * 256 * 2) == 682
    assert p["kv_cache_bytes"] == 682 * 3 * 128 * 2 * 256 * 2
    # one 192-token request: 2 blocks in the global group and in each of the 5 sliding groups (its window
    # of 511 tokens + 1 would take 5); one null block is no request's
    assert p["max_concurrency_before_preemption"] == 681 // (2 + 5 * 2) == 56
    assert [lv["predicts_preemption"] for lv in p["levels"]] == [False, True]
    long = plan_job(GEMMA3_270M, "float16", vllm, None, prompt_tokens=4000, max_tokens=96, levels=[1],
                    context=4096, block_size=128, kv_cache_memory_bytes=256 << 20)
    assert long["max_concurrency_before_preemption"] == 681 // (32 + 5 * 5) == 11
    assert long["kv_window_bytes_per_sequence"] == 5 * 128 * 15 * 256 * 2 * 2


def test_ollamas_engine_states_its_kv_type_in_the_runners_load_request():
    from kvexp.backends.ollamacache import parse_server_log, window_cells as ollama_window

    log = ('time=2026-12-07T12:00:00.000Z level=INFO source=runner.go:1297 msg=load request="{Operation:commit '
           'LoraPath:[] Parallel:2 BatchSize:512 FlashAttention:Enabled KvSize:8192 KvCacheType:q8_0 NumThreads:1 '
           'GPULayers:[] MultiUserCache:false ProjectorPath: MainGPU:0 UseMmap:false}"\n'
           'time=2026-12-07T12:00:01.000Z level=INFO source=device.go:245 msg="kv cache" device=CPU size="26.7 MiB"\n')
    info = parse_server_log(log, "q8_0")
    assert (info.dtype, info.capacity_tokens, info.seqs, info.bytes) == ("q8_0", 8192, 2, round(26.7 * MIB))
    f16 = parse_server_log(log.replace("KvCacheType:q8_0", "KvCacheType:"), "f16")
    assert f16.dtype == "f16"
    # kvcache/causal.go: 2 slots keep 513 cells each + a 512 batch, padded to 256; a short context keeps it all
    assert ollama_window(512, 4096, 2, False) == 1792 and ollama_window(512, 384, 2, False) == 768
    assert ollama_window(512, 4096, 1, False) == 1024


def test_the_verdict_says_what_a_windowed_models_bytes_per_token_are_made_of():
    from kvexp.analysis.verdict import _window_words
    from kvexp.results.runs import Run

    run = Run(planner=Plan(sliding_window=512, kv_bytes_per_token=1632, kv_window_bytes_per_sequence=8355840))
    assert _window_words(run) == (" it holds (a sliding-window model: 1,632 bytes per token in its global layers "
                                  "+ 7.97 MiB of window a sequence)")
    assert _window_words(Run(planner=Plan(kv_bytes_per_token=23040))) == ""


@pytest.mark.parametrize("ctx, slots, mib", [(384, 4, 27.0), (384, 2, 13.5), (4096, 2, 24 + 26.25), (4096, 1, 27)])
def test_ollamas_own_engine_sizes_gemma3_as_its_log_says(ctx, slots, mib):
    """Ollama 0.24.0 runs gemma3 on its own engine: one causal cache of ctx x slots cells for the 3 global
    layers and an SWA cache for the 15 sliding ones (kvcache/causal.go), 1,024 bytes a cell a layer in
    f16; its log said size="27.0 MiB" at OLLAMA_CONTEXT_LENGTH=384 with 4 slots."""
    from kvexp.backends.ollamacache import ENGINE_CACHE

    p = plan_job(GEMMA3_270M, "f16", ENGINE_CACHE, None, prompt_tokens=128, max_tokens=64, levels=[1],
                 context=ctx, parallel=slots)
    assert p["kv_cache_bytes"] == mib * MIB
