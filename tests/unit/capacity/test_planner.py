"""The planner against the reference document (tests/fixtures/planner/rtx5070ti-qwen2.5-7b.json,
a results document from an earlier tool) and against llama.cpp / vLLM startup captures."""

from __future__ import annotations

import json
import math
import re

import conftest
import pytest
from conftest import ROOT

from kvexp.capacity import planner
from kvexp import backends
from kvexp.planning import prediction
from kvexp.report import summary
from kvexp.backends.llamacpp import LlamaCppConfig
from kvexp.backends.ollama import OllamaConfig
from kvexp.backends.ollamacache import default_context_tokens
from kvexp.backends.vllm import VLLMConfig
from kvexp.core.config import ExperimentConfig, GPUConfig, KVConfig, ModelConfig, ScenarioConfig
from kvexp.capacity.planner import ModelArch, plan_job

VLLM = backends.REGISTRY["vllm"].cache_model
LLAMACPP = backends.REGISTRY["llamacpp"].cache_model
OLLAMA = backends.REGISTRY["ollama"].cache_model

FIXTURES = conftest.FIXTURES / "planner"
REF = json.loads((FIXTURES / "rtx5070ti-qwen2.5-7b.json").read_text())
AWQ_WEIGHTS_GIB = 5.188  # the reference's size of Qwen2.5-7B-Instruct-AWQ
QWEN7 = ModelArch.from_preset("qwen2.5-7b", AWQ_WEIGHTS_GIB)
# vLLM's own capacity in the reference runs: kv_cache.blocks x block_size
ENGINE_TOKENS = {"auto": 9878 * 16, "fp8": 17019 * 16}


def test_defaults_are_the_reference_planner_block():
    assert planner.reference_planner_block() == REF["planner"]
    assert planner.GIB_BYTES == 2**30


@pytest.mark.parametrize("dtype,expected", [
    ("fp16", 2), ("f16", 2), ("bf16", 2), ("auto", 2), ("fp8", 1), ("f32", 4),
    ("q8_0", 34 / 32), ("q4_0", 18 / 32), ("FP8", 1),
])
def test_kv_bytes_per_element(dtype, expected):
    assert planner.kv_bytes_per_element(dtype) == expected


def test_auto_follows_the_model_dtype_and_unknown_dtypes_fail():
    assert planner.kv_bytes_per_element("auto", dtype_bytes=4) == 4
    assert planner.canonical_kv_dtype("auto") == "fp16"
    assert planner.canonical_kv_dtype("bfloat16") == "fp16"
    assert planner.canonical_kv_dtype("fp8_e5m2") == "fp8"
    with pytest.raises(ValueError, match="q3_x"):
        planner.kv_bytes_per_element("q3_x")


def test_bytes_per_token_qwen25_7b():
    # 2 x 28 layers x 4 KV heads x 128 x 2 bytes
    assert planner.kv_bytes_per_token(28, 4, 128, 2) == 57344
    assert planner.kv_bytes_per_token(28, 4, 128, 34 / 32) == 30464
    assert planner.kv_bytes_per_token(None, 4, 128, 2) is None


def test_the_two_reference_predictions_exactly():
    # (15.92 x 0.9 - 5.188 - 1.5) GiB = 7.64 GiB -> 143054 tokens -> 8940 blocks of 16
    fp16 = plan_job(QWEN7, "auto", VLLM, 15.92, prompt_tokens=512, max_tokens=256, levels=[1])
    fp8 = plan_job(QWEN7, "fp8", VLLM, 15.92, prompt_tokens=512, max_tokens=256, levels=[1])
    assert (fp16["capacity_tokens"], fp16["blocks"]) == (143040, 8940)
    assert (fp8["capacity_tokens"], fp8["blocks"]) == (286096, 17881)
    rows = {r["kv_cache_dtype"]: r["predicted_tokens"] for r in REF["calibration"]}
    assert rows == {"auto": 143040, "fp8": 286096}


def _vllm_runs():
    return [r for r in REF["runs"] if r["backend"] == "vllm"]


