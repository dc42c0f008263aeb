"""Noise-aware findings: a difference is called one only when it exceeds the measured noise (the
repeats' 95 % CIs; without repeats a 5 % minimum effect and the levels' own dispersion). On the real
llama-server: tests/integration/llamacpp/test_noise_real.py."""

from __future__ import annotations

import pytest

from kvexp.analysis import findings as F
from kvexp.analysis import noise
from kvexp.results.runs import Aggregate, Run


def _compare(a: dict, b: dict):
    """noise.compare of the first levels of two runs given as aggregate JSON."""
    ra, rb = Run.from_json(a), Run.from_json(b)
    return noise.compare(ra, ra.levels[0], rb, rb.levels[0])


def _lv(c, tput, repeat=None, **kw):
    lv = {"concurrency": c, "requests": 48, "errors": 0, "throughput_tok_s": tput, "ttft_p50_ms": 100.0,
          "ttft_p95_ms": 120.0, "tpot_p50_ms": 10.0, "peak_vram_gib": None, "peak_kv_cache_usage": None,
          "preemptions": None, "mean_prompt_tokens": 512.0, **kw}
    if repeat is not None:
        lv["repeat"] = repeat
    return lv


def _run(label, levels, kv="f16"):
    return {"label": label, "backend": "llamacpp", "model": "m", "scenario": "chat", "prompt_tokens": 512,
            "max_tokens": 128, "gpu": "G", "gpu_gib": 24.0, "started_at": "2026-12-01 10:00 UTC",
            "kv_cache": {"dtype": kv, "blocks": None, "block_size": None, "gpu_memory_utilization": None},
            "levels": levels}


def _repeated(label, c, values, kv="f16"):
    return _run(label, [_lv(c, v, repeat=i) for i, v in enumerate(values)], kv)


def test_overlapping_repeat_intervals_are_no_measurable_difference():
    a, b = _repeated("a", 4, [100, 110, 90]), _repeated("b", 4, [104, 96, 112])
    v = _compare(a, b)
    assert v.basis == "repeats" and not v.measurable and v.label == "no measurable difference"
    assert v.a == pytest.approx(100) and v.ci_a == pytest.approx(4.303 * 10 / 3 ** 0.5)
    assert "95 % CIs overlap" in v.reason


def test_separated_repeat_intervals_are_a_difference_even_when_small():
    a, b = _repeated("a", 4, [100.0, 100.5, 99.5]), _repeated("b", 4, [103.0, 103.5, 102.5])
    v = _compare(b, a)
    assert v.basis == "repeats" and v.measurable and v.diff_pct == pytest.approx(3.0)  # below 5 %, yet real


def test_without_repeats_a_minimum_effect_decides():
    a, b = _run("a", [_lv(4, 104.0)]), _run("b", [_lv(4, 100.0)])
    v = _compare(a, b)
    assert v.basis == "minimum effect" and not v.measurable and v.threshold_pct == 5.0
    c = _run("c", [_lv(4, 106.0)])
    assert _compare(c, b).measurable


def test_without_repeats_a_wide_level_raises_the_threshold():
    """TPOT p95 three times its p50 over 4 requests: the level's own dispersion exceeds 5 %."""
    wide = dict(tpot_p50_ms=10.0, tpot_p95_ms=30.0, requests=4)
    a, b = _run("a", [_lv(4, 108.0, **wide)]), _run("b", [_lv(4, 100.0, **wide)])
    v = _compare(a, b)
    se = 20 / 1.645 / 10 / 2
    assert v.threshold_pct == pytest.approx(1.96 * (2 * se * se) ** 0.5 * 100) and v.threshold_pct > 8
    assert not v.measurable


def test_runs_under_different_machine_load_are_never_called_different():
    """A 50 % lead measured while the machine was twice as loaded is the machine's as much as the
    configuration's: not measurable, and every finding that compares them says why."""
    calm = {"load_avg_1m": 0.6, "cores": 2, "busy_share": 0.4, "steal_share": 0.0}
    busy = {"load_avg_1m": 2.4, "cores": 2, "busy_share": 1.0, "steal_share": 0.0}
    a, b = _run("a", [_lv(4, 150.0, machine=calm)]), _run("b", [_lv(4, 100.0, machine=busy)], kv="q8_0")
    v = _compare(a, b)
    assert v.basis == "machine load" and not v.measurable and v.diff_pct == pytest.approx(50.0)
    assert v.reason == ("not comparable: the machine's load differed between the runs "
                        "(load 0.6 on 2 cores vs load 2.4 on 2 cores)")
    texts = [f.sentence for f in F.compute_findings(Aggregate.from_json({"runs": [a, b]}))]
    # findings set runs against each other only within a field of comparable runs (comparable.partition)
    assert not [t for t in texts if "KV changes throughput" in t or "highest throughput" in t]
    assert not any("a measurable difference" in t for t in texts)
    b["levels"][0]["machine"] = dict(calm)
    assert _compare(a, b).measurable


def test_a_comparison_across_engines_names_each_engine_build_and_weights():
    a, b = _run("a", [_lv(4, 150.0)]), _run("b", [_lv(4, 100.0)])
    a.update(backend_version="b6700", weights={"weights_format": "GGUF Q4_1", "bits_per_weight": 5.74})
    b.update(backend="vllm", backend_version="0.32.0", weights={"weights_format": "bfloat16"})
    texts = [f.sentence for f in F.compute_findings(Aggregate.from_json({"runs": [a, b]}))]
    both = "(llama.cpp b6700 on GGUF Q4_1, 5.74 bits/weight vs vLLM 0.32.0 on bfloat16)"
    assert any("highest throughput" in t and both in t for t in texts), texts
    b.update(backend="llamacpp", backend_version="b6700", weights=dict(a["weights"]))
    findings = F.compute_findings(Aggregate.from_json({"runs": [a, b]}))
    assert not any(" vs llama.cpp b6700" in f.sentence for f in findings)


def test_findings_say_which():
    same_a, same_b = _repeated("same-a", 4, [100, 110, 90]), _repeated("same-b", 4, [104, 96, 112])
    agg = {"gpu": "G", "gpu_gib": 24.0, "runs": [same_a, same_b]}
    best = [f for f in F.compute_findings(Aggregate.from_json(agg)) if f.kind == "best_throughput"]
    assert len(best) == 1 and best[0].numbers["measurable"] is False
    assert "show no measurable difference in throughput" in best[0].sentence
    assert "the repeats' 95 % CIs overlap" in best[0].sentence
    overall = next(f for f in F.compute_findings(Aggregate.from_json(agg)) if f.kind == "best_overall_throughput")
    # a difference within noise is a tie: no winner named
    assert "the highest throughput is a tie between" in overall.sentence
    assert ": no measurable difference" in overall.sentence and "runner-up" not in overall.sentence
    q8 = _repeated("q8", 4, [150, 151, 149], kv="q8_0")
    f16 = _repeated("f16", 4, [100, 101, 99])
    gain = next(f for f in F.compute_findings(Aggregate.from_json({"gpu": "G", "runs": [f16, q8]}))
                if f.kind == "kv_gain")
    assert "a measurable difference at concurrency 4 (against the repeats' 95 % CIs)" in gain.sentence
    assert gain.numbers["levels"][0]["measurable"] is True
