"""The planner's memory on the CPU (kvexp/capacity/cpumemory.py): the resident set of the server's
processes, the figure kvexp measures there, rather than a GPU's overhead. Its parts on numbers, the
buffers as llama-server's own log states them, the GPU prediction untouched; and on the real llama-server
each level's prediction against the RSS measured in the same run (test_cpu_memory_real.py)."""

from __future__ import annotations


import pytest
from conftest import FIXTURES, TINY

from kvexp.app.compose import compose
from kvexp.backends import create
from kvexp.backends import llamacpp
from kvexp.backends.llamacpp import cache_ram_bytes, logged_buffers
from kvexp.capacity import cpumemory
from kvexp.capacity.cpumemory import CpuMemoryModel
from kvexp.planning import prediction
from kvexp.planning.memory import job_memory_check, memory_check, parts_words
from kvexp.results.blocks import Plan
from kvexp.results.documents import JobResult

MIB = 1 << 20
FIX = FIXTURES / "llamacpp"


def test_every_request_is_saved_but_those_still_in_a_slot():
    idle = CpuMemoryModel("x", 0, "s", 8192 * MIB, saves_idle_slots=True)
    own = CpuMemoryModel("x", 0, "s", 8192 * MIB, saves_idle_slots=False)
    # 2 warm-up + 20 requests one at a time on 4 slots: only the last is still in its slot
    assert cpumemory.saved_prompts(idle, 22, 4, 1) == 21
    assert cpumemory.saved_prompts(idle, 42, 4, 4) == 38
    assert cpumemory.saved_prompts(idle, 42, 4, 16) == 38  # more streams than slots: 4 in slots
    assert cpumemory.saved_prompts(own, 22, 4, 1) == 18  # each slot keeps its last
    assert cpumemory.saved_prompts(idle, 1, 4, 1) == 0


def test_the_rss_is_the_sum_of_its_parts_and_the_prompt_cache_is_capped():
    model = CpuMemoryModel("x", 30 * MIB, "calibrated", 100 * MIB, "limit")
    out = cpumemory.predict_rss(model, vocab=None, merges=None, weights_bytes=90 * MIB, kv_cache_bytes=20 * MIB,
                                slots=2,
                                levels=[(9, 1), (17, 2), (1000, 2)], request_state_bytes=MIB,
                                buffers=cpumemory.ServerBuffers(MIB, 3 * MIB, None, "log"))
    assert out["levels_rss_gib"] == [round((30 + 90 + 4 + 20 + 8) / 1024, 6), round((30 + 90 + 4 + 20 + 15) / 1024, 6),
                                     round((30 + 90 + 4 + 20 + 100) / 1024, 6)]
    assert out["predicted_peak_rss_gib"] == out["levels_rss_gib"][-1] and out["prompt_cache_bytes"] == 100 * MIB
    assert out["sources"]["buffers_bytes"].startswith("log;")
    unknown = cpumemory.predict_rss(CpuMemoryModel("x", 0, "s", logs_buffers=True), vocab=None, merges=None,
                                    weights_bytes=None,
                                    kv_cache_bytes=MIB, slots=1, levels=[(3, 1)], request_state_bytes=None)
    assert unknown["predicted_peak_rss_gib"] is None and unknown["prompt_cache_bytes"] is None
    assert "floor" in unknown["sources"]["buffers_bytes"]


def test_the_runtime_grows_with_the_tokenizer_and_the_slots():
    model = CpuMemoryModel("x", 10 * MIB, "s", runtime_per_vocab_bytes=300, runtime_per_merge_bytes=150,
                           runtime_per_slot_bytes=MIB)
    assert cpumemory.runtime_bytes(model, 1000, 900, 4) == 10 * MIB + 300_000 + 135_000 + 4 * MIB
    assert cpumemory.runtime_bytes(model, 1000, None, 1) == 10 * MIB + 300_000 + MIB  # no BPE merges
    assert cpumemory.runtime_bytes(model, None, None, 4) is None  # it depends on a vocabulary not known
    assert cpumemory.runtime_bytes(CpuMemoryModel("y", 5, "s"), None, None, 2) == 5


def test_a_windowed_models_state_keeps_at_most_a_window_in_its_sliding_layers():
    assert cpumemory.state_bytes(100, 10.0, 5.0, 512) == 100 * 15
    assert cpumemory.state_bytes(1000, 10.0, 5.0, 512) == 1000 * 10 + 512 * 5


def test_the_buffers_are_read_from_llama_servers_own_log():
    text = (FIX / "server-log-lv4-sample.txt").read_text()
    b = logged_buffers(text)
    got, words = b.fixed_bytes + b.compute_bytes, b.source  # type: ignore[union-attr]
    # AMX 0.16 MiB of repacked weights, output 0.00, compute 1.51; the CPU_Mapped model buffer is the file
    assert got == round((0.16 + 0.00 + 1.51) * MIB)
    assert "CPU_Mapped" not in words and "AMX model 0.16 MiB" in words and "CPU compute 1.51 MiB" in words
    assert logged_buffers("no such lines") is None


