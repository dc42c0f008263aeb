"""Calibration rows against the reference document, fitted overheads, and the calibration file."""

from __future__ import annotations

import json

import conftest
import pytest

from kvexp.planning import calibration as calib
from kvexp import backends
from kvexp.capacity.planner import GIB_BYTES, ModelArch, plan_job
from kvexp.results.documents import JobResult
from kvexp.results.runs import Run

VLLM = backends.REGISTRY["vllm"].cache_model
LLAMACPP = backends.REGISTRY["llamacpp"].cache_model

FIXTURES = conftest.FIXTURES / "planner"
REF = json.loads((FIXTURES / "rtx5070ti-qwen2.5-7b.json").read_text())
QWEN7 = ModelArch.from_preset("qwen2.5-7b", 5.188)
ARCHS = {"Qwen/Qwen2.5-7B-Instruct-AWQ": QWEN7}
GPU = "NVIDIA GeForce RTX 5070 Ti"


def _measurements():
    return calib.measurements_from_runs([Run.from_json(r) for r in REF["runs"]], ARCHS)


def test_rows_reproduce_the_reference_calibration():
    rows = calib.calibration_rows(_measurements())
    assert rows == REF["calibration"]
    assert [r["error_pct"] for r in rows] == [-9.5, 5.1]
    assert calib.error_pct(143040, 158048) == -9.5 and calib.error_pct(286096, 272304) == 5.1


def test_measurements_from_reference_runs():
    ms = [m for m in _measurements() if m.backend == "vllm"]
    assert len(ms) == 4
    fp16 = ms[0]
    assert (fp16.kv_dtype, fp16.kv_key, fp16.actual_tokens, fp16.kv_bytes_per_token) == ("auto", "fp16", 158048, 57344)
    assert fp16.gpu_name == GPU and fp16.gpu_gib == 15.92 and fp16.weights_gib == 5.188
    assert fp16.peak_vram_gib == 15.81 and fp16.job_id == "vllm-fp16kv-chat@2026-10-07 13:00 UTC"
    # llama.cpp runs carry no KV facts in the reference: no capacity row, no fit
    lc = [m for m in _measurements() if m.backend == "llamacpp"]
    assert lc == []  # their kv_cache.dtype is null


def test_fit_then_repredict_lands_on_the_measurement():
    table = calib.fit(_measurements())
    entries = {(e["backend"], e["gpu"], e["kv_dtype"]): e for e in table["entries"]}
    assert set(entries) == {("vllm", GPU, "fp16"), ("vllm", GPU, "fp8")}
    assert entries[("vllm", GPU, "fp16")]["jobs"] == 2  # chat and long share one engine setup
    # By hand: 15.92 x 0.9 - 5.188 - (158048 + 8) x 57344 / 2^30 = 0.69885 GiB (mid-block target)
    o16 = calib.lookup_overhead_gib(table, "vllm", GPU, "auto")
    o8 = calib.lookup_overhead_gib(table, "vllm", GPU, "fp8")
    assert o16 == pytest.approx(15.92 * 0.9 - 5.188 - 158056 * 57344 / GIB_BYTES)
    assert o16 == pytest.approx(0.69885, abs=1e-4)
    assert o8 == pytest.approx(15.92 * 0.9 - 5.188 - 272312 * 28672 / GIB_BYTES)
    assert o8 == pytest.approx(1.86845, abs=1e-4)

    report = calib.calibration_report(_measurements(), table)  # one row per measured job
    assert [(r["kv_cache_dtype"], r["error_pct"]) for r in report] == [
        ("auto", -9.5), ("auto", -9.5), ("fp8", 5.1), ("fp8", 5.1)]
    for r in report:
        assert abs(r["calibrated_error_pct"]) <= 2.0
        assert r["calibrated_tokens"] == r["actual_tokens"]
        assert set(calib.REFERENCE_ROW_KEYS) <= set(r)

    for kv, actual in (("auto", 158048), ("fp8", 272304)):
        cal = calib.lookup_overhead_gib(table, "vllm", GPU, kv)
        plan = plan_job(QWEN7, kv, VLLM, 15.92, prompt_tokens=4096, max_tokens=256, levels=[32, 48],
                        calibrated_overhead_gib=cal)
        assert plan["calibrated"]["capacity_tokens"] == actual
        assert abs(plan["calibrated"]["capacity_tokens"] - actual) / actual <= 0.02
        # the calibrated plan tells the same preemption story as the measurement
        assert [lv["predicts_preemption"] for lv in plan["calibrated"]["levels"]] == [False, kv == "auto"]


