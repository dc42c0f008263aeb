"""The report's cost per run does not grow with the sweep (issue 36): realistic sweeps of 10 and 100 jobs
(bench/sweep.py: kvexp's real results varied over KV dtypes, scenarios and 2-8 levels) reported in this
one process, their CPU time per run compared (no wall-clock bound: a ratio of two costs measured side by
side); and every file is read once, no request log at all."""

from __future__ import annotations

import importlib.util
import resource
from pathlib import Path

import pytest

from kvexp.analysis.aggregate import collect
from kvexp.report.render import render_report
from kvexp.results import guards

ROOT = Path(__file__).resolve().parent.parent


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
