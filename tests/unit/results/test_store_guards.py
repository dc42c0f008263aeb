"""The guards every reader shares (kvexp.results.guards), in process: what resume reads (the job's
result.json and requests.jsonl) is refused in one line when it is a FIFO or a link to a device, the
limits and the depth scan, the sanity rules' edges (equal percentiles, a repeat of a level), and the
strict types of other tools' fields at their edges (null, "inf", a missing count)."""

from __future__ import annotations

import copy
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import FIXTURES

from kvexp.results import foreign_fields, guards, validate
from kvexp.results.store import ResultError, find_results, keep_requests, load_any, load_document, previous_result

FIX = FIXTURES / "foreign"
KVEXP_RESULT = FIX / "kvexp" / "result.json"
VLLM = FIX / "vllm" / "tiny-vllm-concurrency1.json"
GUIDELLM = FIX / "guidellm" / "benchmarks.json"
AIPERF = FIX / "aiperf" / "concurrency1" / "profile_export_aiperf.json"


def finishes(fn: Callable[[], Any], timeout_s: float = 60) -> Any:
    """fn() in a daemon thread: the test fails (instead of hanging) if it does not return."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "the read did not return: it blocks"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def hostile(path: Path, how: str) -> Path:
    if how == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    return path


@pytest.mark.parametrize("how", ["fifo", "zero"])
def test_resume_refuses_a_result_that_is_not_a_regular_file(tmp_path, how):
    path = hostile(tmp_path / "result.json", how)
    with pytest.raises(ResultError) as e:
        finishes(lambda: previous_result(path, "0" * 16))
    assert str(e.value) == f"{path}: {guards.NOT_REGULAR}"
    with pytest.raises(ResultError, match="not a regular file"):
        finishes(lambda: load_document(path))


@pytest.mark.parametrize("how", ["fifo", "zero"])
def test_resume_refuses_requests_that_are_not_a_regular_file(tmp_path, how):
    path = hostile(tmp_path / "requests.jsonl", how)
    with pytest.raises(ResultError) as e:
        finishes(lambda: keep_requests(path, {(1.0, 0)}))
    assert str(e.value) == f"{path}: {guards.NOT_REGULAR}"
    assert validate.check_file(path) == [f"{path}: {guards.NOT_REGULAR}"]


def test_keep_requests_drops_an_overlong_or_deep_line(tmp_path, monkeypatch):
    monkeypatch.setattr(guards, "MAX_LINE_BYTES", 200)
    rows = [{"level": 1, "repeat": 0, "warmup": False, "i": 0}, {"level": 1, "repeat": 0, "pad": "x" * 300},
            {"level": 2, "repeat": 0, "i": 2}]
    path = tmp_path / "requests.jsonl"
    lines = [json.dumps(r) for r in rows] + ["[" * 100_000, json.dumps({"level": 1, "repeat": 0, "i": 3})]
    path.write_text("\n".join(lines) + "\n")
    keep_requests(path, {(1.0, 0)})
    assert [json.loads(x).get("i") for x in path.read_text().splitlines()] == [0, 3]


def test_a_folder_scan_never_opens_a_fifo(tmp_path):
    (tmp_path / "a.json").write_bytes(VLLM.read_bytes())
    hostile(tmp_path / "b.json", "fifo")
    hostile(tmp_path / "c.json", "zero")
    assert finishes(lambda: find_results([tmp_path])) == [tmp_path / "a.json"]


def test_the_limits_are_read_when_used(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_bytes(KVEXP_RESULT.read_bytes())
    monkeypatch.setattr(validate, "MAX_FILE_BYTES", 1000)
    (line,) = validate.check_file(path)
    assert line == f"{path}: larger than 1000 bytes ({path.stat().st_size} bytes); not a kvexp file"
    with pytest.raises(ResultError, match="larger than 1000 bytes"):
        load_any(path)


def test_the_depth_scan_skips_strings_and_needs_no_recursion():
    assert not guards.too_deep('{"a": "' + "[" * 10_000 + '"}', 8)
    assert not guards.too_deep("[" * 8 + "]" * 8, 8)
    assert guards.too_deep("[" * 9 + "]" * 9, 8)
    assert guards.too_deep('["\\"", ' + "{" * 2_000_000, 512)
    with pytest.raises(ValueError, match="nested too deeply"):
        validate.parse_json("[" * 2_000_000)


def test_show_never_quotes_a_huge_value():
    assert guards.show("x" * 5_000_000).endswith("... (5000000 characters)")
    assert len(guards.show(list(range(10 ** 5)))) < 50
    assert guards.show("eight") == "'eight'"


def _result(edit: Callable[[dict], Any]) -> dict:
    doc = json.loads(KVEXP_RESULT.read_text())
    edit(doc)
    return doc


def test_sanity_accepts_equal_percentiles_missing_ones_and_repeats():
    def edit(d: dict) -> None:
        lv = d["levels"][0]
        lv.update(ttft_p50_ms=5.0, ttft_p95_ms=5.0, ttft_p99_ms=5.0, tpot_p95_ms=None, itl_p50_ms=None)
        d["levels"].append({**copy.deepcopy(lv), "repeat": 1})
        d["label"] = "L" * guards.MAX_NAME_CHARS

    assert validate.read_errors(_result(edit), "result") == []


def test_sanity_compares_around_a_missing_percentile():
    doc = _result(lambda d: d["levels"][0].update(ttft_p95_ms=None, ttft_p50_ms=50.0, ttft_p99_ms=40.0))
    assert guards.sanity_errors(doc, "result") == [
        "$.levels[0].ttft_p50_ms: 50 is above ttft_p99_ms 40; a lower percentile cannot exceed a higher one"]


def test_sanity_covers_aggregates_run_by_run(reference_path):
    agg = json.loads(reference_path.read_text())
    assert guards.sanity_errors(agg, "aggregate") == []
    run = agg["runs"][0]
    run["levels"].append(copy.deepcopy(run["levels"][0]))
    run["model"] = "m" * 1001
    errs = guards.sanity_errors(agg, "aggregate")
    assert errs[0].startswith("$.runs[0].model: 1001 characters, more than the 1000 a name may have")
    assert errs[1].startswith(f"$.runs[0].levels[{len(run['levels']) - 1}]: concurrency ")


def test_a_long_text_anywhere_in_a_kvexp_file_is_refused():
    doc = _result(lambda d: d["levels"][0]["warnings"].append("w" * (guards.MAX_TEXT_CHARS + 1)))
    (err,) = guards.sanity_errors(doc, "result")
    assert err.startswith("$.levels[0].warnings[") and "more than the 65536 any text" in err


def _vllm(**changes: Any) -> dict:
    return {**json.loads(VLLM.read_text()), **changes}


@pytest.mark.parametrize("changes", [
    {"max_concurrency": None, "request_rate": "inf"},  # every prompt at once: the concurrency is num_prompts
    {"request_rate": 4.0},
    {"request_rate": float("inf")},  # what json.dumps writes for a rate of inf
    {"request_goodput": None},
    {"failed": None},
    {"completed": 0, "failed": 16, "median_ttft_ms": 0.0, "p95_ttft_ms": 7.0, "p99_ttft_ms": 0.0},
])
def test_vllm_fields_that_are_fine(changes):
    assert foreign_fields.field_errors(_vllm(**changes)) == []


@pytest.mark.parametrize("changes,expected", [
    ({"completed": -1}, "$.completed: expected a whole number >= 0, found -1"),
    ({"completed": 2.5}, "$.completed: expected a whole number >= 0, found 2.5"),
    ({"failed": True}, "$.failed: expected a number, found True"),
    ({"median_ttft_ms": float("nan")}, "$.median_ttft_ms: nan is not a finite number"),
    ({"max_concurrency": float("inf")}, "$.max_concurrency: inf is not a finite number"),
    ({"request_rate": 0}, '$.request_rate: expected requests per second > 0 (or "inf"), found 0'),
    ({"output_throughput": 1e308}, "$.output_throughput: 1e+308 tok/s is above 1e+07 tok/s: not a measurement"),
    ({"p99_ttft_ms": 1.0}, "$.p95_ttft_ms: 238.271 is above p99_ttft_ms 1; a lower percentile cannot exceed"),
    ({"num_prompts": None, "failed": 2_000_000}, "$.failed: 2000000: 2000016 requests in one run, more than the "
                                                 "1000000 kvexp reads in one level"),
    ({"label": "x" * 1001}, "$.label: 1001 characters, more than the 1000 a name may have"),
])
def test_vllm_fields_that_are_refused(changes, expected):
    errs = foreign_fields.field_errors(_vllm(**changes))
    assert errs and errs[0].startswith(expected), errs


def test_guidellm_and_aiperf_fields():
    g = json.loads(GUIDELLM.read_text())
    assert foreign_fields.field_errors(g) == []
    g["benchmarks"][1]["config"]["strategy"]["streams"] = -2
    g["benchmarks"][0]["metrics"]["request_totals"]["errored"] = "none"
    assert foreign_fields.field_errors(g) == [
        "$.benchmarks[0].metrics.request_totals.errored: expected a number, found 'none'",
        "$.benchmarks[1].config.strategy.streams: expected a whole number of requests in flight >= 1, found -2"]
    a = json.loads(AIPERF.read_text())
    assert foreign_fields.field_errors(a) == []
    a["input_config"]["phases"][0]["concurrency"] = "eight"
    a["request_count"]["avg"] = -16
    assert foreign_fields.field_errors(a) == [
        "$.request_count.avg: expected a whole number >= 0, found -16",
        "$.input_config.phases[0].concurrency: expected a whole number of requests in flight >= 1 (or null), "
        "found 'eight'"]


def test_a_lone_tool_file_without_success_is_read_but_not_validated_alone(tmp_path):
    """`results` groups a file with no successful request with the others of its run; `validate`, which
    sees it alone, says its run has no prompt length (as before)."""
    path = tmp_path / "v.json"
    path.write_text(json.dumps(_vllm(completed=0, failed=16)))
    assert load_any(path)[0] == "foreign"
    (err,) = validate.check_file(path)
    assert "no successful request in any level" in err


def test_every_valid_fixture_reads_through_the_shared_path(reference_path):
    for path in [*sorted(FIX.rglob("*.json")), reference_path]:
        assert validate.check_file(path) == [], path
        kind, _ = load_any(path)
        # the fixture's own folder under FIX names its kind, not the checkout's folder (a clone is kvexp/)
        own = path.relative_to(FIX).parts if path.is_relative_to(FIX) else ()
        assert kind == ("aggregate" if path == reference_path else
                        "result" if "kvexp" in own else "foreign"), path
