"""The metric registry is the one place a level figure's header is spelled: every column header of
comparison.csv, of the job and sweep summaries and of the report's level tables is a registry header
(or, in the CSV, a level key), besides the non-metric columns this file names. A table or a header
written by hand fails here. Also: the registry's disqualifying codes are level warning codes, and the
figures summarised over repeats are the registry's."""

from __future__ import annotations

import copy
import csv
import json
import re
from pathlib import Path

import pytest
from conftest import FIXTURES

from kvexp.analysis.aggregate import collect
from kvexp.metrics import levels, registry, stats
from kvexp.report.render import render_report
from kvexp.report.summary import render_job_summary, write_sweep_outputs
from kvexp.report.tables import NESTED_LEVEL_BLOCKS
from kvexp.results.documents import JobResult
from kvexp.results.validate import config_hash, errors_of

FIX = FIXTURES / "foreign"
KVEXP_RESULT = FIX / "kvexp" / "result.json"  # kvexp's own run of a real (tiny) vLLM server
HEADERS = {m.header for m in registry.METRICS.values()}

# The columns that are not metrics, named once. Every other column of a level table is a registry header.
REPORT_LEVEL_FIRST = ["Run", "KV"]  # the report's level table: then metrics, then ...
REPORT_LEVEL_LAST = "Notes"  # ... the level's warning codes (when some level has one)
REPORT_DETAIL_FIRST = ["Run", "Level"]  # the latency and load detail tables
REPORT_DETAIL_TABLES = ("Latency detail", "Load and memory detail")
# the scenario's other tables: the workload's shape, not level figures
REPORT_OTHER_TABLES = ("Workload", "Prompt lengths (realised, first level)", "Conversation turns")
SUMMARY_REPEATS_FIRST = ["Level"]  # a summary's repeats table: the level, then figures over repeats
CSV_RUN_COLUMNS = ["label", "tool", "backend", "model", "scenario", "kv_dtype", "kv_dtype_source", "run_status"]
# the summaries' tables that hold no level figure: the job's facts, its quality, the sweep's jobs and time
JOB_OTHER_SECTIONS = ("# kvexp job: ", "## Quality")
SWEEP_OTHER_SECTIONS = ("## Jobs", "## Where the time went")


# ----------------------------------------------------------------------------------------------
# Inputs: kvexp's recorded result, with every optional figure a level may carry


def enriched_result() -> dict:
    """The recorded result with a repeated level (and its repeat summary), the server's own timing, the
    delivery figures, goodput and a failed level whose KV figures are null."""
    res = json.loads(KVEXP_RESULT.read_text())
    lv = res["levels"]
    for x in lv:
        x["goodput_req_s"] = x["request_rate"]
        x["server"] = {"ttft_mean_ms": 5.0, "tpot_p50_ms": 2.0, "tpot_mean_ms": 2.1, "queue_mean_ms": 0.5}
        x["delivery"] = {"tokens_per_chunk": 1.25, "multi_token_chunk_share": 0.2}
    again = copy.deepcopy(lv[1])
    again.update(repeat=1, throughput_tok_s=lv[1]["throughput_tok_s"] * 1.3)
    lv.insert(2, again)
    lv[2]["repeats"] = stats.repeats_of([levels.Level.from_json(lv[1]), levels.Level.from_json(lv[2])])
    failed = copy.deepcopy(lv[-1])
    failed.update(concurrency=8, status="failed", status_reason="4/16 requests failed (timeout 4)", errors=4,
                  errors_by_kind={"timeout": 4},
                  peak_kv_cache_usage=None, preemptions=None, throughput_tok_s=None)
    lv.append(failed)
    res["config"]["scenario"]["repeats"] = 2
    res["config_hash"] = config_hash(res["config"])  # as a job run with repeats=2 records it
    assert errors_of(res, "result") == []
    return res


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep folder holding the enriched job, summarised and reported as a sweep's end does."""
    d = tmp_path_factory.mktemp("sweep")
    job = d / "0_vllm-tiny-fp16-smoke"
    job.mkdir()
    (job / "result.json").write_text(json.dumps(enriched_result()))
    write_sweep_outputs(d, wall_s=10.0)
    return d


