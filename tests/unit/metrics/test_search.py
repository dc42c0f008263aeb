"""SLO search: the pure decisions of kvexp/metrics/search.py (on the real llama-server, the same answer as the
full grid from fewer levels: tests/integration/llamacpp/test_search_real.py)."""

from __future__ import annotations

import pytest

from kvexp.metrics import search
from kvexp.metrics.levels import Level
from kvexp.metrics.search import Objectives, Probe, next_step

OBJ = Objectives("concurrency", slo_ttft_ms=100.0, slo_tpot_ms=None, min_growth=None)
GRID = [float(c) for c in range(1, 17)]


def _probe(x, ttft, tput=None, **kw):
    return search.evaluate(x, [Level.from_json({"ttft_p95_ms": ttft, "tpot_p95_ms": 1.0, "throughput_tok_s": tput,
                                                "requests": 16, "errors": 0, "status": "ok", **kw})], OBJ)


def _run(latency, grid=GRID, obj=OBJ):
    """Drive the search against a latency curve; returns (final step, levels probed in order)."""
    probes: list[Probe] = []
    while True:
        step = next_step(grid, probes, obj)
        if step.x is None:
            return step, [p.x for p in probes]
        lv = {"requests": 16, "errors": 0, "status": "ok", **latency(step.x)}
        probes.append(search.evaluate(step.x, [Level.from_json(lv)], obj))


def test_ramp_doubles_then_bisects_to_neighbours():
    step, order = _run(lambda c: {"ttft_p95_ms": 20.0 * c})  # 100 ms at 5: the answer
    assert order == [1, 2, 4, 8, 6, 5]
    assert (step.answer, step.last_pass, step.first_fail, step.stop_reason) == (5, 5, 6, search.STOP_RESOLUTION)


@pytest.mark.parametrize("knee", range(1, 17))
def test_the_answer_is_the_grids_for_every_knee(knee):
    step, order = _run(lambda c: {"ttft_p95_ms": 50.0 if c <= knee else 500.0})
    assert step.answer == knee and len(order) <= 8
    full = [_probe(c, 50.0 if c <= knee else 500.0) for c in GRID]
    assert search.grid_answer(full) == knee


def test_nothing_meets_and_everything_meets():
    step, order = _run(lambda c: {"ttft_p95_ms": 500.0})
    assert order == [1] and step.answer is None and step.stop_reason == search.STOP_BOTTOM
    step, order = _run(lambda c: {"ttft_p95_ms": 1.0})
    assert order == [1, 2, 4, 8, 16] and step.answer == 16 and step.stop_reason == search.STOP_TOP
    assert step.first_fail is None


def test_a_grid_that_does_not_double_takes_its_top_before_stopping():
    step, order = _run(lambda c: {"ttft_p95_ms": 1.0}, grid=[1.0, 3.0, 5.0])
    assert order == [1, 3, 5] and step.answer == 5


def test_stops_when_throughput_stops_growing():
    obj = Objectives("concurrency", 100.0, None, min_growth=0.05)
    step, order = _run(lambda c: {"ttft_p95_ms": 1.0, "throughput_tok_s": min(c, 4) * 100.0}, obj=obj)
    assert order == [1, 2, 4, 8] and step.stop_reason == search.STOP_PLATEAU and step.answer == 8
    assert "400.0 -> 400.0 tok/s from concurrency 4 to 8" in step.detail


def test_stops_when_preemptions_begin_or_errors_pass_the_threshold():
    step, order = _run(lambda c: {"ttft_p95_ms": 1.0, "preemptions": 3 if c >= 8 else 0})
    assert order == [1, 2, 4, 8] and step.stop_reason == search.STOP_PREEMPTION
    assert step.answer == 4 and step.first_fail == 8
    step, order = _run(lambda c: {"ttft_p95_ms": 1.0, "errors": 8 if c >= 4 else 0})
    assert order == [1, 2, 4] and step.stop_reason == search.STOP_ERRORS and step.answer == 2


def test_repeats_are_averaged_and_both_objectives_count():
    obj = Objectives("concurrency", 100.0, 5.0)
    p = search.evaluate(4, [Level.from_json({"ttft_p95_ms": 90.0, "tpot_p95_ms": 4.0, "requests": 8, "errors": 0}),
                            Level.from_json({"ttft_p95_ms": 120.0, "tpot_p95_ms": 4.0, "requests": 8, "errors": 0})],
                        obj)
    assert p.ttft_ms == 105.0 and not p.passed and p.misses == ("ttft",)
    p99 = Objectives("concurrency", None, 5.0, percentile="p99")
    assert search.evaluate(4, [Level.from_json({"tpot_p99_ms": 6.0, "tpot_p95_ms": 1.0, "requests": 8})],
                           p99).misses == ("tpot",)


def test_grid_filled_at_a_resolution():
    assert search.grid([1, 16], 3) == [1, 4, 7, 10, 13, 16]
    assert search.grid([0.5, 2.0], 0.5, integer=False) == [0.5, 1.0, 1.5, 2.0]


def test_bad_search_settings_are_one_line(tmp_path):
    from kvexp.app.checks import check_config
    from kvexp.app.compose import compose
    from kvexp.core.config import ConfigError

    for overrides, message in (
            (["scenario.search=concurrency"], "give scenario.slo_ttft_ms and/or scenario.slo_tpot_ms"),
            (["scenario.search=latency", "scenario.slo_ttft_ms=10"],
             "scenario.search='latency': allowed values are concurrency, rate"),
            (["scenario.slo_percentile=p90"], "scenario.slo_percentile='p90'"),
            (["scenario.search=rate", "scenario.slo_ttft_ms=10"], "give the grid to search as scenario.rates"),
            (["scenario.search=concurrency", "scenario.slo_ttft_ms=10", "scenario.search_resolution=0"],
             "scenario.search_resolution=0.0: must be > 0")):
        with pytest.raises(ConfigError, match=message):
            check_config(compose(overrides))


def test_a_search_whose_lowest_level_misses_says_so_in_the_same_words_everywhere(tmp_path, capsys):
    """An objective no level can meet (TTFT p95 under a microsecond): the terminal used to say "no job
    measured comparable levels" while the report said what happened; now the terminal, the job's summary
    and the report's verdict carry the one sentence."""
    import re

    from conftest import kvexp_main

    import fake_openai

    run = tmp_path / "run"
    assert kvexp_main(f"backend.binary={fake_openai.wrapper(tmp_path)}", "scenario.search=concurrency",
                      "scenario.concurrency=[1,4]", "scenario.slo_ttft_ms=0.001", "scenario.requests=4",
                      f"hydra.run.dir={run}") == 0
    out = capsys.readouterr().out
    (said,) = [line[len("verdict: "):] for line in out.splitlines() if line.startswith("verdict: ")]
    assert re.fullmatch(r"smoke, TTFT p95 ≤ 0\.001 ms: missed at every level: no configuration meets the objectives; "
                        r"the closest, llama\.cpp fp16, misses by \S+ % at its lowest level \(concurrency 1: TTFT p95 "
                        r"[\d.]+ ms\)\. Relax the objectives or measure lower levels\.", said), said
    assert f"\nVerdict: {said}\n" in (run / "summary.md").read_text()
    report = (run / "report" / "report.md").read_text()
    assert report.split("## Verdict\n\n", 1)[1].startswith(f"- {said}\n")