@pytest.mark.parametrize("run", _vllm_runs(), ids=lambda r: r["label"])
def test_preemption_facts_follow_from_the_planners_own_capacity(run):
    dtype = run["kv_cache"]["dtype"]
    levels = [lv["concurrency"] for lv in run["levels"]]
    plan = plan_job(QWEN7, dtype, VLLM, run["gpu_gib"], prompt_tokens=run["prompt_tokens"],
                    max_tokens=run["max_tokens"], levels=levels)
    for predicted, measured in zip(plan["levels"], run["levels"]):
        assert predicted["predicts_preemption"] == (measured["preemptions"] > 0), measured
    # ...and from the engine's own capacity: the facts do not need calibration
    per_request_blocks = planner.blocks_per_request(run["prompt_tokens"] + run["max_tokens"], 16)
    engine_max = ENGINE_TOKENS[dtype] // 16 // per_request_blocks
    for measured in run["levels"]:
        assert (measured["concurrency"] > engine_max) == (measured["preemptions"] > 0)


def test_preemption_thresholds_long_scenario():
    # 4096 + 256 = 4352 tokens = 272 blocks per request
    fp16 = plan_job(QWEN7, "auto", VLLM, 15.92, prompt_tokens=4096, max_tokens=256, levels=[32, 48])
    fp8 = plan_job(QWEN7, "fp8", VLLM, 15.92, prompt_tokens=4096, max_tokens=256, levels=[32, 48])
    assert fp16["max_concurrency_before_preemption"] == 8940 // 272 == 32
    assert fp8["max_concurrency_before_preemption"] == 17881 // 272 == 65
    assert [lv["predicts_preemption"] for lv in fp16["levels"]] == [False, True]
    assert [lv["predicts_preemption"] for lv in fp8["levels"]] == [False, False]
    # engine capacity: 9878 // 272 = 36 and 17019 // 272 = 62, on the same side of 32 and 48
    assert planner.max_concurrency(ENGINE_TOKENS["auto"], 4352, 16) == 36
    assert planner.max_concurrency(ENGINE_TOKENS["fp8"], 4352, 16) == 62
    # predicted usage: 48 x 272 blocks exceed the pool (measured 1.0); fp8 at 48: 13056/17880. vLLM's
    # gauge is used / (blocks - 1): one block of the pool is its null block (block_pool.get_usage)
    assert fp16["levels"][1]["predicted_kv_usage"] == 1.0
    assert fp8["levels"][1]["predicted_kv_usage"] == round(13056 / 17880, 4)
    assert fp16["levels"][0]["predicted_kv_usage"] == round(32 * 272 / 8939, 4)


def test_block_granularity_rounds_a_request_up_to_whole_blocks():
    # 100 + 20 = 120 tokens -> 8 blocks of 16 (128 tokens); a 1600-token pool holds 12, not 13
    assert planner.max_concurrency(1600, 120, 16) == 12
    assert planner.max_concurrency(1600, 120) == 13
    assert planner.kv_usage(12, 1600, 120, 16) == 96 / 100


def test_calibrated_block_uses_the_fitted_overhead():
    plan = plan_job(QWEN7, "auto", VLLM, 15.92, prompt_tokens=4096, max_tokens=256, levels=[32, 48],
                    calibrated_overhead_gib=0.7)
    cal = plan["calibrated"]
    # (14.328 - 5.188 - 0.7) GiB / 57344 = 158061.7 -> 158048 - 16 (0.7 is a bit above the fit)
    assert cal["capacity_tokens"] == 158032 and cal["blocks"] == 9877
    assert cal["max_concurrency_before_preemption"] == 36
    assert [lv["predicts_preemption"] for lv in cal["levels"]] == [False, True]
    assert plan_job(QWEN7, "auto", VLLM, 15.92, prompt_tokens=1, max_tokens=1, levels=[])["calibrated"] is None


