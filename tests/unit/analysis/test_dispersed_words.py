"""A level too dispersed to compare reads the same in the overall-best finding as in the verdict: it
cannot be told apart, with what to run (scenario.repeats=3, more requests per level), never "a tie" nor
"not comparable" (two real llama-server jobs on SmolLM2, their levels' spread widened as a short run's)."""

import json
from pathlib import Path

from conftest import FIXTURES

from kvexp.analysis import noise
from kvexp.analysis.aggregate import collect
from kvexp.analysis.findings import compute_findings

REAL = FIXTURES / "decision"


def _pair(tmp: Path, spread: float) -> dict:
    paths = []
    for kv in ("fp16", "q8_0"):
        d = json.loads((REAL / kv / "result.json").read_text())
        for lv in d["levels"]:
            lv["machine"] = {"load_avg_1m": 1.0, "cores": 2, "busy_share": 0.9, "steal_share": 0.0}
            lv["tpot_p95_ms"], lv["tpot_p99_ms"] = lv["tpot_p50_ms"] * spread, lv["tpot_p50_ms"] * (spread + 1)
        (tmp / kv).mkdir()
        (tmp / kv / "result.json").write_text(json.dumps(d))
        paths.append(tmp / kv / "result.json")
    return collect(paths)


def test_the_overall_best_of_a_dispersed_level_says_what_the_verdict_says(tmp_path):
    agg = _pair(tmp_path, 60.0)
    (overall,) = [f for f in compute_findings(agg) if f.kind == "best_overall_throughput"]
    assert overall.numbers["noise_threshold_pct"] > noise.MAX_THRESHOLD_PCT  # dispersed indeed
    assert "the highest throughput cannot be told apart between" in overall.sentence
    assert overall.sentence.endswith(f": {noise.DISPERSED}.")
    assert "scenario.repeats=3" in overall.sentence and "more requests per level" in overall.sentence
    for word in ("tie", "not comparable", "threshold"):
        assert word not in overall.sentence, (word, overall.sentence)
    (verdict,) = agg.verdicts
    assert "cannot be told apart" in verdict["why"] and noise.DISPERSED in verdict["why"]


def test_a_level_within_an_actionable_threshold_is_still_a_tie(tmp_path):
    agg = _pair(tmp_path, 2.5)
    (overall,) = [f for f in compute_findings(agg) if f.kind == "best_overall_throughput"]
    assert overall.numbers["noise_threshold_pct"] <= noise.MAX_THRESHOLD_PCT
    assert "the highest throughput is a tie between" in overall.sentence
    assert noise.DISPERSED not in overall.sentence and "no measurable difference" in overall.sentence
