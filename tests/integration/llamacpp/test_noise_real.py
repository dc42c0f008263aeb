"""Noise-aware findings on the real llama-server: one configuration measured twice under two labels is
no measurable difference (the findings themselves: tests/unit/analysis/test_noise.py)."""

from __future__ import annotations

import pytest

from conftest import TINY

from kvexp.analysis import findings as F


@pytest.fixture(scope="module")
def twice(llama_server, tmp_path_factory):
    from kvexp.app.compose import compose
    from kvexp.analysis.aggregate import collect
    from kvexp.backends.pool import ServerPool
    from kvexp.measure.runner import run_job

    pool, folders = ServerPool(), []
    try:
        for label in ("same-a", "same-b"):
            out = tmp_path_factory.mktemp(label)
            cfg = compose([*TINY, "scenario=smoke", f"backend.binary={llama_server}", "scenario.repeats=3",
                           "scenario.concurrency=[2]", f"label={label}"])
            res = run_job(cfg, out, pool=pool)
            assert res.status == "complete", res.status_reason
            folders.append(out)
    finally:
        pool.release()
    return collect(folders)


def test_one_configuration_measured_twice_is_no_measurable_difference(twice):
    assert sorted(r.label for r in twice.runs) == ["same-a", "same-b"]
    best = [f for f in F.compute_findings(twice) if f.kind == "best_throughput"]
    assert len(best) == 1
    assert best[0].numbers["noise_basis"] == "repeats" and best[0].numbers["measurable"] is False, best[0].sentence
    assert "no measurable difference" in best[0].sentence