def test_lookup_canonicalises_dtype_and_gpu_name():
    table = calib.fit(_measurements())
    a = calib.lookup_overhead_gib(table, "vllm", GPU, "auto")
    assert a is not None
    assert calib.lookup_overhead_gib(table, "vllm", "  nvidia geforce RTX 5070  Ti ", "fp16") == a
    assert calib.lookup_overhead_gib(table, "vllm", GPU, "bf16") == a
    assert calib.lookup_overhead_gib(table, "llamacpp", GPU, "f16") is None
    assert calib.lookup_overhead_gib(table, "vllm", "NVIDIA H200", "fp8") is None
    assert calib.lookup_overhead_gib(None, "vllm", GPU, "fp8") is None


def test_llamacpp_overhead_from_peak_memory():
    m = calib.Measurement(backend="llamacpp", model="q4km.gguf", kv_dtype="q8_0", gpu_name=GPU, gpu_gib=15.92,
                          weights_gib=4.36, kv_bytes_per_token=30464, kv_cache_bytes=65536 * 30464,
                          peak_vram_gib=7.68, job_id="j1")
    # 7.68 - 4.36 - 65536 x 30464 / 2^30 = 7.68 - 4.36 - 1.859375
    assert calib.fit_overhead_gib(m) == pytest.approx(1.460625)
    table = calib.fit([m])
    assert calib.lookup_overhead_gib(table, "llamacpp", GPU, "q8_0") == pytest.approx(1.460625)
    (row,) = calib.calibration_report([m], table)
    assert row["predicted_tokens"] is None and row["error_pct"] is None
    assert row["predicted_peak_memory_gib"] == round(4.36 + 1.859375 + 1.5, 4)
    assert row["calibrated_peak_memory_gib"] == 7.68 and row["calibrated_memory_error_pct"] == 0.0
    assert calib.calibration_rows([m]) == []  # not a vLLM capacity row


def test_kvexp_job_result_with_its_planner_block():
    plan = plan_job(QWEN7, "auto", VLLM, 15.92, prompt_tokens=512, max_tokens=256, levels=[1])
    result = {
        "label": "vllm-qwen2.5-7b-fp16-chat", "started_at": "2026-12-01T10:00:00Z",
        "backend": {"name": "vllm"}, "model": {"name": "qwen2.5-7b", "path": "Qwen/Qwen2.5-7B-Instruct-AWQ"},
        "kv": {"requested": "fp16", "backend_dtype": "auto"},
        "kv_cache": {"dtype": "auto", "blocks": 9878, "block_size": 16, "gpu_memory_utilization": 0.9,
                     "capacity_tokens": 158048},
        "gpu": {"name": GPU, "memory_gib": 15.92},
        "planner": plan, "levels": [{"peak_vram_gib": 15.7}],
    }
    job = JobResult.from_json(result)
    assert calib.calibration_rows([job]) == [REF["calibration"][0]]
    (m,) = calib._measurements([job])
    assert m.preset == "qwen2.5-7b" and m.peak_vram_gib == 15.7


def test_file_round_trip_and_merge(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "calibration.json"
    assert calib.load(path) is None
    table = calib.update(_measurements(), path)
    assert calib.load(path) == table
    assert [p.name for p in path.parent.iterdir()] == ["calibration.json"]  # no temp file left
    again = calib.update(_measurements(), path)  # the same jobs replace their samples
    assert [e["jobs"] for e in again["entries"]] == [2, 2]
    assert again == table

    monkeypatch.setenv(calib.ENV_PATH, str(path))
    assert calib.default_path() == path
    assert calib.load() == table
    monkeypatch.delenv(calib.ENV_PATH)
    monkeypatch.setenv("KVEXP_CACHE", str(tmp_path / "cache"))
    assert calib.default_path() == tmp_path / "cache" / "calibration.json"


def test_bad_files_fail_with_one_line(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    with pytest.raises(calib.CalibrationError, match="c.json"):
        calib.load(bad)
    bad.write_text(json.dumps({"kind": "kvexp-calibration", "schema_version": 99, "entries": []}))
    with pytest.raises(calib.CalibrationError, match="schema_version 99"):
        calib.load(bad)