def test_the_prompt_cache_limit_is_the_launch_flag_or_llama_servers_default():
    assert cache_ram_bytes(["-m", "x"]) == (8192 * MIB, "llama-server's default --cache-ram 8192 MiB")
    assert cache_ram_bytes(["--cache-ram", "0"])[0] == 0
    assert cache_ram_bytes(["-cram", "512"])[0] == 512 * MIB
    assert cache_ram_bytes(["--cache-ram", "-1"])[0] > 1 << 50  # no limit


def _plan(*overrides: str, gpu_gib=None):
    cfg = compose([*TINY, *overrides])
    spec = create(cfg).spec  # the tiny GGUF located: its vocabulary sizes the runtime
    return spec, prediction.predict(cfg, spec, gpu_gib=gpu_gib)


def test_on_the_cpu_the_plan_predicts_the_rss_level_by_level(llama_server, tiny_gguf):
    spec, p = _plan("kv=fp16")
    if spec.cpu_memory is None:
        pytest.skip("hardware: llama-server offloads to a GPU here")
    cpu = p["cpu_memory"]
    assert p["memory_measure"] == "rss" and p["predicted_peak_memory_gib"] == cpu["predicted_peak_rss_gib"]
    vocab = 356  # the tiny model's tokenizer.ggml.tokens (no merges)
    assert cpu["runtime_bytes"] == round(llamacpp.RUNTIME_BASE_BYTES + llamacpp.RUNTIME_PER_VOCAB_BYTES * vocab
                                         + 2 * llamacpp.RUNTIME_PER_SLOT_BYTES)  # smoke: 2 slots
    assert cpu["requests_done"] == [1 + 8, 1 + 16]  # smoke: warm-up 1, 8 a level
    assert [r["predicted_rss_gib"] for r in p["levels"]] == cpu["levels_rss_gib"]
    assert cpu["levels_rss_gib"][0] < cpu["levels_rss_gib"][1]  # the prompt cache grows with the requests
    assert cpu["request_state_bytes"] == (32 + 16 - 1) * p["kv_bytes_per_token"]
    assert "floor" in cpu["sources"]["buffers_bytes"]  # planned before any server started
    c = memory_check(Plan.from_json(p), [], on_gpu=False)
    assert c.measure == "rss" and "RSS" in c.words and parts_words(c).startswith("runtime ")
    # the KV cache reset between levels launches with --cache-ram 0: no prompt cache
    spec, p = _plan("kv=fp16", "scenario.prefix_tokens=16")
    assert p["cpu_memory"]["prompt_cache_bytes"] == 0


def test_a_gpu_plan_is_unchanged(llama_server, tiny_gguf):
    spec, p = _plan("kv=fp16", gpu_gib=24.0)
    assert "cpu_memory" not in p and p.get("memory_measure") is None
    inp = p["inputs"]
    assert p["predicted_peak_memory_gib"] == pytest.approx(
        inp["weights_gib"] + p["kv_cache_bytes"] / (1 << 30) + inp["overhead_gib"], abs=1e-4)


def test_the_compute_buffer_is_resident_as_far_as_the_largest_batch_reached():
    from kvexp.capacity.cpumemory import ServerBuffers

    b = ServerBuffers(MIB, 16 * MIB, 512, "log")
    assert b.resident(128) == MIB + 4 * MIB and b.resident(2048) == 17 * MIB and b.resident(None) == 17 * MIB
    model = CpuMemoryModel("x", 0, "s")
    out = cpumemory.predict_rss(model, vocab=None, merges=None, weights_bytes=0, kv_cache_bytes=0, slots=4,
                                levels=[(3, 1), (7, 4), (9, 1)],
                                request_state_bytes=None, buffers=b, prompt_tokens=128)
    # one stream: a 128-token batch; four: 512, the whole buffer, which stays resident at the next level
    assert [round(v * 1024, 2) for v in out["levels_rss_gib"]] == [5.0, 17.0, 17.0]


def test_a_cpu_run_of_an_earlier_kvexp_is_held_to_its_rss_and_says_it_was_planned_as_on_a_gpu():
    """The real SmolLM2 job of an earlier kvexp (tests/fixtures/decision): planned with a GPU's overhead
    (1.60 GiB), measured 0.15 GiB of RSS: the table compares the two and says why they are so far apart."""
    import json

    doc = json.loads((FIXTURES / "decision" / "fp16" / "result.json").read_text())
    c = job_memory_check(JobResult.from_json(doc))
    assert c is not None and c.measure == "rss" and c.gpu_planned and "planned as on a GPU" in c.words
    assert c.predicted_gib == doc["planner"]["predicted_peak_memory_gib"]
    assert c.measured_gib == max(lv["peak_rss_gib"] for lv in doc["levels"]) and c.error_pct < -85
