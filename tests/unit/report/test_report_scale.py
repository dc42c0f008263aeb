"""The report's cost per run does not grow with the sweep (issue 36): realistic sweeps of 10 and 100 jobs
(bench/sweep.py: kvexp's real results varied over KV dtypes, scenarios and 2-8 levels) reported in this
one process, their CPU time per run compared (no wall-clock bound: a ratio of two costs measured side by
side); every file is read once, no request log at all; and a large sweep's report charts its best runs
and makes its PDF a digest that says where the full tables are."""

from __future__ import annotations

import cProfile
import importlib.util
import pstats
from html import unescape
import resource
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

from kvexp.analysis.aggregate import collect
from kvexp.analysis.recommend import ranked
from kvexp.report import charts, pdf, render
from kvexp.report.digest import LIST_ITEMS, digest
from kvexp.report.render import render_report
from kvexp.report.scenario_view import CHART_RUNS
from kvexp.results import guards



def _sweep_module():
    spec = importlib.util.spec_from_file_location("kvexp_bench_sweep", ROOT / "bench" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    write = _sweep_module().write_sweep
    base = tmp_path_factory.mktemp("scale")
    out = {}
    for n in (10, 100):
        write(base / f"sweep-{n}", n, requests=False)
        out[n] = base / f"sweep-{n}"
    return out


def _cpu_s() -> float:
    """CPU seconds of this process and its ended children (the chart workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _report(sweep: Path, out: Path) -> float:
    start = _cpu_s()
    render_report(collect([sweep]), out, formats=("md", "html"), validated=True)
    return _cpu_s() - start


def test_cost_per_run_does_not_grow_with_the_sweep(sweeps, tmp_path):
    _report(sweeps[10], tmp_path / "warm")  # imports, the schemas' compilation, fonts: once, before
    best = {10: float("inf"), 100: float("inf")}
    for i in range(2):  # interleaved, the least of each: another process's burst lands on one, not both
        for n in (10, 100):
            best[n] = min(best[n], _report(sweeps[n], tmp_path / f"r{n}-{i}"))
    per_run = {n: best[n] / n for n in best}
    ratio = per_run[100] / per_run[10]
    assert ratio < 2, f"CPU per run: {per_run[10] * 1000:.1f} ms at 10 runs, {per_run[100] * 1000:.1f} ms at 100"


def test_each_file_is_read_once_and_no_request_log(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    _sweep_module().write_sweep(sweep, 12)  # with requests.jsonl beside each result
    opened: list[Path] = []
    real = guards.open_regular

    def counting(path, limit):
        opened.append(Path(path))
        return real(path, limit)

    monkeypatch.setattr(guards, "open_regular", counting)
    render_report(collect([sweep]), tmp_path / "report", formats=("md", "html"), validated=True)
    results = sorted(sweep.glob("*/result.json"))
    assert len(results) == 12 and sorted(opened) == results
    assert not [p for p in opened if p.name == "requests.jsonl"]


PDFTOTEXT = shutil.which("pdftotext")


def test_a_large_sweep_charts_its_best_runs_and_its_pdf_is_a_digest(tmp_path):
    sweep = tmp_path / "sweep"
    _sweep_module().write_sweep(sweep, 24, requests=False)
    agg = collect([sweep])
    scen, runs = max(agg.scenarios(), key=lambda sr: len(sr[1]))
    assert len(runs) > CHART_RUNS and render.is_large(agg)
    best = [r.label for r in ranked(runs)[:CHART_RUNS]]
    out = tmp_path / "report"
    files = render_report(agg, out, formats=("md", "html"), validated=True)
    html, md = unescape(files["html"].read_text()), files["md"].read_text()
    section = html.split(f'id="scenario-{scen}"')[1].split("</section>")[0]
    # the charts draw the best runs, one legend entry each; the tables keep every run
    assert section.split('<ul class="legend">')[1].split("</ul>")[0].count("<li>") == CHART_RUNS
    assert f"The charts show the {CHART_RUNS} best of this scenario's {len(runs)} runs" in section
    assert all(r.label in section.split("<figure")[0] for r in runs)
    with files["csv"].open() as f:
        assert sum(1 for _ in f) - 1 == sum(max(1, len(r.levels)) for r in agg.runs)
    # the Markdown shows the HTML's drawings, as SVG files, not a second drawing as PNG
    assert f"](charts/{scen}-throughput.svg)" in md and (out / "charts" / f"{scen}-throughput.svg").is_file()
    assert not list((out / "charts").glob("*.png"))
    # the PDF's digest: per scenario its best runs, one row each; no per-run setup tables; where the rest is
    ctx = render.build_context(agg, None, None)
    short = digest(ctx, agg)
    (view,) = [sc for sc in short["scenarios"] if sc["name"] == scen]
    assert [row[0] for row in view["table"].rows] == best and view["details"] == []
    assert short["setup"]["runs"] is None and short["setup"]["launches"] == []
    assert all(len(v["excluded"]) <= LIST_ITEMS + 1 for v in short["verdicts"])


@pytest.mark.skipif(pdf.support() is not None, reason="WeasyPrint cannot load here")
@pytest.mark.skipif(PDFTOTEXT is None, reason="pdftotext (poppler-utils) is not installed")
def test_a_large_sweeps_pdf_says_where_the_full_tables_are(tmp_path):
    sweep = tmp_path / "sweep"
    _sweep_module().write_sweep(sweep, 24, requests=False)
    files = render_report(collect([sweep]), tmp_path / "report", formats=("pdf",), validated=True)
    text = " ".join(subprocess.run([PDFTOTEXT, str(files["pdf"]), "-"], check=True, capture_output=True,
                                   text=True, timeout=120).stdout.split())
    assert "This PDF summarises 24 runs of " in text
    assert "The full tables are in comparison.csv (every run and level) and report.html, beside this file." in text


def _one_run(folder: Path, levels: int) -> Path:
    """A job of `levels` concurrency levels (1, 2, ... levels), from the sweep's first real result."""
    gen = _sweep_module()
    res, _ = gen.job(gen._templates(), 0)
    base = gen._templates()[0]["levels"][0]
    rng = gen.random.Random(levels)
    res["levels"] = [gen._scaled(base, c, 8, 32, 16, rng, 1.0) for c in range(1, levels + 1)]
    res["config"]["scenario"]["concurrency"] = list(range(1, levels + 1))
    res["config_hash"] = gen.config_hash(res["config"])
    (folder / "job").mkdir(parents=True)
    (folder / "job" / "result.json").write_text(gen.json.dumps(res))
    return folder


def _calls(folder: Path, out: Path) -> int:
    """Python function calls (cProfile's count: deterministic, unlike a time) of a report, charts included."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        render_report(collect([folder]), out, formats=("md", "html"), validated=True)
    finally:
        profile.disable()
    return pstats.Stats(profile).total_calls


def test_work_per_level_does_not_grow_with_a_runs_levels(tmp_path, monkeypatch):
    """One result of 1,024 levels took minutes: a figure's exposure was looked up over every level of the
    run for every cell (quadratic), and every point of a chart carried a label. Counted in function calls,
    the work per level of a run of 1,024 levels stays under twice that of a run of 64."""
    monkeypatch.setattr(charts, "PARALLEL_MIN_CHARTS", 1 << 30)  # drawn here, where they are counted
    small, large = _one_run(tmp_path / "64", 64), _one_run(tmp_path / "1024", 1024)
    per_level = {n: _calls(folder, tmp_path / f"r{n}") / n for n, folder in ((64, small), (1024, large))}
    assert per_level[1024] < 2 * per_level[64], per_level