def test_vllm_unknown_gpu_gives_nulls_and_the_block_is_json_ready():
    plan = plan_job(QWEN7, "auto", VLLM, None, prompt_tokens=512, max_tokens=256, levels=[1, 4])
    assert plan["capacity_tokens"] is None and plan["blocks"] is None
    assert plan["max_concurrency_before_preemption"] is None
    assert plan["levels"] == [
        {"concurrency": 1, "predicted_kv_usage": None, "predicts_preemption": None, "predicts_queueing": None},
        {"concurrency": 4, "predicted_kv_usage": None, "predicts_preemption": None, "predicts_queueing": None},
    ]
    assert json.loads(json.dumps(plan, allow_nan=False)) == plan


def test_planner_block_keys_are_stable():
    plan = plan_job(QWEN7, "fp8", VLLM, 15.92, prompt_tokens=512, max_tokens=256, levels=[1],
                    calibrated_overhead_gib=1.0)
    assert list(plan) == [
        "kv_bytes_per_element", "kv_bytes_per_token", "kv_window_bytes_per_token",
        "kv_window_bytes_per_sequence", "sliding_window",
        "capacity_tokens", "blocks", "block_size", "kv_cache_bytes", "window_tokens", "context_per_slot_tokens", "slots", "predicted_peak_memory_gib",
        "max_context_that_fits", "fits", "request_tokens", "request_fits",
        "max_concurrency_before_preemption", "max_concurrent_requests", "levels", "calibrated",
        "inputs", "sources"]
    assert list(plan["calibrated"]) == [
        "overhead_gib", "capacity_tokens", "blocks", "kv_cache_bytes", "predicted_peak_memory_gib",
        "max_context_that_fits", "fits", "max_concurrency_before_preemption", "max_concurrent_requests",
        "levels"]
    assert plan["sources"]["n_layers"] == "preset"
    assert plan["sources"]["overhead_gib"].startswith("default")


def test_vllm_kv_cache_memory_bytes_matches_the_cpu_captures():
    # captures/vllm: tiny Qwen2 (2 layers x 2 KV heads x 32), --kv-cache-memory-bytes 1048576, block 128:
    # "CPU KV cache size: 2,048 tokens" (bf16) and 4,096 (fp8); 1 GiB -> 2097152 tokens, 16384 blocks
    tiny = ModelArch(n_layers=2, n_kv_heads=2, head_dim=32, weights_gib=0.002)
    for dtype, tokens in (("auto", 2048), ("fp8", 4096)):
        plan = plan_job(tiny, dtype, VLLM, None, prompt_tokens=256, max_tokens=256, levels=[4, 16],
                        block_size=128, kv_cache_memory_bytes=1 << 20)
        assert plan["capacity_tokens"] == tokens
    plan = plan_job(tiny, "auto", VLLM, None, prompt_tokens=256, max_tokens=256, levels=[16],
                    block_size=128, kv_cache_memory_bytes=1 << 30)
    assert (plan["capacity_tokens"], plan["blocks"]) == (2097152, 16384)
    # bf16 capture: 1 MiB = 16 blocks, one of them vLLM's null block; 16 requests of 512 tokens (4 blocks
    # each): 15 // 4 = 3 fit (vLLM's own "4.00x" counts the null block), the run preempted
    small = plan_job(tiny, "auto", VLLM, None, prompt_tokens=256, max_tokens=256, levels=[16],
                     block_size=128, kv_cache_memory_bytes=1 << 20)
    assert small["max_concurrency_before_preemption"] == 3
    assert small["levels"][0]["predicts_preemption"] is True


def test_llamacpp_kv_bytes_match_the_server_log_for_every_type():
    # The capture was made with the tiny GGUF (2 layers, 2 KV heads x 32) at -c 4096 -np 4.
    tiny = ModelArch(n_layers=2, n_kv_heads=2, head_dim=32, weights_gib=0.0003)
    line = re.compile(r"^(\w+): size =\s*([\d.]+) MiB \(\s*(\d+) cells,.*?(\d+)/(\d+) seqs")
    checked = 0
    for text in (FIXTURES / "llamacpp_kv_cache_sizes_by_type.txt").read_text().splitlines():
        m = line.match(text)
        if not m:
            continue
        dtype, mib, cells, seqs = m.group(1), float(m.group(2)), int(m.group(3)), int(m.group(4))
        plan = plan_job(tiny, dtype, LLAMACPP, None, prompt_tokens=100, max_tokens=100, levels=[4],
                        context=cells * seqs, parallel=seqs)
        assert round(plan["kv_cache_bytes"] / 2**20, 2) == mib, dtype
        assert plan["context_per_slot_tokens"] == cells
        checked += 1
    assert checked == 9


