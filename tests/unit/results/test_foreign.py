"""Other tools' result files (recorded from real runs: tests/fixtures/foreign/README.md) read by their
shape, mapped to kvexp's levels with the files' own numbers, and rendered beside a kvexp run."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import FIXTURES

from kvexp.results import foreign
from kvexp.app.cli import main
from kvexp.metrics.registry import format_value
from kvexp.report.render import render_report
from kvexp.analysis.aggregate import collect
from kvexp.results.runs import Aggregate
from kvexp.results.store import ResultError, load_any

FIX = FIXTURES / "foreign"
VLLM_FILES = sorted((FIX / "vllm").glob("*.json"))
AIPERF_FILES = sorted((FIX / "aiperf").rglob("profile_export_aiperf.json"))
GUIDELLM_FILE = FIX / "guidellm" / "benchmarks.json"
KVEXP_RESULT = FIX / "kvexp" / "result.json"


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def run_of_tool(agg: Aggregate, tool: str) -> dict:
    """The run another tool measured, as the aggregate's file holds it."""
    (run,) = [r.to_json() for r in agg.runs if r.tool == tool]
    return run


def test_each_file_is_recognised_by_its_shape_not_its_name(tmp_path):
    for path, tool in [*((p, foreign.VLLM) for p in VLLM_FILES), *((p, foreign.AIPERF) for p in AIPERF_FILES),
                       (GUIDELLM_FILE, foreign.GUIDELLM)]:
        renamed = tmp_path / f"x-{tool}-{path.parent.name}.json"
        renamed.write_bytes(path.read_bytes())
        kind, doc = load_any(renamed)
        assert kind == "foreign" and foreign.sniff(doc) == tool, path
    assert load_any(KVEXP_RESULT)[0] == "result"
    assert len(VLLM_FILES) == 3 and len(AIPERF_FILES) == 3


def test_vllm_files_form_one_run_ordered_by_concurrency_with_the_files_medians():
    run = run_of_tool(collect(VLLM_FILES[::-1]), "vLLM bench serve")
    docs = sorted((read(p) for p in VLLM_FILES), key=lambda d: d["max_concurrency"])
    assert [lv["concurrency"] for lv in run["levels"]] == [1, 2, 4]
    for lv, doc in zip(run["levels"], docs):
        assert lv["ttft_p50_ms"] == doc["median_ttft_ms"]
        assert lv["tpot_p50_ms"] == doc["median_tpot_ms"]
        assert lv["itl_p50_ms"] == doc["median_itl_ms"]
        assert lv["e2e_p50_ms"] == doc["median_e2el_ms"]
        assert lv["ttft_p95_ms"] == doc["p95_ttft_ms"] and lv["ttft_p99_ms"] == doc["p99_ttft_ms"]
        assert lv["throughput_tok_s"] == doc["output_throughput"]
        assert lv["requests"] == doc["completed"] + doc["failed"] and lv["errors"] == doc["failed"]
        assert lv["mean_prompt_tokens"] == doc["total_input_tokens"] / doc["completed"]
        for key in ("peak_vram_gib", "peak_kv_cache_usage", "preemptions"):
            assert lv[key] is None
    assert run["label"] == "vllm-bench: tiny-vllm" and run["model"] == "tiny"
    assert {"peak_kv_cache_usage", "preemptions", "client_queue_p50_ms"} <= set(run["not_recorded"])
    assert any("before a connection is opened" in n for n in run["tool_notes"])
    assert any("own tokenizer" in n for n in run["tool_notes"])


def test_guidellm_benchmarks_are_the_levels_of_one_run():
    run = run_of_tool(collect([GUIDELLM_FILE]), "GuideLLM")
    doc = read(GUIDELLM_FILE)
    assert run["tool_version"] == doc["metadata"]["guidellm_version"]
    assert [lv["concurrency"] for lv in run["levels"]] == [b["config"]["strategy"]["streams"] for b in doc["benchmarks"]]
    for lv, b in zip(run["levels"], doc["benchmarks"]):
        m = b["metrics"]
        assert lv["ttft_p50_ms"] == m["time_to_first_token_ms"]["successful"]["median"]
        assert lv["tpot_p50_ms"] == m["inter_token_latency_ms"]["successful"]["percentiles"]["p50"]
        assert lv["e2e_p50_ms"] == m["request_latency"]["successful"]["percentiles"]["p50"] * 1000
        assert lv["throughput_tok_s"] == m["output_tokens_per_second"]["successful"]["mean"]
        assert lv["requests"] == m["request_totals"]["successful"] + m["request_totals"]["errored"]
        assert "itl_p50_ms" not in lv  # GuideLLM has no gap-by-gap ITL
    assert {"itl_p50_ms", "itl_p95_ms", "itl_p99_ms"} <= set(run["not_recorded"])
    assert (run["prompt_tokens"], run["max_tokens"]) == (32, 16)  # as asked (config.spec.data)


