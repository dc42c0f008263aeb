"""The comparison report: files, numbers that trace to the input, findings, the PDF, escaping, and the
optional parts of kvexp's own aggregates (failed, variable-length, open-loop runs, null values)."""

from __future__ import annotations

import copy
import csv
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvexp.analysis import documents as D
from kvexp.analysis import flags as FL
from kvexp.analysis import runplan as RP
from kvexp.analysis import findings as F
from kvexp.report import charts as C
from kvexp.report import pdf
from kvexp.report import render as R
from kvexp.report import tables as T
from kvexp.report.markdown import md_escape
from kvexp.report.setup_view import default_title
from kvexp.report.templating import ReportError, templates_dir
from kvexp.results.runs import Aggregate, Run

PDFTOPPM = shutil.which("pdftoppm") or ("/usr/bin/pdftoppm" if Path("/usr/bin/pdftoppm").is_file() else None)


# ----------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def reference(reference_path: Path) -> dict:
    if not reference_path.is_file():
        pytest.skip(f"reference document missing: {reference_path}")
    return json.loads(reference_path.read_text())


@pytest.fixture(scope="module")
def rendered(reference: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The reference rendered once, every format (the PDF is the slow part: a few seconds)."""
    out = tmp_path_factory.mktemp("reference-report")
    files = R.render_report(Aggregate.from_json(copy.deepcopy(reference)), out)
    return out, files


def _level(concurrency=None, rate=None, **kw) -> dict:
    base = {"concurrency": concurrency, "requests": 48, "errors": 0, "throughput_tok_s": 100.0,
            "ttft_p50_ms": 100.0, "ttft_p95_ms": 120.0, "tpot_p50_ms": 10.0, "peak_vram_gib": 8.0,
            "peak_kv_cache_usage": None, "preemptions": None, "mean_prompt_tokens": 512.0}
    if rate is not None:
        base["rate"] = rate
    base.update(kw)
    return base


def _kv(dtype=None, **kw) -> dict:
    return {"dtype": dtype, "blocks": None, "block_size": None, "gpu_memory_utilization": None, **kw}


def _run(label, backend, scenario="chat", levels=(), **kw) -> dict:
    return {"label": label, "backend": backend, "model": kw.pop("model", "tiny"), "scenario": scenario,
            "prompt_tokens": 512, "max_tokens": 128, "started_at": "2026-12-01 10:00 UTC", "gpu": "Test GPU",
            "gpu_gib": 24.0, "kv_cache": kw.pop("kv_cache", _kv()), "levels": list(levels), **kw}


def extended_aggregate() -> dict:
    """kvexp's own aggregate shape with every optional part: a failed run, an Ollama variable-length run,
    an open-loop run, repeats, warnings, a planner block, null values and hostile labels."""
    planner = {"kv_bytes_per_token": 28672, "capacity_tokens": 20000, "blocks": 1250, "block_size": 16,
               "request_tokens": 640, "max_concurrency_before_preemption": 31, "max_concurrent_requests": 31,
               "levels": [{"concurrency": c, "predicted_kv_usage": min(1.0, c * 640 / 20000),
                           "predicts_preemption": c > 31, "predicts_queueing": c > 31} for c in (1, 8, 32)],
               "calibrated": {"capacity_tokens": 18000, "max_concurrency_before_preemption": 28,
                              "levels": [{"concurrency": c, "predicted_kv_usage": min(1.0, c * 640 / 18000),
                                          "predicts_preemption": c > 28} for c in (1, 8, 32)]}}
    vllm_levels = [
        _level(1, throughput_tok_s=90.0, peak_kv_cache_usage=0.03, preemptions=0.0, ttft_p99_ms=130.0,
               itl_p50_ms=9.5, e2e_p50_ms=1300.0, wall_s=12.5, mean_output_tokens=128.0, repeat=0, status="ok",
               warnings=[], client_limited=False, goodput_req_s=3.9),
        _level(8, throughput_tok_s=600.0, ttft_p50_ms=150.0, ttft_p95_ms=700.0, peak_kv_cache_usage=0.26,
               preemptions=0.0, repeat=0, status="ok", client_limited=True,
               warnings=[{"code": "ttft_spread", "text": "wide TTFT spread: p95 700.0 ms is over 3x p50 150.0 ms",
                          "values": {"ttft_p50_ms": 150.0, "ttft_p95_ms": 700.0}},
                         {"code": "client_limited", "text": "client event loop lagged 80 ms (p99): the client may "
                          "have limited this level", "values": {"loop_lag_p99_ms": 80.0}}]),
        _level(8, throughput_tok_s=450.0, ttft_p50_ms=160.0, ttft_p95_ms=300.0, peak_kv_cache_usage=0.27,
               preemptions=0.0, repeat=1, status="ok", warnings=[]),
        _level(32, requests=12, errors=3, throughput_tok_s=None, ttft_p50_ms=None, ttft_p95_ms=None,
               peak_kv_cache_usage=1.0, preemptions=4.0, repeat=0, status="failed",
               status_reason="3/12 requests failed (timeout 3)",
               warnings=[{"code": "errors", "text": "3 of 12 requests failed", "values": {"errors": 3}},
                         {"code": "few_requests", "text": "only 12 requests: percentiles are rough",
                          "values": {"requests": 12}}]),
    ]
    return {
        "schema_version": 2, "kind": "kvexp.aggregate", "kvexp_version": "0.1.0", "title": None,
        "environment": {"hostname": "box", "cpu": "Test CPU", "python": "3.11.7", "kvexp_version": "0.1.0",
                        "client": {"aiohttp": "3.9"}},
        "gpu": "Test GPU", "gpu_gib": 24.0, "run_dates": ["2026-12-01 10:00 UTC"],
        "runs": [
            _run("vllm-fp8-chat", "vllm", levels=vllm_levels, status="complete", backend_version="0.32.0",
                 launch_command=["python", "-m", "vllm.entrypoints.openai.api_server", "--kv-cache-dtype", "fp8"],
                 variable_length=False, kv_requested="fp8", reused_server=False, planner=planner,
                 kv_cache=_kv("fp8", blocks=1250, block_size=16, gpu_memory_utilization=0.9, capacity_tokens=20000,
                              bytes=573440000, max_concurrency=31.25, dtype_k="fp8", dtype_v="fp8",
                              source=["log", "metrics"])),
            _run("vllm-fp16-chat", "vllm", status="failed", levels=[], kv_requested="fp16",
                 status_reason="INFO starting\nWARNING something\nValueError: not enough KV cache memory | boom",
                 launch_command=["python", "-m", "vllm.entrypoints.openai.api_server"], variable_length=False),
            _run("ollama-q8", "ollama", status="complete", variable_length=True, kv_requested="q8_0",
                 backend_version="0.12.3", launch_command=["ollama", "serve"], reused_server=True,
                 levels=[_level(1, throughput_tok_s=80.0, mean_output_tokens=97.5, status="ok", warnings=[]),
                         _level(4, throughput_tok_s=82.0, ttft_p50_ms=900.0, ttft_p95_ms=1500.0,
                                mean_output_tokens=101.2, status="ok", warnings=[]),
                         _level(8, throughput_tok_s=81.0, ttft_p50_ms=2500.0, ttft_p95_ms=3000.0,
                                mean_output_tokens=None, status="ok", warnings=[])]),
            _run("llamacpp-open", "llamacpp", scenario="open", status="complete", kv_requested="q8_0",
                 kv_cache=_kv(None, dtype_k="q8_0", dtype_v="q8_0", capacity_tokens=8192),
                 levels=[_level(None, rate=r, achieved_rate=r * 0.98, throughput_tok_s=100.0 * r,
                                requests=40, peak_rss_gib=1.25, status="ok", warnings=[]) for r in (0.5, 1.0, 2.0)]),
            _run("<script>alert(1)</script>", "llamacpp", model="evil|model <b>", status="partial",
                 status_reason="stopped early", levels=[_level(2, requests=10, errors=1, ttft_p95_ms=None)]),
        ],
        "calibration": [
            {"model": "tiny", "preset": None, "kv_cache_dtype": "fp8", "gpu_gib": 24.0, "weights_gib": 1.0,
             "gpu_memory_utilization": 0.9, "predicted_tokens": 20000, "actual_tokens": 20000, "error_pct": 0.0,
             "calibrated_tokens": 19800, "calibrated_error_pct": -1.0},
        ],
        "planner": None,
    }


@pytest.fixture(scope="module")
def extended(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, dict]:
    agg = extended_aggregate()
    out = tmp_path_factory.mktemp("extended-report")
    files = R.render_report(Aggregate.from_json(copy.deepcopy(agg)), out, formats=("md", "html"))
    return agg, out, files


# ----------------------------------------------------------------------------------------------
# Markdown table parsing (for tracing numbers back to the input)


def _unescape(cell: str) -> str:
    return re.sub(r"\\(.)", r"\1", cell)


def _split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [_unescape(c.strip()) for c in cells]


def md_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|(-+:?\|)+$", lines[i + 1]):
            head, rows = _split_row(lines[i]), []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_split_row(lines[i]))
                i += 1
            out.append((head, rows))
        else:
            i += 1
    return out


# ----------------------------------------------------------------------------------------------
# The reference document


def test_reference_writes_every_file(rendered, reference):
    out, files = rendered
    for name in ("report.md", "report.html", "report.pdf", "comparison.json", "comparison.csv"):
        assert (out / name).is_file(), name
    assert set(files) >= {"md", "html", "pdf", "json", "csv"}
    assert not files.problems
    assert json.loads((out / "comparison.json").read_text()) == reference  # calibration/planner kept
    charts = sorted(p.name for p in (out / "charts").glob("*.png"))
    assert "long-throughput.png" in charts and "chat-kv.png" in charts
    md = (out / "report.md").read_text()
    for c in charts:
        assert f"(charts/{c})" in md
    html = (out / "report.html").read_text()
    assert html.count("<svg") >= 10 and "<img" not in html


def test_reference_csv_has_one_row_per_level(rendered, reference):
    out, _ = rendered
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert len(rows) == sum(len(r["levels"]) for r in reference["runs"])
    first = rows[0]
    assert {"label", "backend", "model", "scenario", "kv_dtype", "throughput_tok_s",
            "peak_kv_cache_usage"} <= set(first)
    r0 = reference["runs"][0]
    assert first["label"] == r0["label"] and float(first["throughput_tok_s"]) == r0["levels"][0]["throughput_tok_s"]
    assert first["peak_kv_cache_usage"] == ""  # null stays empty, never 0


def _decimals(cell: str) -> int:
    return len(cell.split(".", 1)[1]) if "." in cell else 0


def test_markdown_level_tables_trace_to_the_input(rendered, reference):
    out, _ = rendered
    by_header = {T.header(k): k for k in T.LEVEL_COLUMNS}
    typed = {r.label: r for r in Aggregate.from_json(reference).runs}
    runs = {r["label"]: r for r in reference["runs"]}
    tables = [(h, rows) for h, rows in md_tables((out / "report.md").read_text()) if h[:2] == ["Run", "KV"]]
    assert len(tables) == 2  # one per scenario
    seen = 0
    for head, rows in tables:
        for row in rows:
            cells = dict(zip(head, row))
            run = runs[cells["Run"]]
            i = next(i for i, lv in enumerate(run["levels"]) if str(lv["concurrency"]) == cells["Concurrency"])
            level = run["levels"][i]
            for header, cell in cells.items():
                key = by_header.get(header)
                if key is None:
                    continue
                value = level[key]
                assert cell == T.level_cell(typed[run["label"]], typed[run["label"]].levels[i], key), (run["label"], key)
                if value is None:
                    assert run["backend"] in ("llamacpp", "ollama") and key in D.EXPOSURE_KEYS
                    assert cell == "not exposed"
                    continue
                scale = 100 if key == "peak_kv_cache_usage" else 1
                assert abs(float(cell) - value * scale) <= 0.5 * 10 ** -_decimals(cell) + 1e-9, (run["label"], key)
            seen += 1
    assert seen == sum(len(r["levels"]) for r in reference["runs"])


def test_html_ids_are_unique_and_every_reference_resolves(rendered):
    out, _ = rendered
    html = (out / "report.html").read_text()
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert len(ids) > 100 and len(ids) == len(set(ids))  # ten inline SVGs, none sharing an id
    refs = set(re.findall(r'(?:href="|url\()#([^")]+)', html))
    assert refs and refs <= set(ids)


def test_html_shows_the_same_numbers(rendered):
    out, _ = rendered
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    for cell in ("359.0", "25851.8", "47318.8", "125.66", "15.58", "65.4"):
        assert f"| {cell} |" in md and f">{cell}</td>" in html


def test_reference_findings(reference):
    found = F.compute_findings(Aggregate.from_json(reference))
    best = [f for f in found
            if f.kind == "best_throughput" and f.scenario == "long" and f.numbers.get("concurrency") == 48]
    assert len(best) == 1 and best[0].runs[0] == "vllm-fp8kv-long"
    assert all(w in best[0].sentence for w in ("vLLM", "fp8", "highest throughput", "long", "concurrency 48", "359.0"))
    flat = [f for f in found if f.kind == "no_growth" and f.runs == ("ollama-q4km",)]
    assert len(flat) == 1
    assert "Ollama's throughput does not grow with concurrency" in flat[0].sentence
    assert "118.4 → 112.8 → 99.1 tok/s" in flat[0].sentence
    kinds = {f.kind for f in found}
    assert {"kv_gain", "preemption", "variable_length", "not_exposed", "best_overall_ttft_p95"} <= kinds
    pre = next(f for f in found if f.kind == "preemption")
    assert pre.runs == ("vllm-fp16kv-long",) and pre.numbers["concurrency"] == 48
    gain = next(f for f in found if f.kind == "kv_gain" and f.runs[0] == "vllm-fp8kv-long")
    assert gain.numbers["baseline_kv"] == "auto" and round(gain.numbers["levels"][-1]["gain_pct"], 1) == 21.0
    sat = next(f for f in found if f.kind == "saturation")
    assert sat.runs == ("vllm-fp16kv-long",) and sat.numbers["concurrency"] == [32.0, 48.0]


def test_reference_findings_in_the_report(rendered):
    out, _ = rendered
    md = (out / "report.md").read_text()
    assert "Ollama's throughput does not grow with concurrency" in md
    assert "long, concurrency 48: vllm-fp8kv-long (vLLM, fp8 KV) has the highest throughput" in md
    assert "## Planner" in md and "Calibration: predicted vs actual" in md and "143040" in md and "-9.5" in md


def test_reference_warnings(reference):
    warns = FL.level_warnings(Aggregate.from_json(reference))
    assert {w.tag for w in warns} == {"spread"}
    assert {(w.label, reference["runs"][w.run_index]["levels"][w.level_index]["concurrency"]) for w in warns} == {
        ("vllm-fp16kv-long", 32), ("vllm-fp16kv-long", 48), ("vllm-fp8kv-long", 32), ("vllm-fp8kv-long", 48)}


@pytest.mark.skipif(PDFTOPPM is None, reason="pdftoppm (poppler-utils) is not installed: apt-get install poppler-utils")
def test_pdf_pages_are_not_blank(rendered, tmp_path):
    from PIL import Image

    out, _ = rendered
    subprocess.run([PDFTOPPM, "-r", "50", "-png", str(out / "report.pdf"), str(tmp_path / "page")], check=True,
                   timeout=60)
    pages = sorted(tmp_path.glob("page*.png"))
    assert len(pages) >= 2
    inked = []
    for p in pages:
        im = Image.open(p).convert("L")
        w, h = im.size
        assert w > h > 300  # landscape A4 at 50 dpi is 585 x 413
        dark = sum(im.histogram()[:235])
        inked.append(dark / (w * h))
    assert all(f > 0.002 for f in inked), inked
    assert max(inked) > 0.03, inked  # the chart pages carry real drawing


# ----------------------------------------------------------------------------------------------
# kvexp's extended aggregate


def test_extended_aggregate_renders(extended):
    agg, out, files = extended
    assert set(files) >= {"md", "html", "json", "csv"} and "pdf" not in files
    md = (out / "report.md").read_text()
    tables = md_tables(md)
    runs_table = next((h, rows) for h, rows in tables if h[:2] == ["Run", "Backend"])
    status = {row[0]: dict(zip(runs_table[0], row))["Status"] for row in runs_table[1]}
    assert status["vllm-fp16-chat"] == "failed" and status["<script>alert(1)</script>"] == "partial"
    assert "## Failed and partial runs" in md and "ValueError: not enough KV cache memory \\| boom" in md
    assert "vllm-fp16-chat (vLLM, fp16 KV, chat) failed" in md
    # null values are "—"; a failed level keeps its row
    level_tables = [(h, rows) for h, rows in tables if h[:2] == ["Run", "KV"]]
    chat = next(rows for h, rows in level_tables if "Concurrency" in h and any(r[0] == "vllm-fp8-chat" for r in rows))
    head = next(h for h, rows in level_tables if rows is chat)
    failed_row = next(dict(zip(head, r)) for r in chat if r[0] == "vllm-fp8-chat" and r[2] == "32")
    assert failed_row["Throughput (tok/s)"] == "—" and "failed" in failed_row["Notes"]
    assert failed_row["Preemptions"] == "4" and failed_row["Peak KV usage (%)"] == "100.0"
    assert "Repeat" in head
    # open loop: a rate column, rate charts
    open_head, open_rows = next((h, rows) for h, rows in level_tables if "Rate (req/s)" in h)
    assert "Concurrency" not in open_head and [dict(zip(open_head, r))["Rate (req/s)"] for r in open_rows] == [
        "0.50", "1.00", "2.00"]
    assert (out / "charts" / "open-rate-throughput.png").is_file()
    # detail tables appear because the levels carry the extra columns
    assert "#### Latency detail" in md and "ITL p50 (ms)" in md and "Load and memory detail" in md
    # planner: the run's own block, calibrated too
    assert "Max concurrency (calibrated)" in md and "Calibrated error (%)" in md
    assert "vllm.entrypoints.openai.api_server --kv-cache-dtype fp8" in md


def test_extended_findings_and_warnings():
    agg = Aggregate.from_json(extended_aggregate())
    found = F.compute_findings(agg)
    kinds = [f.kind for f in found]
    assert "failed" in kinds and "partial" in kinds and "failed_level" in kinds
    var = next(f for f in found if f.kind == "variable_length")
    assert var.runs == ("ollama-q8",) and not var.numbers["assumed"] and "97.5" in var.sentence
    flat = next(f for f in found if f.kind == "no_growth")
    assert flat.runs == ("ollama-q8",)
    warns = FL.level_warnings(agg)
    codes = {(w.label, w.tag) for w in warns}
    assert ("vllm-fp8-chat", "spread") in codes and ("vllm-fp8-chat", "client") in codes
    assert ("vllm-fp8-chat", "failed") in codes and ("vllm-fp8-chat", "errors") in codes
    assert ("vllm-fp8-chat", "cv") in codes  # 600 vs 450 tok/s across two repeats
    assert ("<script>alert(1)</script>", "errors") in codes and ("<script>alert(1)</script>", "n<20") in codes
    plan = RP.run_plan(agg.runs[0], agg)
    assert plan.source == "run planner" and plan.max_concurrency == 31 and plan.calibrated_max_concurrency == 28
    merged = agg.runs[0].merged_levels()
    assert [lv.concurrency for lv in merged] == [1, 8, 32]
    assert merged[1].throughput_tok_s == 525.0 and merged[1].requests == 96


def test_html_autoescapes_user_input(extended):
    _, out, _ = extended
    html = (out / "report.html").read_text()
    assert "<script>" not in html and "<b>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "evil|model &lt;b&gt;" in html
    md = (out / "report.md").read_text()
    assert "\\<script\\>alert(1)\\</script\\>" in md and "evil\\|model \\<b\\>" in md


def test_markdown_escape():
    assert md_escape("a|b") == "a\\|b"
    assert md_escape("line\nbreak") == "line break"
    assert md_escape("snake_case") == "snake_case" and md_escape("_x_") == "\\_x\\_"
    t = T.Table(["A|B", "n"], [["x|y", "1"]], [False, True])
    assert T.md_table(t).splitlines() == ["| A\\|B | n |", "|---|---:|", "| x\\|y | 1 |"]


def test_missing_pango_still_writes_markdown_and_html(tmp_path, monkeypatch, reference):
    monkeypatch.setitem(sys.modules, "weasyprint", None)  # `import weasyprint` now raises ImportError
    agg = {**reference, "runs": reference["runs"][:2]}
    files = R.render_report(Aggregate.from_json(agg), tmp_path, formats=("md", "html", "pdf"))
    assert (tmp_path / "report.md").is_file() and (tmp_path / "report.html").is_file()
    assert "pdf" not in files and not (tmp_path / "report.pdf").exists()
    assert len(files.problems) == 1 and "apt-get install libpango-1.0-0 libpangoft2-1.0-0" in files.problems[0]
    assert "\n" not in files.problems[0]
    assert pdf.support() is not None


def test_rendering_leaves_the_aggregate_alone(reference, tmp_path):
    agg = extended_aggregate()
    before, ref_before = copy.deepcopy(agg), copy.deepcopy(reference)
    typed, typed_ref = Aggregate.from_json(agg), Aggregate.from_json(reference)
    R.build_context(typed, None, None, svg=False)
    R.build_context(typed_ref, None, None, svg=False)
    T.write_csv(typed, tmp_path / "c.csv")
    assert agg == before and reference == ref_before
    assert typed.to_json() == before and typed_ref.to_json() == ref_before


def test_default_title_and_override(reference, extended):
    assert default_title(Aggregate.from_json(reference)).startswith("kvexp comparison — NVIDIA GeForce RTX 5070 Ti — ")
    ctx = R.build_context(Aggregate.from_json(reference), "My title", None, svg=False)
    assert ctx["title"] == "My title"
    _, out, _ = extended
    assert (out / "report.md").read_text().startswith("# kvexp comparison — Test GPU — ")


def test_unknown_format_is_one_line(tmp_path, reference):
    with pytest.raises(ReportError, match=r"formats=\['docx'\]: unknown docx"):
        R.render_report(Aggregate.from_json(reference), tmp_path, formats=("docx",))


def test_colours_follow_the_configuration():
    runs = [{"label": "vllm-fp8kv-chat", "scenario": "chat"}, {"label": "vllm-fp8kv-long", "scenario": "long"},
            {"label": "ollama", "scenario": "chat"}]
    keys = [R.colour_key(Run.from_json(r)) for r in runs]
    assert keys[0] == keys[1] == "vllm-fp8kv" and keys[2] == "ollama"
    cmap = C.colour_map(keys)
    assert len(set(cmap.values())) == 2


def test_templates_are_found():
    d = templates_dir()
    assert (d / "report.md.j2").is_file() and (d / "report.html.j2").is_file()


def test_runs_sharing_a_label_are_told_apart_by_what_differs():
    """A sweep over backend.threads=1,2 gave two jobs named alike: every table and verdict showed
    `llamacpp-tiny-fp16-smoke` twice. The settings that differ are added; runs that differ in nothing
    (the same result read twice from two copies) get a number."""
    from kvexp.analysis.aggregate import distinct_labels

    def cfg(threads, out):
        return {"backend": {"name": "llamacpp", "threads": threads}, "output_dir": out, "label": ""}

    runs = [Run(label=label) for label in ("a", "a", "b", "c", "c")]
    configs = [cfg(1, "/x/0"), cfg(2, "/x/1"), cfg(1, "/x/2"), cfg(1, "/y/0"), None]
    distinct_labels(runs, configs)
    assert [r.label for r in runs] == ["a (threads=1)", "a (threads=2)", "b", "c (1)", "c (2)"]