def test_llamacpp_plan_by_hand():
    # q8_0: 2 x 28 x 4 x 128 x 34/32 = 30464 bytes/token; -c 8192 -np 4 -> 2048 cells per slot
    plan = plan_job(QWEN7, "q8_0", LLAMACPP, 15.92, prompt_tokens=1024, max_tokens=256,
                    levels=[2, 4, 8], context=8192, parallel=4)
    assert plan["capacity_tokens"] == 8192 and plan["blocks"] is None
    assert plan["kv_cache_bytes"] == 8192 * 30464
    assert plan["context_per_slot_tokens"] == 2048
    assert plan["predicted_peak_memory_gib"] == round(5.188 + 8192 * 30464 / 2**30 + 1.5, 4)
    # (15.92 - 5.188 - 1.5) GiB / 30464 bytes
    assert plan["max_context_that_fits"] == math.floor((15.92 - 5.188 - 1.5) * 2**30 / 30464) == 325393
    assert plan["fits"] is True and plan["request_fits"] is True
    assert plan["max_concurrency_before_preemption"] is None  # llama.cpp queues, never preempts
    assert plan["max_concurrent_requests"] == 4
    assert [lv["predicted_kv_usage"] for lv in plan["levels"]] == [
        round(2 * 1280 / 8192, 4), round(4 * 1280 / 8192, 4), round(4 * 1280 / 8192, 4)]
    assert [lv["predicts_queueing"] for lv in plan["levels"]] == [False, False, True]
    assert not any(lv["predicts_preemption"] for lv in plan["levels"])
    # a slot too small for one request
    tight = plan_job(QWEN7, "q8_0", LLAMACPP, 15.92, prompt_tokens=4096, max_tokens=256, levels=[1],
                     context=8192, parallel=4)
    assert tight["request_fits"] is False and tight["max_concurrent_requests"] == 0


def test_ollama_allocates_context_times_parallel():
    plan = plan_job(QWEN7, "q8_0", OLLAMA, 15.92, prompt_tokens=512, max_tokens=256, levels=[1, 4],
                    context=8192, parallel=2)
    assert plan["capacity_tokens"] == 16384 and plan["context_per_slot_tokens"] == 8192
    assert plan["kv_cache_bytes"] == 16384 * 30464
    assert plan["max_context_that_fits"] == 325393 // 2
    assert [lv["predicts_queueing"] for lv in plan["levels"]] == [False, True]
    default = plan_job(QWEN7, "f16", OLLAMA, 15.92, prompt_tokens=512, max_tokens=256, levels=[1])
    assert default["slots"] == 1 and default["capacity_tokens"] == 4096  # Ollama's defaults under 24 GiB
    assert default_context_tokens(140.4) == 262144
    assert default_context_tokens(32.0, 40960) == 32768


def test_fitting_overhead_inverts_the_capacity_formula():
    bpt = 57344
    o = planner.overhead_for_capacity(158048, 15.92, 5.188, bpt)
    assert planner.vllm_capacity_tokens(15.92, 5.188, bpt, overhead_gib=o) == 158048
    assert o == pytest.approx(15.92 * 0.9 - 5.188 - 158056 * bpt / 2**30)


def test_weights_that_do_not_fit_give_zero_capacity():
    big = ModelArch.from_preset("qwen2.5-32b", 61.0)
    plan = plan_job(big, "auto", VLLM, 15.92, prompt_tokens=512, max_tokens=256, levels=[1])
    assert plan["capacity_tokens"] == 0 and plan["fits"] is False
    assert plan["max_concurrency_before_preemption"] == 0
    assert plan["levels"][0]["predicted_kv_usage"] is None


# ---------------------------------------------------------------------------------------------------
# Configs and the table