def test_aiperf_exports_group_into_one_run_with_the_files_values():
    run = run_of_tool(collect(AIPERF_FILES), "AIPerf")
    docs = sorted((read(p) for p in AIPERF_FILES), key=lambda d: d["input_config"]["phases"][0]["concurrency"])
    assert [lv["concurrency"] for lv in run["levels"]] == [1, 2, 4]
    for lv, doc in zip(run["levels"], docs):
        assert lv["ttft_p50_ms"] == doc["time_to_first_token"]["p50"]
        assert lv["tpot_p50_ms"] == doc["inter_token_latency"]["p50"]
        assert lv["itl_p50_ms"] == doc["inter_chunk_latency"]["p50"]
        assert lv["e2e_p50_ms"] == doc["request_latency"]["p50"]
        assert lv["throughput_tok_s"] == doc["output_token_throughput"]["avg"]
        assert lv["wall_s"] == doc["benchmark_duration"]["avg"]  # unit "sec"
        assert lv["mean_output_tokens"] == doc["output_sequence_length"]["avg"]
    assert run["tool_version"] == docs[0]["aiperf_version"]
    # The client's tokenizer counted more than the server's 16: the notes say which count this is.
    assert any("AIPerf's tokenizer" in n and "averaged 16 tokens" in n for n in run["tool_notes"])
    assert (run["prompt_tokens"], run["max_tokens"]) == (32, 16)


def test_the_mixed_report_puts_every_tool_in_the_kvexp_scenario(tmp_path):
    agg = collect([FIX])
    tools = sorted(str(r.tool) for r in agg.runs)
    assert tools == ["AIPerf", "GuideLLM", "None", "vLLM bench serve"]
    assert {r.scenario for r in agg.runs} == {"smoke"}  # one table, one set of charts
    files = render_report(agg, tmp_path, formats=("md", "html"))
    md, html = files["md"].read_text(), files["html"].read_text()
    assert "CPU only: " in md.splitlines()[0] and "unknown GPU" not in md
    for name in ("vLLM bench serve", "GuideLLM 0.8.1", "AIPerf 0.13.0"):
        assert name in md and name in html
    assert "Measured by GuideLLM" in md and "Measured by AIPerf" in html
    table = md.split("## Scenario: smoke", 1)[1]
    for run in (r.to_json() for r in agg.runs):
        for lv in run["levels"]:
            row = f"| {run['label']} | {'fp16' if not run.get('tool') else '—'} | {lv['concurrency']} |"
            line = next(ln for ln in table.splitlines() if ln.startswith(row))
            assert f"| {format_value('ttft_p50_ms', lv['ttft_p50_ms'])} |" in line, line
            assert f"| {format_value('throughput_tok_s', lv['throughput_tok_s'])} |" in line, line
    rows = list(csv.DictReader(files["csv"].open()))
    assert len(rows) == 12 and {r["tool"] for r in rows} == {"kvexp", "vLLM bench serve", "GuideLLM 0.8.1",
                                                              "AIPerf 0.13.0"}
    vllm1 = next(r for r in rows if r["tool"] == "vLLM bench serve" and r["concurrency"] == "1")
    assert float(vllm1["ttft_p50_ms"]) == read(FIX / "vllm" / "tiny-vllm-concurrency1.json")["median_ttft_ms"]
    assert '<td class="num na">not recorded</td>' in html  # KV usage of another tool's run: not 0, not "—"
    assert len(json.loads(files["json"].read_text())["runs"]) == 4


