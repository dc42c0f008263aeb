"""The recommendation: per scenario and SLO, the configuration serving the most within the SLO, its
runner-up and the margin (noise-aware), the quality cost where measured, or by how much the closest
misses."""

from __future__ import annotations

from kvexp.analysis import recommend
from kvexp.results.runs import Aggregate

SLO = {"slo_ttft_ms": 100.0, "slo_tpot_ms": None, "percentile": "p95"}


def _lv(c, ttft, tput, repeat=None):
    lv = {"concurrency": c, "requests": 32, "errors": 0, "throughput_tok_s": tput, "ttft_p50_ms": ttft / 2,
          "ttft_p95_ms": ttft, "tpot_p50_ms": 1.0, "tpot_p95_ms": 1.2, "peak_vram_gib": None,
          "peak_kv_cache_usage": None, "preemptions": None, "mean_prompt_tokens": 512.0}
    if repeat is not None:
        lv["repeat"] = repeat
    return lv


def _run(label, kv, levels, slo=SLO, **kw):
    return {"label": label, "backend": "llamacpp", "model": "m", "scenario": "chat", "prompt_tokens": 512,
            "max_tokens": 128, "gpu": "G", "gpu_gib": 24.0, "started_at": "2026-12-01 10:00 UTC",
            "kv_cache": {"dtype": kv, "blocks": None, "block_size": None, "gpu_memory_utilization": None},
            "levels": levels, "slo": slo, **kw}


def _agg(*runs):
    return Aggregate.from_json({"gpu": "G", "gpu_gib": 24.0, "runs": list(runs)})


def test_the_most_users_within_the_slo_wins_with_its_margin_and_quality():
    f16 = _run("f16", "f16", [_lv(1, 20, 100), _lv(4, 60, 300), _lv(8, 140, 320)])
    q8 = _run("q8", "q8_0", [_lv(1, 20, 110), _lv(4, 50, 330), _lv(8, 90, 400), _lv(16, 300, 410)],
              quality={"kld_mean": 0.004, "kld_p99": 0.05, "top1_agreement": 0.991, "notes": "x"})
    (rec,) = recommend.recommendations(_agg(f16, q8))
    assert rec["met"] and rec["best"]["label"] == "q8" and rec["best"]["capacity"] == 8
    assert rec["best"]["throughput_tok_s"] == 400 and rec["runner_up"]["capacity"] == 4
    assert rec["margin"]["capacity"] == 4 and rec["margin"]["capacity_pct"] == 100.0
    assert rec["best"]["quality"] == {"kld_mean": 0.004, "kld_p99": 0.05, "top1_agreement": 0.991}
    s = rec["sentence"]
    assert s.startswith("chat, TTFT p95 ≤ 100 ms: q8 (llama.cpp, q8_0 KV) serves the most, 8 concurrent requests")
    assert "400.0 tok/s there; quality of its KV dtype: kld_mean 0.004" in s and "margin 4, +100 %" in s


def test_a_run_without_quality_shows_none_and_a_capacity_tie_is_noise_aware():
    a = _run("a", "f16", [_lv(4, 60, 100, repeat=i) for i in range(3)])
    b = _run("b", "f16", [_lv(4, 60, 100 + d, repeat=i) for i, d in enumerate((-8, 6, 2))])
    (rec,) = recommend.recommendations(_agg(a, b))
    assert rec["best"]["quality"] is None and rec["margin"]["capacity"] == 0
    assert rec["margin"]["measurable"] is False and rec["margin"]["noise_basis"] == "repeats"
    assert "serves as many, and their throughput there shows no measurable difference" in rec["sentence"]


def test_nothing_meets_the_slo_says_by_how_much_the_best_misses():
    slow = _run("slow", "f16", [_lv(1, 150, 100), _lv(4, 400, 200)])
    closer = _run("closer", "q8_0", [_lv(1, 123, 100), _lv(4, 300, 200)])
    (rec,) = recommend.recommendations(_agg(slow, closer))
    assert rec["met"] is False and rec["best"] is None
    assert rec["miss"] == {"label": "closer", "at": 1.0, "kind": "concurrency", "miss_pct": 23.0,
                           "figure": "TTFT p95 123.0 ms"}
    assert "nothing meets the objectives; the closest, closer (llama.cpp, q8_0 KV), misses by 23 %" in rec["sentence"]


def test_a_search_answer_is_the_runs_capacity_and_failed_levels_miss():
    searched = _run("s", "f16", [_lv(1, 20, 100), _lv(2, 30, 150), _lv(3, 40, 160)],
                    search={"kind": "concurrency", "answer": 3, "objectives": SLO})
    failed = _run("f", "q8_0", [_lv(1, 20, 100), {**_lv(2, 30, 150), "status": "failed"}, _lv(3, 40, 160)])
    (rec,) = recommend.recommendations(_agg(searched, failed))
    assert rec["best"]["label"] == "s" and rec["best"]["capacity"] == 3 and rec["runner_up"]["capacity"] == 1


def test_scenarios_without_an_slo_rank_by_peak_throughput_and_separate_slos_separately():
    a = _run("a", "f16", [_lv(1, 20, 100), _lv(4, 60, 300)], slo=None)
    b = _run("b", "q8_0", [_lv(1, 20, 100), _lv(4, 60, 310)], slo=None)
    (rec,) = recommend.recommendations(_agg(a, b))
    assert rec["slo"] is None and rec["best"]["label"] == "b"
    assert "no latency objective set" in rec["sentence"] and "no measurable difference" in rec["sentence"]
    tight = {**SLO, "slo_ttft_ms": 30.0}
    recs = recommend.recommendations(_agg(_run("a", "f16", a["levels"]), _run("b", "q8_0", b["levels"], slo=tight)))
    assert [(r["slo"]["slo_ttft_ms"], r["best"]["capacity"]) for r in recs] == [(100.0, 4), (30.0, 1)]