def _cfg(backend, kv: KVConfig, scenario: ScenarioConfig, model: ModelConfig, gpu: GPUConfig) -> ExperimentConfig:
    return ExperimentConfig(backend=backend, model=model, kv=kv, scenario=scenario, gpu=gpu)


QWEN7_MODEL = ModelConfig(name="qwen2.5-7b", hf="Qwen/Qwen2.5-7B-Instruct-AWQ", n_layers=28, n_kv_heads=4,
                          head_dim=128, params_b=7.62, weights_gib=5.188)
LONG = ScenarioConfig(name="long", prompt_tokens=4096, max_tokens=256, concurrency=[8, 16, 32, 48], requests=144)
FP16 = KVConfig(name="fp16", per_backend={"llamacpp": "f16", "vllm": "auto", "ollama": "f16"})
FP8 = KVConfig(name="fp8", per_backend={"vllm": "fp8"})
RTX = GPUConfig(name="NVIDIA GeForce RTX 5070 Ti", memory_gib=15.92)


def test_llamacpp_cells_match_the_real_server():
    # (-c, -np) -> cells per slot, as llama-server's llama_kv_cache line reported them
    for ctx, np_, cells in ((128, 2, 256), (300, 1, 512), (300, 3, 256), (1000, 4, 256), (4096, 3, 1536)):
        assert planner.cells_per_slot(ctx, np_, 256) == cells


def test_plan_for_config_derives_llamacpp_launch_like_the_adapter():
    cfg = _cfg(LlamaCppConfig(), FP16, LONG, QWEN7_MODEL, RTX)
    spec = backends.create(cfg, locate=False).spec
    assert (spec.context_tokens, spec.slots) == (48 * (4352 + 16), 48)
    plan = prediction.predict(cfg, spec, arch=QWEN7)
    assert plan["capacity_tokens"] == 48 * 4608 and plan["slots"] == 48  # 4368 per slot, padded to 256s
    assert plan["sources"]["context_tokens"].startswith("derived")
    tagged = ModelConfig(**{**QWEN7_MODEL.__dict__, "ollama": "qwen2.5:7b"})
    oll = backends.create(_cfg(OllamaConfig(context=8192, parallel=2), FP16, LONG, tagged, RTX), locate=False).spec
    assert (oll.context_tokens, oll.slots) == (8192, 2)


def test_plan_table_for_the_reference_model_and_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # no local files: the preset is the source
    cfgs = [_cfg(VLLMConfig(), kv, LONG, QWEN7_MODEL, RTX) for kv in (FP16, FP8)]
    table = {"schema_version": 1, "kind": "kvexp-calibration", "entries": [
        {"backend": "vllm", "gpu": "NVIDIA GeForce RTX 5070 Ti", "kv_dtype": "fp16",
         "overhead_gib": planner.overhead_for_capacity(158048, 15.92, 5.188, 57344), "samples": []}]}
    text = summary.plan_table(cfgs, table)
    rows = [ln for ln in text.splitlines() if ln.startswith("| qwen2.5-7b")]
    assert len(rows) == 2
    fp16, fp8 = (r.split("|") for r in rows)
    assert fp16[5].strip() == "57,344" and fp16[6].strip() == "143,040" and fp16[8].strip() == "8,940"
    assert fp16[7].strip() == "7,822.50"  # KV MiB: 143,040 tokens x 57,344 bytes
    assert fp16[9].strip() == "14.33"  # weights + KV pool + overhead = 0.9 x 15.92
    assert fp16[10].strip() == "32" and "48: 100% preempts" in fp16[11] and "32: 97%" in fp16[11]
    assert fp16[13].strip() == "158,048" and fp16[14].strip() == "36"
    assert fp8[6].strip() == "286,096" and fp8[10].strip() == "65" and "preempts" not in fp8[11]
    assert fp8[13].strip() == "-"  # no fit for fp8 in this table