@pytest.fixture(scope="module")
def mixed(sweep: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job beside other tools' files (their runs add the CSV's tool column and "not recorded" cells)."""
    out = tmp_path_factory.mktemp("mixed")
    render_report(collect([sweep, FIX / "vllm", FIX / "guidellm", FIX / "aiperf"]), out, formats=("md",))
    return out


# ----------------------------------------------------------------------------------------------
# Markdown tables with the heading they stand under


def _cells(line: str) -> list[str]:
    return [re.sub(r"\\(.)", r"\1", c.strip()) for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def md_tables(text: str) -> list[tuple[str, list[str]]]:
    """(the nearest heading above, the header cells) of every table."""
    out, heading, lines = [], "", text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#"):
            heading = line
        elif (line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|(-+:?\|)+$", lines[i + 1])
              and not (i and lines[i - 1].startswith("|"))):
            out.append((heading, _cells(line)))
    return out


def not_registered(headers: list[str]) -> list[str]:
    return [h for h in headers if h not in HEADERS]


def check_report(text: str) -> dict[str, int]:
    """Every level table of a report.md: its metric columns are registry headers. Returns how many
    tables of each kind it checked; a table under a heading this file does not name fails."""
    seen = {"levels": 0, "detail": 0}
    for heading, head in md_tables(text):
        if heading.startswith("## Scenario: "):
            assert head[:2] == REPORT_LEVEL_FIRST, (heading, head)
            metrics = head[2:-1] if head[-1] == REPORT_LEVEL_LAST else head[2:]
            assert not not_registered(metrics), (heading, not_registered(metrics))
            seen["levels"] += 1
        elif heading.startswith("#### "):
            name = heading[5:]
            if name in REPORT_OTHER_TABLES:
                continue
            assert name in REPORT_DETAIL_TABLES, f"a new level table {name!r}: name it in tests/unit/metrics/test_registry.py"
            assert head[:2] == REPORT_DETAIL_FIRST and not not_registered(head[2:]), (name, not_registered(head[2:]))
            seen["detail"] += 1
    return seen


# ----------------------------------------------------------------------------------------------
# The registry's own consistency


def test_disqualifying_codes_are_level_warning_codes():
    bad = {m.key: c for m in registry.METRICS.values() for c in m.disqualified_by if c not in levels.WARNING_CODES}
    assert not bad, f"disqualified_by codes that kvexp.metrics.levels.WARNING_CODES does not define: {bad}"


def test_repeated_figures_are_the_statistics_repeat_figures():
    assert tuple(registry.REPEATED) == tuple(stats.REPEAT_FIGURES)


def test_headers_are_unique():
    assert len(HEADERS) == len(registry.METRICS)


# ----------------------------------------------------------------------------------------------
# Every output's column headers


def test_report_level_tables_use_registry_headers(sweep, mixed):
    for d in (sweep / "report", mixed):
        seen = check_report((d / "report.md").read_text())
        assert seen["levels"] >= 1 and seen["detail"] == 2, (d, seen)  # the check saw every kind of table


def test_report_level_tables_show_the_optional_figures(sweep):
    text = (sweep / "report" / "report.md").read_text()
    heads = [h for _, h in md_tables(text)]
    shown = {c for h in heads for c in h}
    for key in ("repeat", "server.tpot_p50_ms", "delivery.tokens_per_chunk", "goodput_req_s", "repeats", "cv"):
        assert registry.metric(key).header in shown, key


def test_a_hand_written_header_fails_the_check(sweep):
    text = (sweep / "report" / "report.md").read_text()
    forged = text.replace(f"| {registry.metric('ttft_p50_ms').header} |", "| TTFT p50 ms |", 1)
    assert forged != text
    with pytest.raises(AssertionError):
        check_report(forged)


def test_csv_columns_are_registry_keys(sweep, mixed):
    for d in (sweep / "report", mixed):
        agg = json.loads((d / "comparison.json").read_text())
        head = next(csv.reader((d / "comparison.csv").open()))
        tools = any(r.get("tool") for r in agg["runs"])
        run_cols = [c for c in CSV_RUN_COLUMNS if c != "tool" or tools]
        assert head[:len(run_cols)] == run_cols
        rest = head[len(run_cols):]
        keys = [k for k in rest if k in registry.METRICS]
        assert rest[:len(keys)] == keys == [k for k in registry.METRICS if k in keys]  # the registry's order
        # after them, only keys the levels carry that the registry does not describe (data, never a label)
        carried = set()
        for r in agg["runs"]:
            for lv in r.get("levels") or []:
                carried |= {f"{k}.{i}" for k, v in lv.items() if k in NESTED_LEVEL_BLOCKS and isinstance(v, dict)
                            for i in v}
                carried |= {k for k, v in lv.items() if not (k in NESTED_LEVEL_BLOCKS and isinstance(v, dict))}
        extra = rest[len(keys):]
        assert extra == sorted(extra) and set(extra) <= carried - set(registry.METRICS), extra
    assert "tool" in next(csv.reader((mixed / "comparison.csv").open()))


def test_job_summary_columns_are_registry_headers():
    text = render_job_summary(JobResult.from_json(enriched_result()))
    checked = 0
    for heading, head in md_tables(text):
        if heading.startswith(JOB_OTHER_SECTIONS):
            continue
        if heading == "## Levels":
            assert not not_registered(head), not_registered(head)
        else:
            assert heading == "## Repeats", f"a new table under {heading!r}: name it in tests/unit/metrics/test_registry.py"
            assert head[:1] == SUMMARY_REPEATS_FIRST and not not_registered(head[1:]), not_registered(head[1:])
        checked += 1
    assert checked == 2
    assert registry.metric("server.tpot_p50_ms").header in text and registry.metric("repeat").header in text


def test_sweep_summary_columns_are_registry_headers(sweep):
    text = (sweep / "summary.md").read_text()
    labels = {f"## {r['label']}" for r in json.loads((sweep / "sweep.json").read_text())["runs"]}
    kinds = []
    for heading, head in md_tables(text):
        if heading.startswith(SWEEP_OTHER_SECTIONS):
            continue
        assert heading in labels, f"a new table under {heading!r}: name it in tests/unit/metrics/test_registry.py"
        if head[:1] == SUMMARY_REPEATS_FIRST:
            assert not not_registered(head[1:]), not_registered(head[1:])
            kinds.append("repeats")
        else:
            assert not not_registered(head), not_registered(head)
            kinds.append("levels")
    assert sorted(kinds) == ["levels", "repeats"]


def test_missing_values_follow_the_registry_rule(sweep, mixed):
    """A failed level's null KV figures read "—"; a tool's file that does not record them, "not recorded"."""
    job = (sweep / "summary.md").read_text()
    failed_row = next(line for line in job.splitlines() if line.startswith("| 8 |"))
    assert registry.NOT_EXPOSED not in failed_row and registry.UNKNOWN in failed_row
    assert registry.NOT_RECORDED in (mixed / "report.md").read_text()