def test_an_unknown_shape_is_refused_with_one_line(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"results": [{"ttft": 1.0}]}))
    expected = f"{path}: unknown shape: {foreign.EXPECTED}"
    assert main(["validate", str(path)]) == 1
    assert capsys.readouterr().out.strip() == expected
    assert main(["report", str(path), "--out", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err.strip() == f"kvexp: {expected}"
    assert main(["results", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"kvexp: {expected}" and "\n" not in err


def test_validate_accepts_each_tool_file(capsys):
    assert main(["validate", *map(str, [*VLLM_FILES, *AIPERF_FILES, GUIDELLM_FILE, KVEXP_RESULT])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 8 and all(line.endswith(": valid") for line in out)


def test_a_broken_tool_file_names_the_field(tmp_path, capsys):
    doc = read(VLLM_FILES[0])
    doc["completed"] = "sixteen"
    path = tmp_path / "v.json"
    path.write_text(json.dumps(doc))
    assert main(["validate", str(path)]) == 1
    assert capsys.readouterr().out.strip() == f"{path}: $.completed: expected a number, found 'sixteen'"
    with pytest.raises(ResultError, match=r"\$\.completed: expected a number"):
        collect([path])


def test_vllm_zeros_when_nothing_succeeded_are_missing_not_zero(tmp_path):
    doc = read(VLLM_FILES[1])
    ok = read(VLLM_FILES[0])
    doc.update(completed=0, failed=16, output_throughput=0.0, median_ttft_ms=0.0, p99_ttft_ms=0.0)
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    paths[0].write_text(json.dumps(doc))
    paths[1].write_text(json.dumps(ok))
    run = run_of_tool(collect(paths), "vLLM bench serve")
    failed = next(lv for lv in run["levels"] if lv["concurrency"] == doc["max_concurrency"])
    assert failed["status"] == "failed" and failed["errors"] == 16 and failed["requests"] == 16
    assert failed["ttft_p50_ms"] is None and failed["throughput_tok_s"] is None
    assert run["status"] == "partial"


def test_appended_results_and_repeats(tmp_path):
    one, two = VLLM_FILES[0].read_text().strip(), VLLM_FILES[1].read_text().strip()
    appended = tmp_path / "appended.json"  # what --append-result writes: one object per line
    appended.write_text(one + "\n" + two)
    run = run_of_tool(collect([appended]), "vLLM bench serve")
    assert [lv["concurrency"] for lv in run["levels"]] == [1, 2]
    again = tmp_path / "again.json"
    again.write_text(one)
    run = run_of_tool(collect([appended, again]), "vLLM bench serve")
    assert [(lv["concurrency"], lv.get("repeat")) for lv in run["levels"]] == [(1, 0), (1, 1), (2, None)]


def test_results_command_and_frame_have_comparison_csv_columns(tmp_path, capsys):
    out = tmp_path / "levels.csv"
    assert main(["results", str(FIX), "--csv", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"csv: {out}"
    render_report(collect([FIX]), tmp_path / "rep", formats=("md",))
    assert out.read_text() == (tmp_path / "rep" / "comparison.csv").read_text()
    assert main(["results", str(VLLM_FILES[0]), "--csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("label,tool,backend,model,scenario,")
    pd = pytest.importorskip("pandas")
    import kvexp

    df = kvexp.results_frame([FIX])
    assert isinstance(df, pd.DataFrame) and len(df) == 12
    assert list(df.columns) == next(csv.reader(out.open()))
    aiperf = df[df["tool"] == "AIPerf 0.13.0"].sort_values("concurrency")
    docs = sorted((read(p) for p in AIPERF_FILES), key=lambda d: d["input_config"]["phases"][0]["concurrency"])
    assert list(aiperf["ttft_p50_ms"]) == [d["time_to_first_token"]["p50"] for d in docs]
    assert df[df["tool"] == "GuideLLM 0.8.1"]["itl_p50_ms"].isna().all()  # missing, never 0


def test_help_lists_commands_and_real_options_not_schemas(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("validate", "report", "results", "plan", "install", "resume"):
        assert f"\n  {cmd} " in out
    assert "backend={llamacpp,ollama,vllm}" in out and "scenario={chat,cpu,lengths,long,multiturn,prefix,quality,sharegpt,smoke,trace}" in out
    assert "scenario.concurrency" in out and "_schema" not in out
    assert main(["plan", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m kvexp plan")
    assert main(["--version"]) == 0
    from kvexp.core import __version__

    assert capsys.readouterr().out.strip() == f"kvexp {__version__}"
