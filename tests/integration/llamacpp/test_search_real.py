"""SLO search on the real llama-server: the same answer as the full grid from fewer levels (its pure
decisions: tests/unit/metrics/test_search.py)."""

from __future__ import annotations

import pytest
from conftest import TINY

from kvexp.metrics import search
from kvexp.metrics.levels import Level


# 4 slots: up to 4 streams no request waits for a slot (TTFT p95 a few ms, spikes of tens of ms on a busy
# machine); from 5 on, requests wait for a whole 256-token request (tens to hundreds of ms). The SLO is put in the
# widest gap the grid shows between the levels below a cut and those above it (their geometric mean), so
# the answer lies inside the grid whatever the machine's load; the search then runs against that SLO.
REAL = ["scenario=smoke", "scenario.concurrency=[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]", "scenario.requests=16",
        "scenario.max_tokens=256", "backend.parallel=4"]
MIN_GAP = 1.5  # the gap's ratio (lowest TTFT p95 above the cut / highest at or below it) the test needs


def _cut(levels):
    """(slo_ms, ratio) of the widest clean gap in TTFT p95 over the grid's concurrency."""
    p95 = {lv["concurrency"]: lv["ttft_p95_ms"] for lv in levels}
    xs = sorted(p95)
    best = max(((min(p95[x] for x in xs[i + 1:]) / max(p95[x] for x in xs[:i + 1]), i) for i in range(len(xs) - 1)))
    ratio, i = best
    lo, hi = max(p95[x] for x in xs[:i + 1]), min(p95[x] for x in xs[i + 1:])
    return round((lo * hi) ** 0.5, 1), ratio


@pytest.fixture(scope="module")
def grid_and_search(llama_server, tmp_path_factory):
    from kvexp.app.compose import compose
    from kvexp.backends.pool import ServerPool
    from kvexp.measure.runner import run_job

    pool, out = ServerPool(), {}
    try:
        folder = tmp_path_factory.mktemp("grid")
        out["grid"] = (run_job(compose([*TINY, *REAL, f"backend.binary={llama_server}", "label=grid"]), folder, pool=pool).to_json(),
                       folder)
        slo, ratio = _cut(out["grid"][0]["levels"])
        assert ratio >= MIN_GAP, f"no clean latency knee in the grid: {[lv['ttft_p95_ms'] for lv in out['grid'][0]['levels']]}"
        folder = tmp_path_factory.mktemp("search")
        cfg = compose([*TINY, *REAL, f"backend.binary={llama_server}", "label=search", f"scenario.slo_ttft_ms={slo}",
                       "scenario.search=concurrency", "scenario.search_min_growth=null"])
        out["search"] = (run_job(cfg, folder, pool=pool).to_json(), folder)
    finally:
        pool.release()
    out["slo"] = slo
    return out


def test_the_search_finds_the_grids_answer_in_less_time(grid_and_search):
    from kvexp.results.validate import check_file

    (grid, _), (found, folder) = grid_and_search["grid"], grid_and_search["search"]
    obj = search.Objectives("concurrency", grid_and_search["slo"], None, min_growth=None)
    full = [search.evaluate(lv["concurrency"], [Level.from_json(lv)], obj) for lv in grid["levels"]]
    expected = search.grid_answer(full)
    assert expected is not None and 1 <= expected < 16, [(p.x, p.ttft_ms) for p in full]
    s = found["search"]
    why = ([(p.x, p.ttft_ms) for p in full], s["probed"])
    # each probe's verdict is that of the level the search measured, and the answer is the one its own
    # measurements give: it meets the SLO, its neighbour above misses it
    mine = {lv["concurrency"]: search.evaluate(lv["concurrency"], [Level.from_json(lv)], obj).passed
            for lv in found["levels"]}
    assert {p["x"]: p["passed"] for p in s["probed"]} == mine
    answer = s["answer"]
    assert mine[answer] and not mine[answer + 1], why
    assert s["last_pass"] == answer and s["first_fail"] == answer + 1
    assert s["stop_reason"] == search.STOP_RESOLUTION
    # the grid's answer, unless the two runs measured differently a level that decides between the two
    # answers (measured twice on a busy machine, a level near the SLO may land either side of it), or the
    # grid's first miss lies at a level the search never measured (it took it as met: a higher level met
    # the SLO in its own run)
    if answer != expected:
        grid_passed = {p.x: p.passed for p in full}
        lo, hi = min(answer, expected), max(answer, expected) + 1
        assert any(mine[x] != grid_passed[x] for x in mine if lo <= x <= hi) or expected + 1 not in mine, why
    probed = [p["x"] for p in s["probed"]]
    assert sorted(probed) == [lv["concurrency"] for lv in found["levels"]]  # every probe kept as a level
    assert len(probed) < len(grid["levels"]) / 2
    assert found["timing"]["measure_s"] < grid["timing"]["measure_s"]
    assert check_file(folder / "result.json") == []


def test_the_reports_recommendation_names_the_answer(grid_and_search, tmp_path, monkeypatch):
    from kvexp.analysis.aggregate import collect
    from kvexp.report import render as R

    monkeypatch.setenv("KVEXP_CALIBRATION", str(tmp_path / "none.json"))
    answer = grid_and_search["search"][0]["search"]["answer"]
    agg = collect([grid_and_search["grid"][1], grid_and_search["search"][1]])  # validates, with recommendations
    (rec,) = agg.recommendations  # the grid set no SLO: the search's is the scenario's only one
    assert rec["met"] and rec["best"]["label"] == "search" and rec["best"]["capacity"] == answer
    R.render_report(agg, tmp_path, formats=("md",))
    text = (tmp_path / "report.md").read_text()
    top = text.split("## Ranking", 1)[1].split("## Findings", 1)[0]
    assert f"search (llama.cpp, fp16 KV) serves the most, {answer:g} concurrent requests within the objectives" in top
    assert f"TTFT p95 ≤ {grid_and_search['slo']:g} ms" in top
