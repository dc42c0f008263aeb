"""Repeats on the real llama-server: every repeat kept, the last one carries mean, 95 % CI and CV per
figure; goodput from the scenario's objectives; summaries show it and flag unstable figures."""

from __future__ import annotations

import copy
import statistics

import pytest

from conftest import TINY

from kvexp.metrics import stats
from kvexp.app.compose import compose
from kvexp.analysis.aggregate import collect
from kvexp.metrics.levels import Level, level_warnings
from kvexp.backends.pool import ServerPool
from kvexp.measure.runner import run_job
from kvexp.report.summary import render_job_summary, repeat_cell
from kvexp.results.documents import JobResult
from kvexp.results.validate import check_file


@pytest.fixture(scope="module")
def repeated(llama_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("repeats")
    cfg = compose([*TINY, "scenario=smoke", f"backend.binary={llama_server}", "scenario.repeats=3",
                   "scenario.concurrency=[1,2]", "scenario.slo_ttft_ms=10000", "scenario.slo_tpot_ms=10000"])
    pool = ServerPool()
    try:
        res = run_job(cfg, out, pool=pool).to_json()
    finally:
        pool.release()
    return res, out


def test_every_repeat_is_kept(repeated):
    res, out = repeated
    assert res["status"] == "complete" and check_file(out / "result.json") == []
    assert [(lv["concurrency"], lv["repeat"]) for lv in res["levels"]] == [(c, r) for c in (1, 2) for r in range(3)]
    assert [lv.get("repeats") is not None for lv in res["levels"]] == [False, False, True] * 2


def test_the_last_repeat_summarises_the_level(repeated):
    res, _ = repeated
    for c in (1, 2):
        levels = [lv for lv in res["levels"] if lv["concurrency"] == c]
        summary = levels[-1]["repeats"]
        tput = [lv["throughput_tok_s"] for lv in levels]
        assert summary["throughput_tok_s"]["n"] == 3
        assert summary["throughput_tok_s"]["mean"] == pytest.approx(statistics.fmean(tput), abs=1e-3)
        sd = statistics.stdev(tput)
        assert summary["throughput_tok_s"]["ci95"] == pytest.approx(4.303 * sd / 3 ** 0.5, rel=1e-3, abs=1e-3)
        assert summary["throughput_tok_s"]["cv"] == pytest.approx(sd / statistics.fmean(tput), abs=1e-4)
        assert {"ttft_p50_ms", "tpot_p50_ms", "goodput_req_s"} <= set(summary)


def test_goodput_counts_requests_within_the_objectives(repeated):
    res, _ = repeated
    for lv in res["levels"]:
        # objectives of 10 s: every request meets them, so goodput is the request rate
        assert lv["goodput_req_s"] == pytest.approx(lv["request_rate"], rel=0.01)


def test_summaries_show_repeats_and_flag_unstable_figures(repeated):
    res, out = repeated
    text = render_job_summary(JobResult.from_json(res))
    assert "## Repeats" in text and " ± " in text and "(CV " in text
    shaky = copy.deepcopy(res)
    shaky["levels"][-1]["repeats"]["throughput_tok_s"]["cv"] = 0.25
    assert "**unstable**" in render_job_summary(JobResult.from_json(shaky))
    assert repeat_cell(Level.from_json({"repeats": {"ttft_p50_ms": {"mean": 12.0, "ci95": 1.5, "cv": 0.05, "n": 3}}}),
                       "ttft_p50_ms") == "12 ± 1.5 (CV 5.0 %)"
    agg = collect([out])  # the aggregate keeps the repeat summary and validates
    assert agg.runs[0].levels[2].repeats["throughput_tok_s"]["n"] == 3


def test_unstable_repeats_are_warned():
    level = Level(concurrency=4, rate=None, repeat=2, status="ok", **{**stats.summarize_level([]), "requests": 48},
                  repeats=stats.repeats_of([Level.from_json(x) for x in (
                      {"throughput_tok_s": 100.0, "ttft_p50_ms": 50.0}, {"throughput_tok_s": 130.0, "ttft_p50_ms": 51.0},
                      {"throughput_tok_s": 80.0, "ttft_p50_ms": 50.5})]))
    assert stats.unstable(level.repeats) == ["throughput_tok_s"]
    (w,) = level_warnings(level, [], False)
    assert w.code == "unstable" and w.values["n"] == 3
    assert w.text.startswith("unstable across 3 repeats: throughput_tok_s (CV 24 %)")