def test_plan_table_shows_unknown_gpu_without_failing(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    q8 = KVConfig(name="q8_0", per_backend={"llamacpp": "q8_0"})
    text = summary.plan_table([_cfg(VLLMConfig(), FP16, LONG, QWEN7_MODEL, GPUConfig()),
                               _cfg(VLLMConfig(), q8, LONG, QWEN7_MODEL, RTX)], None)
    rows = [ln for ln in text.splitlines() if ln.startswith("| qwen2.5-7b")]
    assert "| - |" in rows[0] and "57,344" in rows[0]
    assert "kv=q8_0 is not available on vllm" in rows[1]


# ---------------------------------------------------------------------------------------------------
# conf/ presets


MINE = ["qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen3-8b", "qwen3-14b", "llama-3.1-8b", "mistral-7b"]


@pytest.mark.parametrize("name", MINE)
def test_model_presets_match_the_planner_table(name):
    from omegaconf import OmegaConf

    y = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"))
    assert y["defaults"] == ["model_schema", "_self_"]
    assert y["name"] == name
    p = planner.PRESETS[name]
    assert (y["n_layers"], y["n_kv_heads"], y["head_dim"], y["params_b"]) == (
        p.n_layers, p.n_kv_heads, p.head_dim, p.params_b)
    assert set(y) <= {"defaults", *ModelConfig.__dataclass_fields__}


def test_gpu_presets():
    from omegaconf import OmegaConf

    rtx = OmegaConf.load(ROOT / "conf" / "gpu" / "rtx5070ti.yaml")
    assert (rtx.name, rtx.memory_gib) == ("NVIDIA GeForce RTX 5070 Ti", 15.92) == (REF["gpu"], REF["gpu_gib"])
    h200 = OmegaConf.load(ROOT / "conf" / "gpu" / "h200.yaml")
    assert h200.name == "NVIDIA H200" and h200.memory_gib == round(143771 / 1024, 2)


GPU_PRESETS = {"l4": "NVIDIA L4", "l40s": "NVIDIA L40S", "a100-40gb": "NVIDIA A100-SXM4-40GB",
               "a100-80gb": "NVIDIA A100-SXM4-80GB", "h100": "NVIDIA H100 80GB HBM3",
               "h200": "NVIDIA H200", "rtx4090": "NVIDIA GeForce RTX 4090",
               "rtx5070ti": "NVIDIA GeForce RTX 5070 Ti"}


@pytest.mark.parametrize("preset", sorted(GPU_PRESETS))
def test_every_gpu_preset_states_nvmls_mib_and_converts_it_like_nvml(preset):
    """Each preset's comment quotes NVML's total in MiB; memory_gib is that / 1024 to two places, and
    the name is NVML's own spelling (what calibration entries are keyed by)."""
    import re

    from omegaconf import OmegaConf

    path = ROOT / "conf" / "gpu" / f"{preset}.yaml"
    mib = re.search(r"NVML reports (\d+) MiB", path.read_text().splitlines()[0])
    assert mib, f"{path.name}: first line must state 'NVML reports N MiB' and its source"
    y = OmegaConf.load(path)
    assert y.name == GPU_PRESETS[preset]
    assert y.memory_gib == round(int(mib.group(1)) / 1024, 2)


def test_shared_prefix_blocks_are_held_once_per_group():
    from kvexp.capacity.planner import kv_usage, max_concurrency

    # 10 blocks of 128 tokens; requests of 512 + 32 tokens (5 blocks), 384 of them a shared prefix (3 full
    # blocks): 2 groups hold 6 blocks, each request 2 of its own
    assert max_concurrency(1280, 544, 128) == 2
    assert max_concurrency(1280, 544, 128, 384, 2) == 2  # 2 x 3 + 2 x 2 = 10
    assert max_concurrency(1280, 544, 128, 384, 1) == 3  # 3 + 3 x 2 = 9
    assert kv_usage(2, 1280, 544, 128) == 1.0
    assert kv_usage(2, 1280, 544, 128, 384, 1) == pytest.approx((3 + 2 * 2) / 10)
    assert kv_usage(1, 1280, 544, 128, 384, 4) == pytest.approx(5 / 10)  # one request: its prefix once
    assert kv_usage(2, 1280, 544, 128, 100, 1) == 1.0  # a prefix shorter than a block shares nothing
